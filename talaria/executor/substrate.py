"""One rank's memory substrate: the bump-laid arena, host weight images, HKVR slabs, staging.

Every model the instance may serve keeps its weights on the host in the byte layout its device
weights region uses (pinned where CUDA), so opening a model copies byte ranges and rebinds
parameter views; nothing is rebuilt from the checkpoint. The arena holds one active model: weights
from offset 0, its page-major KV pool in the gap, per-model runtime state (RoPE tables) anchored
at the top. Bookkeeping lives in talaria/node/memory (BumpLayout, Stager, HostKVRegistry); this
class moves the bytes, on every rank alike, as rank 0's plans say.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import pairwise

import torch

from talaria.config.schema import InstanceConfig
from talaria.contracts.kv_layout import kv_layout
from talaria.contracts.step_plan import MemoryOps, SaveOp
from talaria.executor.arena import Arena, align_up
from talaria.executor.checkpoint import print_progress
from talaria.executor.kv_cache import KVCache
from talaria.executor.llama import LlamaModel
from talaria.executor.parallel import Shard, TPGroup
from talaria.executor.weights import load_weights, rebind, weights_nbytes
from talaria.memory.bump_layout import ALIGN, Bases, BumpLayout, LayoutPlan
from talaria.memory.host_kv_registry import SlabPools
from talaria.memory.stager import GatherPlan
from talaria.memory.switch_record import RankSwitchRecord
from talaria.models.source import ModelFiles

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def copy_runs(pairs: tuple[tuple[int, int], ...], single: bool = False) -> list[tuple[int, int, int]]:
    """(src, dst) row pairs as (src0, dst0, n) blocks consecutive on both sides: one copy per block.
    `single`: every block one row (a block of rows narrower than their buffer is strided, and a
    strided host <-> device copy would go through a pageable temporary)."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs and not single and (src, dst) == (runs[-1][0] + runs[-1][2], runs[-1][1] + runs[-1][2]):
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def _bind_copy_thread(device: torch.device) -> None:
    """The copy thread's initializer: one core, and its CUDA calls on the rank's GPU (a thread
    starts on GPU 0, where it would open a context of its own on every rank)."""
    torch.set_num_threads(1)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _gathers(pairs: tuple[tuple[int, int], ...]) -> list[tuple[int, list[int]]]:
    """(src, dst) pairs as (dst0, srcs) runs of consecutive destinations: one gather per run."""
    runs: list[tuple[int, list[int]]] = []
    for src, dst in pairs:
        if runs and dst == runs[-1][0] + len(runs[-1][1]):
            runs[-1][1].append(src)
        else:
            runs.append((dst, [src]))
    return runs


LOAD_PROGRESS_MIN_BYTES = 64 << 20  # smaller shards load in a blink: no progress lines for them


class ModelImage:
    """A model's weight shard on the host, byte-identical to its device weights region."""

    def __init__(self, files: ModelFiles, group: TPGroup, page_size: int, pin: bool) -> None:
        self.files = files
        self.dtype = DTYPES[files.dtype]
        self.shard = Shard(group.rank, group.size, files.arch)
        nbytes = weights_nbytes(self.shard, self.dtype, files.directory)
        self.host = Arena(nbytes, "cpu", pin=pin)
        big = nbytes >= LOAD_PROGRESS_MIN_BYTES
        progress = print_progress(f"talaria: loading {files.name}") if group.rank == 0 and big else None
        self.weights = load_weights(files.directory, self.shard, self.host, self.dtype, progress)
        self.nbytes = self.host.used_low
        self.layout = kv_layout(files.arch, group.size, page_size, files.dtype)  # its cache on this rank
        self.runtime_bytes = runtime_bytes(files)
        self.rope_bytes = self.runtime_bytes // 2  # cos, then sin


def runtime_bytes(files: ModelFiles) -> int:
    """A model's share of the arena's runtime region: its RoPE cos and sin tables."""
    item = torch.tensor([], dtype=DTYPES[files.dtype]).element_size()
    return 2 * align_up(files.arch.max_position * files.arch.rotary_dim * item)


class Substrate:
    def __init__(self, instance: InstanceConfig, models: list[ModelFiles], group: TPGroup) -> None:
        self.instance = instance
        self.group = group
        cuda = instance.device.value == "cuda"
        self.images = {m.name: ModelImage(m, group, instance.page_size, pin=cuda) for m in models}
        self.arena = Arena(instance.arena_bytes, instance.rank_device(group.rank))
        # runtime region: each model's RoPE tables at a fixed offset, so they never move
        runtime = sum(img.runtime_bytes for img in self.images.values())
        self.layout = BumpLayout(instance.arena_bytes, runtime, ALIGN)
        self._rope_at: dict[str, int] = {}
        offset = self.arena.nbytes - runtime
        for name, img in self.images.items():
            self.layout.register(name, img.nbytes, img.layout, img.layout.state_slots(instance.max_running))
            self._rope_at[name] = offset
            offset += img.runtime_bytes
        # host KV: page slabs and state slabs, each sized for the largest model's (HostKVRegistry)
        pools = SlabPools.of(instance.host_kv_bytes, [self.layout.plan(name) for name in self.images])
        self.slab_bytes, self.num_slabs = pools.page_bytes, pools.pages
        pages = max(1, pools.pages) * pools.page_bytes  # one page slab at least: copies index it
        host = Arena(pages + pools.states * pools.state_bytes, "cpu", pin=cuda)
        self.slabs = host.bytes(0, pages).view(-1, pools.page_bytes)
        self.state_slabs = host.bytes(pages, host.nbytes).view(-1, pools.state_bytes) if pools.states else None
        # D2H saves and staging copies run beside serving, on one core: a second full OpenMP team
        # would fight the forward's for the same cores (and keeps spinning after it is done)
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="talaria-copy", initializer=_bind_copy_thread,
                                         initargs=(self.arena.device,))
        self._copy_stream = torch.cuda.Stream(self.arena.device) if cuda else None
        self.poison = instance.debug_poison
        self.active: str | None = None
        self.plan: LayoutPlan | None = None
        self.model: LlamaModel | None = None
        self.kv: KVCache | None = None
        self._models: dict[str, tuple[LlamaModel, Bases]] = {}  # cached runtime state per model
        self._saves: dict[int, Future] = {}  # ticket -> D2H copy in flight
        self._staging: Future | None = None

    # ---- memory ops riding on a step -------------------------------------------------------

    def before_step(self, ops: MemoryOps) -> None:
        if ops.staged and self._staging is not None:
            self._staging.result()
            self._staging = None
        if self.poison and ops.poison:  # 0xFF bytes are NaN in every float dtype
            self.kv.pages.index_fill_(0, torch.tensor(ops.poison, device=self.arena.device), 0xFF)
        if ops.state_copies or ops.state_zero or ops.state_restores:
            self._move_states(ops)
        if ops.restores:
            self._restore(self.kv.pages, self.slabs, ops.restores)
        for save in ops.saves:
            written = self._compute_done()
            self._saves[save.ticket] = self.copier.submit(self._copy_out, self.kv, save, written)

    def _move_states(self, ops: MemoryOps) -> None:
        """Copies in list order (a snapshot is taken before its slot is reused), then zeroing, then
        host state restores."""
        states = self.kv.states
        for src, dst in ops.state_copies:
            states[dst].copy_(states[src])
        if ops.state_zero:
            states.index_fill_(0, torch.tensor(ops.state_zero, device=self.arena.device), 0)
        if ops.state_restores:
            self._restore(states, self.state_slabs, ops.state_restores)

    def _restore(self, rows: torch.Tensor, slabs: torch.Tensor, restores: tuple[tuple[int, int], ...]) -> None:
        """slab -> row (a page, or a state slot). CPU: one gather per run of consecutive rows,
        straight into them (a single pass over the bytes, the slabs anywhere). CUDA: pinned host ->
        device on the copy stream, one copy per block consecutive on both sides (slabs are taken
        lowest-first and fresh pages are mostly consecutive, so a prefix is mostly one block),
        ordered by events, with no host wait."""
        pb = rows.shape[1]
        if self._copy_stream is None:
            for row, srcs in _gathers(restores):
                torch.index_select(slabs[:, :pb], 0, torch.tensor(srcs), out=rows[row:row + len(srcs)])
            return
        # a smaller model's rows in slabs sized for the largest are strided: one row per copy
        runs = copy_runs(restores, single=pb < slabs.shape[1])
        # invariant: the copies write the rows after every step queued so far (one may still read
        # a page freed since) and the next forward reads them only after the copies
        self._copy_stream.wait_event(self._compute_done())
        with torch.cuda.stream(self._copy_stream):
            for slab, row, n in runs:
                rows[row:row + n].copy_(slabs[slab:slab + n, :pb], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._copy_stream)
        torch.cuda.current_stream(self.arena.device).wait_event(copied)

    def _compute_done(self):
        """CUDA: an event after the work queued so far (the pages' K/V writes); None on CPU."""
        if self._copy_stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _copy_out(self, kv: KVCache, save: SaveOp, written) -> None:
        """Pages -> page slabs and snapshots -> state slabs; slabs come lowest-first, so mostly one
        gather per save."""
        parts = [(kv.pages, self.slabs, save.copies)]
        if save.states:
            parts.append((kv.states, self.state_slabs, save.states))
        if kv.pages.is_cuda:  # device -> pinned host on a side stream, once the cache writes landed
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(written)
                for rows, slabs, copies in parts:
                    pb = rows.shape[1]
                    for row, slab, n in copy_runs(copies, single=pb < slabs.shape[1]):
                        slabs[slab:slab + n, :pb].copy_(rows[row:row + n], non_blocking=True)
            self._copy_stream.synchronize()  # this stream only: the save is on the host when its future is done
            return
        for rows, slabs, copies in parts:
            pb = rows.shape[1]
            for slab, srcs in _gathers(copies):
                torch.index_select(rows, 0, torch.tensor(srcs), out=slabs[slab:slab + len(srcs), :pb])

    def wait_save(self, ticket: int) -> None:
        """Block until this rank's D2H copies of the ticket are done (before reporting on it)."""
        fut = self._saves.pop(ticket, None)
        if fut is not None:
            fut.result()

    def save_done(self, ticket: int) -> bool:
        fut = self._saves.get(ticket)
        return fut is None or fut.done()

    def start_staging(self, model: str, src: tuple[int, int], dst: tuple[int, int]) -> None:
        """Copy a chunk of the next model's host image into the KV-pool tail, beside serving."""
        image = self.images[model]

        def copy() -> None:
            if self._copy_stream is None:
                self.arena.bytes(*dst).copy_(image.host.bytes(*src))
                return
            with torch.cuda.stream(self._copy_stream):  # pinned host -> device beside the compute stream
                self.arena.bytes(*dst).copy_(image.host.bytes(*src), non_blocking=True)
            self._copy_stream.synchronize()
        self._staging = self.copier.submit(copy)

    def wait_staging(self) -> None:
        if self._staging is not None:
            self._staging.result()

    def staging_done(self) -> bool:
        return self._staging is None or self._staging.done()

    # ---- switching -------------------------------------------------------------------------

    def activate(self, name: str, gather: GatherPlan, teardown: Callable[[], None]) -> RankSwitchRecord:
        """Switch the arena to `name` in the paper's five timed phases (App. D).

        `teardown` drains the outgoing model's host saves and settles their agreement: it is phase 1.
        """
        marks = [time.perf_counter()]
        outgoing = self.active
        teardown()  # 1: drain the outgoing D2H, then release its KV region and runtime references
        self.kv = self.model = None
        marks.append(time.perf_counter())
        image = self.images[name]  # 2: open weights: D2D for clean staged chunks, H2D for the rest
        if self._staging is not None:
            self._staging.result()
            self._staging = None
        for src, dst in gather.d2d:  # invariant: staged sources lie above the new weights, never clobbered
            self.arena.bytes(dst.start, dst.end).copy_(self.arena.bytes(src.start, src.end))
        for src, dst in gather.h2d:
            self.arena.bytes(dst.start, dst.end).copy_(image.host.bytes(src.start, src.end))
        self._sync()
        marks.append(time.perf_counter())
        plan = self.layout.activate(name)  # 3: the KV shell in the gap, the state slots below it
        if self.poison:
            self.arena.bytes(plan.states.start, plan.kv.end).view(torch.uint8).fill_(0xFF)  # NaN in any float
        pages = self.arena.bytes(plan.kv.start, plan.kv.start + (plan.num_pages + 1) * plan.page_bytes)
        states = self.arena.bytes(plan.states.start, plan.states.start + plan.num_state_slots * plan.state_bytes) \
            if plan.num_state_slots else None
        self.kv = KVCache(pages.view(plan.num_pages + 1, plan.page_bytes), image.layout,
                          states.view(plan.num_state_slots, plan.state_bytes) if states is not None else None)
        marks.append(time.perf_counter())
        bases = self.layout.bases(name)  # 4: runtime state, rebuilt only if its addresses moved
        cached = self._models.get(name)
        rebuilt = cached is not None and (cached[1].weights, cached[1].runtime) != (bases.weights, bases.runtime)
        if cached is None or rebuilt:
            weights = rebind(image.weights, image.host, self.arena)
            arch, at = image.files.arch, self._rope_at[name]
            rope = tuple(self.arena.view_at(at + i * image.rope_bytes, (arch.max_position, arch.rotary_dim), image.dtype)
                         for i in range(2))
            cached = (LlamaModel(arch, image.shard, weights, self.group, image.dtype, rope), bases)
            self._models[name] = cached
        marks.append(time.perf_counter())
        self.model, self.active, self.plan = cached[0], name, plan  # 5: publish
        marks.append(time.perf_counter())
        phases = tuple((b - a) * 1e3 for a, b in pairwise(marks))
        return RankSwitchRecord(self.group.rank, outgoing, name, gather.path, phases, gather.staged_bytes,
                                gather.dirty_bytes, gather.total_bytes, rebuilt_runtime=rebuilt)

    def _sync(self) -> None:
        """Wait for the compute stream (a switch's weight copies, to time phase 2); the copy stream's
        saves and staging are waited for by their futures, not here."""
        if self.arena.device.type == "cuda":
            torch.cuda.current_stream(self.arena.device).synchronize()
