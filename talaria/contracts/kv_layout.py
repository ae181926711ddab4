"""One model's cache on one rank, described once: the cache layout descriptor and the resume rule.

Every layer of the node that sizes, saves, restores or prices a model's cache reads a `KVLayout`:
the arena's KV pool and state region (talaria/memory/bump_layout.py), the engine's views of them
(talaria/executor/kv_cache.py), host KV slabs (talaria/memory/host_kv_registry.py), the cost
profile's restore price, the simulator, the router, telemetry and preflight. `kv_layout` is the only
sizing code that knows model families (the paper's App. C "compact layout descriptor").

A cache is a set of tensors, each on some layers:

- **per token** (`k`, `v`; MLA's `latent`, an indexer's `index_k`): stored in pages of `page_size`
  tokens. A page is one contiguous run of bytes holding every per-token tensor of every layer,
  layer-major, so a page moves to and from host memory, or gives way to a staged weight chunk, as one
  byte range.
- **per sequence** (Gated DeltaNet's `conv` and `ssm`): a fixed-size state that a forward updates in
  place. A state slot is one contiguous run of bytes holding every per-sequence tensor of every layer.

**The resume rule.** Attention KV for tokens [0, n) depends on those tokens only, so a sequence may
resume from any page boundary whose pages are cached. A recurrent state summarises every token before
it and exists only where a snapshot of it was taken: a stateful cache resumes only at a page boundary
with a published state snapshot. `KVLayout.resume_pages` is that rule; the page manager, the batcher,
the host KV registry, the router and the prompt costs all ask it.

No torch here: the simulator and the router read the same descriptor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from talaria.contracts.arch import ModelArch

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}  # cache dtypes, by config name
ITEMSIZE = DTYPE_BYTES | {"uint8": 1}  # a layout known only by its sizes (a cost profile's) is raw bytes


@dataclass(frozen=True, slots=True)
class CacheTensor:
    """One named cache tensor of some layers, as one rank holds it."""

    name: str  # k, v, latent, index_k, conv, ssm
    layers: tuple[int, ...]  # the model layers that keep this tensor, increasing
    shape: tuple[int, ...]  # one token's (per_token) or one sequence's, for one layer, after the TP split
    dtype: str  # an ITEMSIZE key
    per_token: bool  # True: paged, one per token; False: one per sequence (a state slot)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of one token's (or one sequence's) value for one layer."""
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True, slots=True)
class KVLayout:
    """A model's cache on one rank: its tensors, and the bytes of a page and of a state slot.

    Offsets are byte offsets of one (tensor, layer) block inside a page (per-token tensors: the block
    holds `page_size` tokens of it) or inside a state slot (per-sequence tensors), layer-major and in
    `tensors` order within a layer, each aligned to its dtype.
    """

    page_size: int  # tokens per page
    tensors: tuple[CacheTensor, ...]
    page_bytes: int = field(init=False)  # one page: every per-token tensor of every layer
    state_bytes: int = field(init=False)  # one state slot: every per-sequence tensor; 0 = no state
    offsets: dict[tuple[str, int], int] = field(init=False, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size = {self.page_size}: must be positive")
        offsets: dict[tuple[str, int], int] = {}
        ends = {True: 0, False: 0}  # bytes placed so far: in a page, in a state slot
        layers = sorted({i for t in self.tensors for i in t.layers})
        for layer in layers:
            for t in self.tensors:
                if layer not in t.layers:
                    continue
                at = -(-ends[t.per_token] // t.itemsize) * t.itemsize
                offsets[(t.name, layer)] = at
                ends[t.per_token] = at + t.nbytes * (self.page_size if t.per_token else 1)
        align = max((t.itemsize for t in self.tensors), default=1)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "page_bytes", -(-ends[True] // align) * align)
        object.__setattr__(self, "state_bytes", -(-ends[False] // align) * align)

    @property
    def token_bytes(self) -> int:
        """Bytes one token adds to the cache, per rank (a page's bytes over its tokens)."""
        return self.page_bytes // self.page_size

    @property
    def stateful(self) -> bool:
        """A per-sequence state exists: resume only at a published snapshot."""
        return self.state_bytes > 0

    def state_slots(self, max_running: int) -> int:
        """State slots the arena keeps for this model: one live state per running sequence and as
        many snapshots (published at page boundaries, evicted least recently used); 0 without state."""
        return 2 * max_running if self.stateful else 0

    def tensor(self, name: str) -> CacheTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"no cache tensor {name!r}; this layout has {[t.name for t in self.tensors]}")

    def resume_pages(self, matched: int, snapshot_after: Callable[[int], bool]) -> int:
        """How many of the `matched` leading cached pages a sequence may resume from.

        Without state, all of them. With state, the most n <= matched for which `snapshot_after(n)`
        (a published state snapshot of the sequence after its first n pages) holds, else 0 (the state
        then starts from zeros, as at the first token)."""
        if not self.stateful:
            return matched
        for n in range(matched, 0, -1):
            if snapshot_after(n):
                return n
        return 0

    def describe(self) -> str:
        """One line for people (config check, docs): page and state bytes and the tensors."""
        parts = [f"{t.name} {'x'.join(map(str, t.shape))} {t.dtype} on {len(t.layers)} layer{'s' * (len(t.layers) > 1)}"
                 f"{'' if t.per_token else ' per sequence'}" for t in self.tensors]
        return (f"page {self.page_bytes} B ({self.page_size} tokens, {self.token_bytes} B a token), "
                f"state {self.state_bytes} B; " + ", ".join(parts))


def kv_heads_per_rank(arch: ModelArch, tp: int) -> int:
    """KV heads one of `tp` ranks holds: split across ranks, one replicated head when tp exceeds them."""
    return max(1, arch.num_kv_heads // tp)


def kv_layout(arch: ModelArch, tp: int, page_size: int, dtype: str) -> KVLayout:
    """The cache of `arch` on one of `tp` ranks, in pages of `page_size` tokens of `dtype`.

    GQA families (Llama, Mistral, Qwen2/3 and their MoE variants): per-token `k` and `v` of
    (KV heads per rank, head_dim) on every layer. Hybrid families (Qwen3-Next, Qwen3.5-MoE): `k` and
    `v` on the full-attention layers only; on each Gated DeltaNet layer a per-sequence `conv` state
    (the convolution's last kernel - 1 inputs of the rank's q, k and v channels, in `dtype`) and
    `ssm` state (the recurrent matrix of each of the rank's value heads, in float32, as computed).
    MLA families (DeepSeek-V3, GLM-5): per-token `latent` (the normalised kv_lora_rank latent and the
    rotated key all heads share) on every layer, whole on every rank (each rank's heads read all of
    it; docs/models.md), and with a sparse-attention indexer its `index_k` on the layers that run one."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"cache dtype {dtype!r}: one of {', '.join(DTYPE_BYTES)}")
    if arch.is_mla:
        every = tuple(range(arch.num_layers))
        indexed = tuple(i for i in every if arch.has_indexer(i))
        tensors = [CacheTensor("latent", every, (arch.latent_dim,), dtype, True)]
        if indexed:
            tensors.append(CacheTensor("index_k", indexed, (arch.index_head_dim,), dtype, True))
        return KVLayout(page_size, tuple(tensors))
    linear = tuple(i for i in range(arch.num_layers) if arch.is_linear_layer(i))
    attention = tuple(i for i in range(arch.num_layers) if not arch.is_linear_layer(i))
    shape = (kv_heads_per_rank(arch, tp), arch.head_dim)
    tensors = [CacheTensor("k", attention, shape, dtype, True), CacheTensor("v", attention, shape, dtype, True)]
    if linear:
        kh, vh = arch.linear_num_key_heads // tp, arch.linear_num_value_heads // tp
        channels = 2 * kh * arch.linear_key_head_dim + vh * arch.linear_value_head_dim
        tensors += [CacheTensor("conv", linear, (channels, arch.linear_conv_kernel_dim - 1), dtype, False),
                    CacheTensor("ssm", linear, (vh, arch.linear_key_head_dim, arch.linear_value_head_dim),
                                "float32", False)]
    return KVLayout(page_size, tuple(tensors))


def sized_layout(page_size: int, token_bytes: int, state_bytes: int = 0) -> KVLayout:
    """A layout known only by its sizes (a cost profile's `token_bytes` and `state_bytes`): the
    simulator and the router size, place and price with it exactly as with the engine's."""
    tensors = [CacheTensor("kv", (0,), (token_bytes,), "uint8", True)]
    if state_bytes:
        tensors.append(CacheTensor("state", (0,), (state_bytes,), "uint8", False))
    return KVLayout(page_size, tuple(tensors))
