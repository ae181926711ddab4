"""MemoryPlanner on the toy arena: staging chunks one at a time, gather plans at a switch, poison.

Arena of 3584 bytes with 256 of runtime and 256-byte pages. Active model "a" (1024 bytes of weights)
has 8 KV pages at [1024, 3072); the next model "b" (1280 bytes) is staged in 512-byte chunks that
stack downward from 3072: chunk 0 -> [2560, 3072) on pages 6-7, chunk 1 -> [2048, 2560) on pages
4-5, chunk 2 (256 bytes) -> [1792, 2048) on page 3. The copy engine is a stand-in the test drives.
"""

from __future__ import annotations

from dataclasses import dataclass

from talaria.contracts.call import InstanceCall, SamplingParams
from talaria.contracts.kv_layout import sized_layout
from talaria.contracts.step_plan import MemoryOps
from talaria.contracts.vocabulary import SwitchPath
from talaria.instance.batcher import Batcher
from talaria.instance.memory_planner import MemoryPlanner, full_h2d
from talaria.instance.sequence import Sequence
from talaria.memory.bump_layout import BumpLayout, Region
from talaria.memory.host_kv_registry import HostKVRegistry
from talaria.memory.page_manager import PageManager
from talaria.memory.stager import ChunkState, GatherPlan, Stager
from tests.instance.copy_events import CopyEventsStandIn

PS = 4
PAGE_BYTES = 256
WEIGHTS = {"a": 1024, "b": 1280, "c": 768}
CHUNK = 512
STAGE_0 = ("b", 0, 512, 2560, 3072)  # (model, src0, src1, dst0, dst1)
STAGE_1 = ("b", 512, 1024, 2048, 2560)
STAGE_2 = ("b", 1024, 1280, 1792, 2048)


@dataclass
class Rank0:
    memory: MemoryPlanner
    stager: Stager
    events: CopyEventsStandIn
    batcher: Batcher  # model a's, holding the pool new_pool("a") built

    @property
    def pool(self) -> PageManager:
        return self.batcher.pages

    def ops(self, staging_finished: bool = False) -> MemoryOps:
        """The memory ops of the next step; `staging_finished`: the last chunk's copy has landed."""
        self.events.staging_finished = staging_finished
        return self.memory.ops(self.batcher)

    def stage_everything(self) -> None:
        assert self.ops().stage == STAGE_0
        assert self.ops(True).stage == STAGE_1
        assert self.ops(True).stage == STAGE_2
        assert self.ops(True) == MemoryOps(staged=True)


def rank0(*models: str, poison: bool = False) -> Rank0:
    """Model a open, staging towards the next model, as Scheduler.switched leaves it."""
    layout, cache = BumpLayout(3584, 256), sized_layout(PS, PAGE_BYTES // PS)
    for m in models:
        layout.register(m, WEIGHTS[m], cache)
    events = CopyEventsStandIn()
    stager = Stager(CHUNK)
    memory = MemoryPlanner(layout, {m: WEIGHTS[m] for m in models}, PS, HostKVRegistry(8, PAGE_BYTES), stager,
                           poison, events, {m: cache for m in models})
    batcher = Batcher("a", None, 64, 8, 64, (2,))
    batcher.resume(memory.new_pool("a"))
    memory.switched("a", models[1])
    return Rank0(memory, stager, events, batcher)


def admit(r: Rank0, seq_id: int, num_tokens: int) -> Sequence:
    """Queue a prompt of `num_tokens` on model a and plan it (allocating its pages)."""
    call = InstanceCall(f"r{seq_id}", "a", tuple(range(100 * seq_id, 100 * seq_id + num_tokens)),
                        SamplingParams(max_tokens=4, temperature=0.0))
    seq = Sequence(seq_id, call, list(call.prompt_token_ids), 0.0)
    r.batcher.add(seq)
    r.batcher.plan(0.0)
    return seq


def test_staging_writes_one_chunk_at_a_time_and_finishes_it_when_its_copy_has_landed():
    r = rank0("a", "b")
    assert r.ops() == MemoryOps(stage=STAGE_0)  # the highest pages first: a's allocator takes low ones
    assert r.stager.state(0) is ChunkState.WRITING
    assert r.pool.num_free == 6  # pages 6-7 are blocked while the copy writes them
    assert r.ops() == MemoryOps()  # still in flight: nothing more to do, nothing issued twice
    assert r.ops(True) == MemoryOps(staged=True, stage=STAGE_1)
    assert r.stager.state(0) is ChunkState.CLEAN and r.pool.num_free == 6  # now pages 4-5 are blocked
    assert r.ops(True) == MemoryOps(staged=True, stage=STAGE_2)
    assert r.ops(True) == MemoryOps(staged=True)
    assert r.ops(True) == MemoryOps()  # every chunk is clean
    assert r.pool.num_free == 8 and r.memory.telemetry()["staging_coverage"] == 1.0


def test_a_writing_chunks_pages_are_never_allocated():
    r = rank0("a", "b")
    r.ops()  # chunk 0 is being written to pages 6-7
    seq = admit(r, 1, 28)  # needs 7 pages; 6 may be handed out
    assert seq.page_table == [] and list(r.batcher.waiting) == [seq]
    assert r.ops(True).stage == STAGE_1  # chunk 0 landed; chunk 1 blocks pages 4-5 now
    r.batcher.plan(0.0)
    assert seq.page_table == []
    assert r.ops(True).stage == STAGE_2  # chunk 1 landed; chunk 2 blocks page 3
    r.batcher.plan(0.0)
    assert seq.page_table == [0, 1, 2, 4, 5, 6, 7]  # every page but the one being written
    assert [r.stager.state(j) for j in range(3)] == [ChunkState.DIRTY, ChunkState.DIRTY, ChunkState.WRITING]


def test_staging_skips_pages_in_use_or_caching_a_prefix():
    r = rank0("a", "b")
    pages = r.pool.allocate(4)  # pages 0-3
    r.pool.publish(3, 1234)  # page 3 caches a prefix
    r.pool.release(pages)
    assert r.ops().stage == STAGE_0
    assert r.ops(True).stage == STAGE_1
    assert r.ops(True) == MemoryOps(staged=True)  # chunk 2 would overwrite the cached page 3
    assert r.stager.state(2) is ChunkState.MISSING
    assert r.memory.telemetry()["staging_slack_bytes"] == 0


def test_a_switch_to_the_staged_model_gathers_every_clean_chunk_device_to_device():
    r = rank0("a", "b")
    r.stage_everything()
    plan = r.memory.switch_plan("b", r.batcher)
    assert plan.model == "b" and plan.ops == MemoryOps()
    assert plan.gather == GatherPlan(
        d2d=((Region(2560, 3072), Region(0, 512)), (Region(2048, 2560), Region(512, 1024)),
             (Region(1792, 2048), Region(1024, 1280))),
        h2d=(), path=SwitchPath.FULL_D2D, staged_bytes=1280, dirty_bytes=0, total_bytes=1280)


def test_kv_allocated_over_a_clean_chunk_dirties_it_and_the_switch_reloads_it_from_host():
    r = rank0("a", "b")
    r.stage_everything()
    admit(r, 1, 16)  # pages 0-3: page 3 lies under chunk 2
    assert [r.stager.state(j) for j in range(3)] == [ChunkState.CLEAN, ChunkState.CLEAN, ChunkState.DIRTY]
    gather = r.memory.switch_plan("b", r.batcher).gather
    assert gather.d2d == ((Region(2560, 3072), Region(0, 512)), (Region(2048, 2560), Region(512, 1024)))
    assert gather.h2d == ((Region(1024, 1280), Region(1024, 1280)),)
    assert (gather.path, gather.staged_bytes, gather.dirty_bytes) == (SwitchPath.PARTIAL, 1024, 256)


def test_a_switch_waits_for_the_chunk_in_flight_and_gathers_it():
    r = rank0("a", "b")
    r.ops()  # chunk 0 is being written
    gather = r.memory.switch_plan("b", r.batcher).gather
    assert r.events.waited == ["staging"]
    assert gather.d2d == ((Region(2560, 3072), Region(0, 512)),)
    assert gather.h2d == ((Region(512, 1024), Region(512, 1024)), (Region(1024, 1280), Region(1024, 1280)))
    assert gather.path is SwitchPath.PARTIAL


def test_a_switch_to_a_model_that_was_not_staged_loads_it_from_host():
    r = rank0("a", "b", "c")
    r.stage_everything()
    assert r.memory.switch_plan("c", r.batcher).gather == full_h2d(WEIGHTS["c"])


def test_after_a_switch_staging_targets_the_model_expected_next_in_the_new_layout():
    r = rank0("a", "b", "c")
    r.ops()
    r.memory.switch_plan("b", r.batcher)
    b = Batcher("b", None, 64, 8, 64, (2,))
    b.resume(r.memory.new_pool("b"))  # b: weights [0, 1280), 7 pages at [1280, 3072)
    r.memory.switched("b", "c")
    assert r.stager.target_model == "c"
    # c (768 bytes) stacks down from 3072: [2560, 3072) on b's pages 5-6, then [2304, 2560) on page 4
    assert [(c.dst, c.pages) for c in r.stager.chunks] == [
        (Region(2560, 3072), range(5, 7)), (Region(2304, 2560), range(4, 5))]
    assert r.memory.ops(b).stage == ("c", 0, 512, 2560, 3072)
    r.events.staging_finished = True
    r.memory.switch_plan("a", b)
    r.memory.switched("a", None)  # nothing expected next: staging stops
    assert r.stager.target_model is None and r.ops() == MemoryOps()


def test_poison_mode_nans_every_page_handed_out_once():
    r = rank0("a", "b", poison=True)
    r.stage_everything()
    admit(r, 1, 6)
    assert r.ops().poison == (0, 1)
    assert r.ops().poison == ()
    admit(r, 2, 5)
    assert r.ops().poison == (2, 3)


def test_without_poison_mode_no_page_is_poisoned():
    r = rank0("a", "b")
    r.stage_everything()
    admit(r, 1, 6)
    assert r.ops() == MemoryOps()
