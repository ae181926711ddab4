"""Which of the next model's weight bytes are pre-staged in the active model's KV tail (paper §4.4).

While model A serves, the next model B's flat weight image is copied chunk by chunk into the
high-address tail of A's KV page pool. A's KV allocator hands out low pages first, so that tail
usually stays untouched. At switch time the gather plan copies clean staged chunks device-to-device
into B's weights region and reloads the rest from host, so the expensive host transfer scales with
the uncovered fraction only.

Chunk j of B's image is src [j * chunk_bytes, min((j + 1) * chunk_bytes, weight_bytes)). Chunk
destinations are stacked downward from the end of A's last allocatable page (the null page is never
used): chunk 0 ends there, chunk 1 ends where chunk 0 starts, and so on, each destination start
rounded down to `align`. A chunk is placed only if its destination lies entirely at or above
max(A's KV start, align_up(B's weight_bytes)); from the first chunk that does not fit on, chunks are
never staged and always come from host. Because every D2D destination lies in B's weights region
[0, weight_bytes), which ends below that floor, no gather destination can overwrite a staged source
still to be read: the D2D copies may run in any order.

Chunk lifecycle: MISSING --next_chunk--> WRITING --written--> CLEAN --on_allocate--> DIRTY
--next_chunk--> WRITING ... Only CLEAN chunks are copied D2D.

No tensors here: the engine does the copies; this class decides which bytes are safe to use.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import Enum

from talaria.contracts.vocabulary import SwitchPath
from talaria.memory.bump_layout import LayoutPlan, Region, align_down, align_up


class ChunkState(Enum):
    MISSING = "missing"  # never written (or not placed at all): must come from host
    WRITING = "writing"  # an H2D copy into its destination is in flight; its pages are blocked
    CLEAN = "clean"  # its destination holds exactly these weight bytes: safe to gather D2D
    DIRTY = "dirty"  # KV was allocated over it after it was written: must be re-staged or reloaded


class StagingError(RuntimeError):
    """The engine broke the staging protocol (e.g. allocated a page that a chunk is being written to)."""


@dataclass(frozen=True, slots=True)
class StagedChunk:
    """One placed chunk of the next model's weight image and where it is staged."""

    index: int  # position in the image: chunk j starts at j * chunk_bytes
    src: Region  # bytes of B's flat host weight image
    dst: Region  # arena bytes inside A's KV page pool, same size as src
    pages: range  # A's KV pages that dst overlaps


@dataclass(frozen=True, slots=True)
class GatherPlan:
    """The copies that open the staged model's weights at switch time."""

    d2d: tuple[tuple[Region, Region], ...]  # (staged arena src, arena dst) per CLEAN chunk, by index
    h2d: tuple[tuple[Region, Region], ...]  # (host image src, arena dst) per other chunk, by index
    path: SwitchPath
    staged_bytes: int  # bytes copied D2D (CLEAN chunks)
    dirty_bytes: int  # bytes that were staged but overwritten by KV (DIRTY chunks); a subset of h2d
    total_bytes: int  # the whole weight image

    @property
    def h2d_bytes(self) -> int:
        return self.total_bytes - self.staged_bytes


@dataclass(frozen=True, slots=True)
class _Target:
    model: str
    weight_bytes: int
    active: LayoutPlan


class Stager:
    """Staging bookkeeping for one rank: the next model's chunks and their states.

    The engine calls `target` whenever it knows the next model, `next_chunk` / `written` around
    each H2D copy, `blocked_pages` and `on_allocate` from the KV allocator, and `gather_plan` at the
    switch. Retargeting to a different model, or after a switch (a new active plan), resets every
    chunk to MISSING.
    """

    def __init__(self, chunk_bytes: int, align: int = 256) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes = {chunk_bytes}: must be positive")
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align = {align}: must be a power of two")
        self.chunk_bytes = chunk_bytes
        self.align = align
        self._target: _Target | None = None
        self._srcs: tuple[Region, ...] = ()  # every chunk of the image, placed or not
        self._placed: tuple[StagedChunk, ...] = ()  # chunks 0..len-1, the ones with a destination
        self._state: list[ChunkState] = []  # per chunk of _srcs
        self._spans: list[tuple[int, int, int]] = []  # (first page, end page, chunk index), by first page
        self._held = 0  # bytes of the placed chunks that are CLEAN or WRITING (held_bytes)

    # ---- targeting -------------------------------------------------------------------------

    @property
    def target_model(self) -> str | None:
        return self._target.model if self._target is not None else None

    @property
    def chunks(self) -> tuple[StagedChunk, ...]:
        """The placed chunks, by index; chunks past the last one are never staged."""
        return self._placed

    @property
    def num_chunks(self) -> int:
        """All chunks of the target's image, placed or not."""
        return len(self._srcs)

    def state(self, index: int) -> ChunkState:
        return self._state[index]

    def target(self, model_b: str, weight_bytes_b: int, active: LayoutPlan) -> None:
        """Plan staging of `model_b`'s image into `active`'s KV tail; the same target again is a no-op."""
        if weight_bytes_b <= 0:
            raise ValueError(f"model {model_b!r}: weight_bytes = {weight_bytes_b}, must be positive")
        new = _Target(model_b, weight_bytes_b, active)
        if new == self._target:
            return
        self._check_idle("retarget")
        self._target = new
        cb = self.chunk_bytes
        self._srcs = tuple(Region(s, min(s + cb, weight_bytes_b)) for s in range(0, weight_bytes_b, cb))
        self._state = [ChunkState.MISSING] * len(self._srcs)
        self._held = 0
        # invariant: every staged source lies at or above `floor`, and every gather destination lies
        # in B's weights region [0, weight_bytes_b) below it, so D2D copies never read overwritten bytes;
        # and at or above the page pool's start, so staging never overwrites the active model's state slots
        floor = max(active.page_pool.start, align_up(weight_bytes_b, self.align))
        placed: list[StagedChunk] = []
        top = active.page_pool.end
        for j, src in enumerate(self._srcs):
            start = align_down(top - src.size, self.align)
            if start < floor:
                break  # this chunk and every later one come from host
            dst = Region(start, start + src.size)
            placed.append(StagedChunk(j, src, dst, active.pages_overlapping(dst)))
            top = start
        self._placed = tuple(placed)
        # chunks are placed downwards from the pool's top, so their page ranges are contiguous and
        # neighbours share at most a boundary page: a sorted list finds a page's chunks by bisection
        self._spans = sorted((c.pages.start, c.pages.stop, c.index) for c in placed if len(c.pages))

    def clear(self) -> None:
        """Forget the target (no next model is known); every chunk must be idle."""
        self._check_idle("clear the target")
        self._target = None
        self._srcs, self._placed, self._state, self._spans = (), (), [], []
        self._held = 0

    # ---- the staging loop ------------------------------------------------------------------

    def next_chunk(self, all_free: Callable[[range], bool]) -> StagedChunk | None:
        """The lowest-index MISSING or DIRTY placed chunk whose pages are all free, now WRITING.

        `all_free(pages)` must be true only if no one will read those pages' bytes again: none is
        referenced by a sequence AND none holds a cached prefix (or the caller evicts that prefix
        before writing), since the copy overwrites them. Returns None when nothing can be staged now.
        """
        for c in self._placed:
            if self._state[c.index] in (ChunkState.MISSING, ChunkState.DIRTY) and all_free(c.pages):
                self._state[c.index] = ChunkState.WRITING
                self._held += c.src.size
                return c
        return None

    def written(self, chunk: StagedChunk) -> None:
        """The H2D copy into `chunk.dst` has completed: the chunk is CLEAN."""
        if chunk.index >= len(self._placed) or self._placed[chunk.index] != chunk:
            raise StagingError(f"chunk {chunk.index} does not belong to the current target "
                               f"{self.target_model!r}")
        if self._state[chunk.index] is not ChunkState.WRITING:
            raise StagingError(f"chunk {chunk.index} is {self._state[chunk.index].name}, not WRITING: "
                               "call written() once per chunk returned by next_chunk()")
        # A WRITING chunk cannot have been dirtied meanwhile: its pages were blocked (on_allocate raises).
        self._state[chunk.index] = ChunkState.CLEAN

    def _chunks_at(self, page: int) -> list[int]:
        """Indices of the placed chunks whose pages include `page`: two at most when chunks are at
        least a page, any number when they are smaller. Chunks are consecutive byte ranges, so
        their page spans grow in both ends: those reaching `page` are the last ones starting at or
        before it, back to the first that ends before it."""
        i = bisect.bisect_right(self._spans, (page, float("inf"), 0))
        found = []
        while i > 0 and self._spans[i - 1][1] > page:
            i -= 1
            found.append(self._spans[i][2])
        return found

    def blocked_pages(self) -> AbstractSet[int] | range:
        """Pages the KV allocator must not hand out: those under a chunk being written."""
        # invariant: a WRITING chunk's pages are never allocated
        writing = [c.pages for c in self._placed if self._state[c.index] is ChunkState.WRITING]
        if len(writing) == 1:
            return writing[0]  # a range: O(1) membership (one chunk is written at a time)
        return frozenset(p for pages in writing for p in pages)

    def on_allocate(self, pages: Iterable[int]) -> None:
        """The KV allocator took `pages`: every CLEAN chunk overlapping them becomes DIRTY."""
        for p in pages:
            for j in self._chunks_at(p):
                if self._state[j] is ChunkState.WRITING:
                    raise StagingError(f"KV page {p} was allocated while staged chunk {j} is being written "
                                       "to it; the allocator must skip blocked_pages()")
                if self._state[j] is ChunkState.CLEAN:
                    self._state[j] = ChunkState.DIRTY
                    self._held -= self._placed[j].src.size

    # ---- the switch ------------------------------------------------------------------------

    def gather_plan(self, new_weights: Region) -> GatherPlan:
        """The copies that open the target's weights in `new_weights` (its plan's weights region).

        Chunk j's destination is [new_weights.start + src.start, new_weights.start + src.end).
        WRITING chunks are reloaded from host; the caller must still wait for their copies to
        finish before B's KV pool reuses those bytes.
        """
        if self._target is None:
            raise StagingError("gather_plan() without a target: call target() for the model being opened")
        total = self._target.weight_bytes
        if new_weights.size < total:
            raise ValueError(f"weights region {new_weights} holds {new_weights.size} bytes; "
                             f"{self._target.model!r} needs {total}")
        image = Region(new_weights.start, new_weights.start + total)
        d2d: list[tuple[Region, Region]] = []
        h2d: list[tuple[Region, Region]] = []
        staged = dirty = 0
        for j, src in enumerate(self._srcs):
            dst = Region(new_weights.start + src.start, new_weights.start + src.end)
            state = self._state[j]
            if state is ChunkState.CLEAN:
                staged_src = self._placed[j].dst
                if staged_src.overlaps(image):
                    raise StagingError(f"staged chunk {j} at {staged_src} overlaps the weights being "
                                       f"opened at {image}; the D2D gather would read overwritten bytes")
                d2d.append((staged_src, dst))
                staged += src.size
            else:
                h2d.append((src, dst))
                dirty += src.size if state is ChunkState.DIRTY else 0
        return GatherPlan(tuple(d2d), tuple(h2d), SwitchPath.for_coverage(staged / total), staged, dirty, total)

    # ---- telemetry -------------------------------------------------------------------------

    def slack_bytes(self, all_free: Callable[[range], bool]) -> int:
        """Staging slack: bytes `next_chunk` could stage right now.

        The sum of sizes of placed MISSING or DIRTY chunks whose pages are all free. It falls as
        staging progresses (see `coverage`) and as KV allocations occupy the tail; coverage plus
        slack / weight_bytes is the best D2D fraction reachable if no more KV is allocated.
        """
        return sum(c.src.size for c in self._placed
                   if self._state[c.index] in (ChunkState.MISSING, ChunkState.DIRTY) and all_free(c.pages))

    def coverage(self, writing: StagedChunk | None = None) -> float:
        """Fraction of the target's weight bytes that are CLEAN (0.0 without a target); with
        `writing`, as if that chunk, whose copy is in flight, were written."""
        if self._target is None:
            return 0.0
        clean = sum(c.src.size for c in self._placed if self._state[c.index] is ChunkState.CLEAN)
        if writing is not None and self._state[writing.index] is ChunkState.WRITING:
            clean += writing.src.size
        return clean / self._target.weight_bytes

    def held_bytes(self) -> int:
        """Device bytes the staged image occupies now: chunks written (CLEAN) or being written. A
        DIRTY chunk's bytes belong to the KV pages that overwrote it, so they are not counted twice.
        Kept as the states change: the simulator asks after every step."""
        return self._held

    def _check_idle(self, what: str) -> None:
        writing = [c.index for c in self._placed if self._state[c.index] is ChunkState.WRITING]
        if writing:
            raise StagingError(f"cannot {what} while chunks {writing} are being written; "
                               "call written() for each once its copy completes")
