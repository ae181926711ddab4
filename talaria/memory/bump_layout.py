"""Where weights, KV pages and runtime buffers live in one rank's arena, as byte offsets (paper §4.2).

The arena is one managed buffer shared by every model the instance may serve. Its layout is fixed:

    0 ─ weights ─ align_up(weight_bytes) ─ states ─ KV pages … null page ─ runtime start ─ runtime ─ arena_bytes

Weights grow from the low end, runtime buffers are anchored at the high end, and the KV pool fills
the gap. A model whose cache keeps per-sequence state (its `KVLayout` has `state_bytes`) has a state
region of fixed-size slots just above its weights: the live states of running sequences and their
published snapshots. It sits below the page pool, whose high-address tail is where the next model's
weights are staged, so staging never overwrites a state. A switch from model m to m' releases m's KV region, resizes the weights region for m' and
rebinds m''s parameters as views; nothing is freed or reallocated, so addresses stay put:

- the weights base is 0 for every model;
- the runtime base depends only on `arena_bytes` and `runtime_bytes`, never on the model;
- the KV base is `align_up(weight_bytes)` plus the state region, so it moves only when those sizes
  change (two models whose aligned weight sizes are equal and that keep no state share it).

The engine's pointer check compares `bases()` before and after a switch: a moved KV base means the
cached KV shell (and anything that captured its address) must be rebuilt.

No tensors here: the engine owns the bytes; this module only decides the offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

from talaria.contracts.kv_layout import KVLayout

ALIGN = 256  # bytes: every region of an arena starts on it (any dtype, vector loads); the arena's and the simulator's


def align_up(n: int, align: int) -> int:
    """The smallest multiple of `align` that is >= n."""
    return -(-n // align) * align


def align_down(n: int, align: int) -> int:
    """The largest multiple of `align` that is <= n."""
    return n // align * align


class LayoutError(MemoryError):
    """A model does not fit the arena: too few bytes for its weights, runtime and minimum KV pool."""


@dataclass(frozen=True, slots=True)
class Region:
    """A half-open byte range [start, end) of the arena (or of a model's host weight image)."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"Region({self.start}, {self.end}): need 0 <= start <= end")

    @property
    def size(self) -> int:
        return self.end - self.start

    def overlaps(self, other: Region) -> bool:
        """True when the two ranges share at least one byte (an empty range overlaps nothing)."""
        return self.start < other.end and other.start < self.end and self.size > 0 and other.size > 0

    def contains(self, other: Region) -> bool:
        """True when every byte of `other` lies in this range."""
        return self.start <= other.start and other.end <= self.end


@dataclass(frozen=True, slots=True)
class LayoutPlan:
    """The byte layout of the arena while `model` is active; the contract between layout and engine.

    The KV region is page-major: page p is the contiguous range
    [kv.start + p * page_bytes, kv.start + (p + 1) * page_bytes). Pages 0..num_pages-1 are
    allocatable; page `num_pages` is the null page (zeros, never allocated, the target of attention
    padding). Bytes after the null page up to `kv.end` are alignment slack and stay unused. State
    slot s is [states.start + s * state_bytes, states.start + (s + 1) * state_bytes).
    """

    model: str
    weights: Region  # [0, align_up(weight_bytes)): the model's parameters, as one flat image
    kv: Region  # [states.end, runtime.start): num_pages pages, then the null page, then slack
    runtime: Region  # [runtime start, arena_bytes): the same for every model
    page_bytes: int  # bytes of one KV page: every per-token cache tensor of every layer (KVLayout.page_bytes)
    num_pages: int  # allocatable pages, the null page not counted
    states: Region = Region(0, 0)  # [weights.end, kv.start): the state slots; empty without state
    state_bytes: int = 0  # bytes of one state slot (KVLayout.state_bytes); 0 = no per-sequence state
    num_state_slots: int = 0  # live states of running sequences and published snapshots

    @property
    def null_page(self) -> int:
        """Id of the all-zero page after the last allocatable one."""
        return self.num_pages

    @property
    def page_pool(self) -> Region:
        """The allocatable pages only: [kv.start, start of the null page)."""
        return Region(self.kv.start, self.kv.start + self.num_pages * self.page_bytes)

    def page_region(self, page: int) -> Region:
        """The bytes of page `page` (0..num_pages; num_pages is the null page)."""
        if not 0 <= page <= self.num_pages:
            raise IndexError(f"page {page} out of range: {self.model} has pages 0..{self.num_pages} "
                             f"({self.num_pages} is the null page)")
        start = self.kv.start + page * self.page_bytes
        return Region(start, start + self.page_bytes)

    def pages_overlapping(self, region: Region) -> range:
        """Allocatable pages (never the null page) that share at least one byte with `region`."""
        pool = self.page_pool
        if not region.overlaps(pool):
            return range(0)
        first = (max(region.start, pool.start) - pool.start) // self.page_bytes
        last = -(-(min(region.end, pool.end) - pool.start) // self.page_bytes)  # exclusive, rounded up
        return range(first, last)


@dataclass(frozen=True, slots=True)
class Bases:
    """Start offsets of the three regions: what the engine's pointer check compares across a switch."""

    weights: int
    kv: int
    runtime: int


@dataclass(frozen=True, slots=True)
class _ModelSizes:
    weight_bytes: int
    page_bytes: int
    state_bytes: int
    state_slots: int

    @property
    def state_region(self) -> int:
        return self.state_bytes * self.state_slots


class BumpLayout:
    """The bump layout of one rank's arena for every model the instance may serve.

    `register` each model once with its weight-image size and cache layout; `plan` computes its
    layout; `activate` records which model currently owns the arena. Plans are deterministic: the
    same sizes always give the same offsets, on every rank and in the simulator.
    """

    MIN_PAGES = 4  # fewer KV pages than this cannot serve even one short request usefully

    def __init__(self, arena_bytes: int, runtime_bytes: int, align: int = 256) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align = {align}: must be a power of two")
        if arena_bytes <= 0 or runtime_bytes < 0:
            raise ValueError(f"arena_bytes = {arena_bytes}, runtime_bytes = {runtime_bytes}: "
                             "need arena_bytes > 0 and runtime_bytes >= 0")
        self.arena_bytes = arena_bytes
        self.runtime_bytes = runtime_bytes
        self.align = align
        # The runtime start is rounded down to `align` so every region starts aligned; with an
        # aligned arena_bytes and runtime_bytes it is exactly arena_bytes - runtime_bytes.
        self._runtime_start = align_down(arena_bytes - runtime_bytes, align)
        self._models: dict[str, _ModelSizes] = {}
        self._active: LayoutPlan | None = None

    # ---- registration ----------------------------------------------------------------------

    def register(self, model: str, weight_bytes: int, layout: KVLayout, state_slots: int = 0) -> None:
        """Declare a model this instance may serve, with its cache layout and the state slots it
        keeps (`layout.state_slots(max_running)`); registering the same sizes again is a no-op."""
        if weight_bytes <= 0 or layout.page_bytes <= 0:
            raise ValueError(f"model {model!r}: weight_bytes = {weight_bytes}, page_bytes = {layout.page_bytes}; "
                             "both must be positive")
        if layout.stateful and state_slots <= 0:
            raise ValueError(f"model {model!r} keeps a per-sequence state: give it state slots")
        sizes = _ModelSizes(weight_bytes, layout.page_bytes, layout.state_bytes, state_slots if layout.stateful else 0)
        known = self._models.get(model)
        if known is not None and known != sizes:
            raise ValueError(f"model {model!r} is already registered with weight_bytes = "
                             f"{known.weight_bytes}, page_bytes = {known.page_bytes}, "
                             f"{known.state_slots} state slots of {known.state_bytes} bytes")
        self._models[model] = sizes

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(self._models)

    # ---- planning --------------------------------------------------------------------------

    def min_arena_bytes(self, model: str) -> int:
        """Smallest arena_bytes that fits the model's weights, state slots, MIN_PAGES pages, the null
        page and runtime."""
        sizes = self._sizes(model)
        low = align_up(sizes.weight_bytes, self.align) + align_up(sizes.state_region, self.align) + \
            (self.MIN_PAGES + 1) * sizes.page_bytes
        return align_up(low, self.align) + self.runtime_bytes

    def plan(self, model: str) -> LayoutPlan:
        """The layout while `model` is active: weights at 0, its state slots above them, runtime on
        top, KV pages in the gap."""
        sizes = self._sizes(model)
        weights = Region(0, align_up(sizes.weight_bytes, self.align))
        states = Region(weights.end, weights.end + align_up(sizes.state_region, self.align))
        kv_bytes = self._runtime_start - states.end
        num_pages = kv_bytes // sizes.page_bytes - 1 if kv_bytes > 0 else -1  # one page's worth is the null page
        if num_pages < self.MIN_PAGES:
            need = self.min_arena_bytes(model)
            state = f"{sizes.state_slots} state slots {states.size} B + " if sizes.state_slots else ""
            raise LayoutError(
                f"model {model!r} does not fit the arena: weights {weights.size} B + {state}"
                f"{self.MIN_PAGES} KV pages and the null page {(self.MIN_PAGES + 1) * sizes.page_bytes} B + "
                f"runtime {self.runtime_bytes} B need arena_bytes >= {need}; arena_bytes = "
                f"{self.arena_bytes} is {need - self.arena_bytes} bytes short; raise arena_bytes")
        return LayoutPlan(
            model=model,
            weights=weights,
            kv=Region(states.end, self._runtime_start),
            runtime=Region(self._runtime_start, self.arena_bytes),
            page_bytes=sizes.page_bytes,
            num_pages=num_pages,
            states=states,
            state_bytes=sizes.state_bytes,
            num_state_slots=sizes.state_slots,
        )

    def bases(self, model: str) -> Bases:
        """Start offsets of the model's weights, KV and runtime regions (see the module docstring)."""
        p = self.plan(model)
        return Bases(p.weights.start, p.kv.start, p.runtime.start)

    # ---- the active model ------------------------------------------------------------------

    @property
    def active(self) -> str | None:
        """The model whose plan currently describes the arena, or None before the first activation."""
        return self._active.model if self._active is not None else None

    @property
    def active_plan(self) -> LayoutPlan | None:
        return self._active

    def activate(self, model: str) -> LayoutPlan:
        """Make `model` the arena's owner and return its plan; raises LayoutError (and changes
        nothing) when it does not fit."""
        plan = self.plan(model)
        self._active = plan
        return plan

    def _sizes(self, model: str) -> _ModelSizes:
        try:
            return self._models[model]
        except KeyError:
            raise KeyError(f"model {model!r} is not registered with this layout; "
                           f"known: {sorted(self._models)}") from None
