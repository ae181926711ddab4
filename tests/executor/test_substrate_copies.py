"""The substrate's copy plumbing that runs the same on CPU and CUDA: host KV restores and saves in
blocks consecutive on both sides, and the copy thread bound to the rank's device."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from talaria.config.schema import Pool
from talaria.contracts.kv_layout import CacheTensor, KVLayout
from talaria.contracts.step_plan import MemoryOps, SaveOp
from talaria.executor import substrate
from talaria.executor.executor import Executor
from talaria.executor.parallel import TPGroup
from talaria.executor.substrate import copy_runs
from tests.tiny_models import engine_device, instance, tiny_files


def test_pairs_consecutive_on_both_sides_make_one_block() -> None:
    assert copy_runs(((10, 3), (11, 4), (12, 5))) == [(10, 3, 3)]


def test_a_break_on_either_side_starts_a_new_block() -> None:
    pairs = ((0, 7), (1, 8), (5, 9), (6, 10), (7, 2), (8, 3))
    assert copy_runs(pairs) == [(0, 7, 2), (5, 9, 2), (7, 2, 2)]


def test_single_rows_when_blocks_would_be_strided() -> None:
    assert copy_runs(((10, 3), (11, 4)), single=True) == [(10, 3, 1), (11, 4, 1)]
    assert copy_runs(()) == []


@pytest.mark.parametrize("width", ["pages as wide as slabs", "slabs wider than pages"])
def test_restores_copy_each_slab_into_its_page(model_cache, width: str) -> None:
    """Scattered slabs into scattered pages, through the substrate's own restore (blocks, then the
    copies); with two models of different page sizes the smaller one's pages are strided in slabs."""
    files = [tiny_files("llama", model_cache), tiny_files("qwen3", model_cache)]
    served = files if width == "slabs wider than pages" else files[:1]
    sub = Executor(instance(served, pool=Pool.COLD, host_kv_bytes=1 << 20), served, TPGroup(0, 1)).substrate
    pb = sub.kv.pages.shape[1]
    assert (pb < sub.slabs.shape[1]) == (width == "slabs wider than pages")
    sub.slabs.copy_(torch.randint(0, 256, sub.slabs.shape, dtype=torch.uint8))
    pairs = ((3, 0), (4, 1), (5, 2), (9, 7), (1, 8), (2, 9))
    sub.before_step(MemoryOps(restores=pairs))
    for slab, page in pairs:
        assert torch.equal(sub.kv.pages[page].cpu(), sub.slabs[slab, :pb]), (slab, page)


def test_the_copy_thread_runs_on_one_core_and_the_rank_gpu(monkeypatch) -> None:
    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    with ThreadPoolExecutor(1, initializer=substrate._bind_copy_thread, initargs=(torch.device("cuda:5"),)) as pool:
        assert pool.submit(torch.get_num_threads).result() == 1
    assert bound == [torch.device("cuda:5")]
    with ThreadPoolExecutor(1, initializer=substrate._bind_copy_thread, initargs=(torch.device("cpu"),)) as pool:
        pool.submit(lambda: None).result()
    assert len(bound) == 1  # a CPU rank touches no CUDA


def test_a_substrate_binds_its_copy_thread_to_its_arena_device(model_cache) -> None:
    files = [tiny_files("llama", model_cache)]
    sub = Executor(instance(files), files, TPGroup(0, 1)).substrate
    assert sub.arena.device.type == engine_device()
    on = sub.copier.submit(lambda: torch.cuda.current_device() if sub.arena.device.type == "cuda" else None)
    assert on.result() == sub.arena.device.index


def test_state_ops_move_state_slots_in_order_and_saves_carry_snapshots(model_cache, monkeypatch) -> None:
    """A stateful layout built here (the model's own k/v, plus a per-sequence `ssm` on layer 0):
    the arena gets a state region below the page pool, and a step's state ops run in their order:
    copies (a snapshot taken, then one loaded), zeroing, host restores; a save copies a snapshot
    into its state slab beside the pages."""
    real = substrate.kv_layout

    def hybrid(arch, tp, page_size, dtype):
        gqa = real(arch, tp, page_size, dtype)
        return KVLayout(page_size, (*gqa.tensors, CacheTensor("ssm", (0,), (3, 5), dtype, False)))

    monkeypatch.setattr(substrate, "kv_layout", hybrid)
    files = [tiny_files("llama", model_cache)]
    cfg = instance(files, host_kv_bytes=16 << 20)
    sub = Executor(cfg, files, TPGroup(0, 1)).substrate
    states, plan = sub.kv.states, sub.plan
    # host states and pages in the arena's proportion: its state region against its page pool
    share = plan.states.size / (plan.states.size + plan.num_pages * plan.page_bytes)
    assert sub.state_slabs.shape[0] == int((16 << 20) * share) // states.shape[1] > 2
    assert states.shape == (2 * cfg.max_running, 3 * 5 * 8) and plan.states.end <= plan.kv.start
    assert sub.kv.view("ssm", 0).shape == (2 * cfg.max_running, 3, 5) and sub.kv.view("ssm", 0).dtype == torch.float64
    states.copy_(torch.randint(0, 256, states.shape, dtype=torch.uint8))
    sub.state_slabs.copy_(torch.randint(0, 256, sub.state_slabs.shape, dtype=torch.uint8))
    before, slab = states.clone(), sub.state_slabs[1].clone()
    sub.before_step(MemoryOps(state_copies=((0, 3), (3, 1), (2, 4)), state_zero=(2,), state_restores=((1, 0),)))
    assert torch.equal(states[3], before[0]) and torch.equal(states[1], before[0])  # in list order
    assert torch.equal(states[4], before[2]) and not states[2].any()  # copies before zeroing
    assert torch.equal(states[0], slab)  # the host restore last (slot 0 was a copy's source)
    sub.before_step(MemoryOps(saves=(SaveOp(7, 0, ((0, 0),), ((1, 2),)),)))
    sub.wait_save(7)
    assert torch.equal(sub.state_slabs[2], states[1]) and torch.equal(sub.slabs[0], sub.kv.pages[0])
