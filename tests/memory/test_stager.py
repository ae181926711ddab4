"""Stager on the 64 KiB toy arena: exact chunk placement, the chunk state machine, gather plans.

Active model "a" has weights [0, 10240) and 24 KV pages of 2048 bytes at [10240, 59392), the null
page at [59392, 61440). The next model's chunks stack downward from 59392.
"""

from __future__ import annotations

import pytest

from talaria.contracts.kv_layout import sized_layout
from talaria.contracts.vocabulary import SwitchPath
from talaria.memory.bump_layout import BumpLayout, LayoutPlan, Region
from talaria.memory.stager import ChunkState, Stager, StagingError

CHUNK = 4096


def plan(weight_bytes: int) -> LayoutPlan:
    lay = BumpLayout(65536, 4096)
    lay.register("m", weight_bytes, sized_layout(1, 2048))
    return lay.plan("m")


A = plan(10_000)  # kv [10240, 61440), pages 0..23, null page 24
A_LARGE = plan(40_000)  # kv [40192, 61440), pages 0..8 at [40192, 58624)


def all_free(pages: range) -> bool:
    return True


def free_except(*used: int):
    return lambda pages: not any(p in used for p in pages)


def staged_b(chunk_bytes: int = CHUNK, weight_bytes: int = 10_000, active: LayoutPlan = A) -> Stager:
    s = Stager(chunk_bytes)
    s.target("b", weight_bytes, active)
    return s


def stage_all(s: Stager) -> None:
    while (c := s.next_chunk(all_free)) is not None:
        s.written(c)


# ---- placement ---------------------------------------------------------------------------------


def test_chunks_stack_downward_from_the_last_page_aligned():
    s = staged_b()
    assert s.num_chunks == 3
    assert [(c.index, c.src, c.dst, c.pages) for c in s.chunks] == [
        (0, Region(0, 4096), Region(55296, 59392), range(22, 24)),  # ends at the end of page 23
        (1, Region(4096, 8192), Region(51200, 55296), range(20, 22)),
        (2, Region(8192, 10000), Region(49152, 50960), range(19, 20)),  # 49392 rounded down to 49152
    ]
    assert all(s.state(j) is ChunkState.MISSING for j in range(3))


def test_chunks_that_would_overlap_the_next_models_weights_are_not_placed():
    s = staged_b(weight_bytes=52_000)  # B's weights will occupy [0, 52224)
    assert s.num_chunks == 13
    assert [c.dst for c in s.chunks] == [Region(55296, 59392)]  # chunk 1 would start at 51200 < 52224
    stage_all(s)
    assert s.next_chunk(all_free) is None
    assert s.coverage() == 4096 / 52_000


def test_chunks_below_the_kv_start_are_not_placed():
    s = staged_b(weight_bytes=20_000, active=A_LARGE)  # floor is A's kv.start 40192, not 20224
    assert [c.dst for c in s.chunks] == [
        Region(54528, 58624), Region(50432, 54528), Region(46336, 50432), Region(42240, 46336)]
    assert s.num_chunks == 5  # chunk 4 would start at 38400 < 40192: host only


@pytest.mark.parametrize("weight_bytes", [1, 255, 10_000, 30_000, 40_000, 49_000])
@pytest.mark.parametrize("chunk_bytes", [1000, 3072, 4096, 8192])
def test_no_staged_source_overlaps_any_gather_destination(weight_bytes, chunk_bytes):
    s = staged_b(chunk_bytes, weight_bytes)
    weights_b = Region(0, weight_bytes)
    for c in s.chunks:
        assert c.dst.size == c.src.size and c.dst.start % 256 == 0
        assert A.page_pool.contains(c.dst) and not c.dst.overlaps(weights_b)
        assert c.pages == A.pages_overlapping(c.dst)
    for x in s.chunks:
        assert all(not x.dst.overlaps(y.dst) for y in s.chunks if y is not x)
    stage_all(s)
    g = s.gather_plan(Region(0, weight_bytes + 256))
    assert all(not src.overlaps(dst) for src, _ in g.d2d for _, dst in g.d2d + g.h2d)


# ---- the staging loop --------------------------------------------------------------------------


def test_next_chunk_skips_chunks_whose_pages_are_in_use():
    s = staged_b()
    c = s.next_chunk(free_except(22))  # chunk 0 sits on pages 22-23
    assert c is not None and c.index == 1 and s.state(1) is ChunkState.WRITING
    assert s.next_chunk(free_except(22)).index == 2
    assert s.next_chunk(free_except(22)) is None
    assert s.state(0) is ChunkState.MISSING


def test_blocked_pages_are_the_pages_of_writing_chunks():
    s = staged_b()
    assert s.blocked_pages() == frozenset()
    c0 = s.next_chunk(all_free)
    c1 = s.next_chunk(all_free)
    assert s.blocked_pages() == {20, 21, 22, 23}
    s.written(c0)
    assert set(s.blocked_pages()) == {20, 21} and s.state(0) is ChunkState.CLEAN
    s.written(c1)
    assert set(s.blocked_pages()) == set()


def test_on_allocate_dirties_exactly_the_overlapping_clean_chunks():
    s = staged_b(chunk_bytes=3072)  # chunks 0/1 share page 22, chunks 2/3 share page 19
    assert [c.pages for c in s.chunks] == [range(22, 24), range(21, 23), range(19, 21), range(19, 20)]
    stage_all(s)
    s.on_allocate([0, 1, 2])  # low pages: no staged bytes there
    assert all(s.state(j) is ChunkState.CLEAN for j in range(4))
    s.on_allocate([22])
    assert [s.state(j) for j in range(4)] == [ChunkState.DIRTY, ChunkState.DIRTY, ChunkState.CLEAN, ChunkState.CLEAN]
    s.on_allocate([20])
    assert s.state(2) is ChunkState.DIRTY and s.state(3) is ChunkState.CLEAN


def test_chunks_smaller_than_a_page_are_all_dirtied_by_it():
    """A 2048-byte page under 512-byte chunks: every chunk on it turns DIRTY (once, only two did,
    and the others' overwritten bytes were gathered into the next model's weights; bench/chaos.py)."""
    s = staged_b(chunk_bytes=512)
    stage_all(s)
    under = {p: [c.index for c in s.chunks if p in c.pages] for p in range(24)}
    page = max(under, key=lambda p: len(under[p]))
    assert len(under[page]) >= 4
    s.on_allocate([page])
    assert {c.index for c in s.chunks if s.state(c.index) is ChunkState.DIRTY} == set(under[page])


def test_on_allocate_leaves_missing_chunks_missing_and_dirty_chunks_are_restaged():
    s = staged_b()
    s.on_allocate([22])
    assert s.state(0) is ChunkState.MISSING
    stage_all(s)
    s.on_allocate([21])
    assert s.state(1) is ChunkState.DIRTY
    assert s.next_chunk(free_except(21)) is None  # still in use: cannot re-stage yet
    c = s.next_chunk(all_free)  # the KV was freed again
    assert c.index == 1 and s.state(1) is ChunkState.WRITING


def test_allocating_a_writing_chunks_page_is_a_protocol_error():
    s = staged_b()
    s.next_chunk(all_free)
    with pytest.raises(StagingError, match="blocked_pages"):
        s.on_allocate([23])


def test_written_only_once_and_only_for_the_current_target():
    s = staged_b()
    c = s.next_chunk(all_free)
    s.written(c)
    with pytest.raises(StagingError, match="not WRITING"):
        s.written(c)
    old = s.chunks[1]
    s.target("c", 10_000, A)
    with pytest.raises(StagingError):
        s.written(s.chunks[0])  # MISSING, never handed out
    s.next_chunk(all_free)
    s.next_chunk(all_free)
    assert s.chunks[1] == old  # same sizes, same placement: the state is what is checked
    s.written(old)


# ---- retargeting -------------------------------------------------------------------------------


def test_retargeting_resets_states_but_the_same_target_is_a_no_op():
    s = staged_b()
    stage_all(s)
    s.target("b", 10_000, A)
    assert s.coverage() == 1.0
    s.target("c", 10_000, A)  # a different next model
    assert s.target_model == "c" and s.coverage() == 0.0
    stage_all(s)
    s.target("c", 10_000, A_LARGE)  # after a switch the active plan is new
    assert s.coverage() == 0.0 and s.chunks[0].dst == Region(54528, 58624)


def test_retargeting_or_clearing_while_writing_is_refused():
    s = staged_b()
    c = s.next_chunk(all_free)
    with pytest.raises(StagingError, match="being written"):
        s.target("c", 10_000, A)
    with pytest.raises(StagingError):
        s.clear()
    s.written(c)
    s.clear()
    assert s.target_model is None and s.chunks == () and s.next_chunk(all_free) is None
    assert s.coverage() == 0.0 and s.slack_bytes(all_free) == 0


# ---- gather plans ------------------------------------------------------------------------------

NEW_WEIGHTS = Region(0, 10240)


def test_gather_plan_full_d2d():
    s = staged_b()
    stage_all(s)
    g = s.gather_plan(NEW_WEIGHTS)
    assert g.path is SwitchPath.FULL_D2D
    assert g.d2d == (
        (Region(55296, 59392), Region(0, 4096)),
        (Region(51200, 55296), Region(4096, 8192)),
        (Region(49152, 50960), Region(8192, 10000)),
    )
    assert g.h2d == ()
    assert (g.staged_bytes, g.dirty_bytes, g.total_bytes, g.h2d_bytes) == (10_000, 0, 10_000, 0)


def test_gather_plan_h2d_only():
    g = staged_b().gather_plan(NEW_WEIGHTS)
    assert g.path is SwitchPath.H2D_ONLY and g.d2d == ()
    assert g.h2d == (
        (Region(0, 4096), Region(0, 4096)),
        (Region(4096, 8192), Region(4096, 8192)),
        (Region(8192, 10000), Region(8192, 10000)),
    )
    assert (g.staged_bytes, g.dirty_bytes, g.total_bytes) == (0, 0, 10_000)


def test_gather_plan_partial_reloads_dirty_and_writing_chunks_from_host():
    s = staged_b()
    stage_all(s)
    s.on_allocate([20])  # dirties chunk 1
    s.on_allocate([19])  # dirties chunk 2 ...
    s.next_chunk(free_except(20))  # ... which is being re-staged at switch time
    assert s.state(2) is ChunkState.WRITING
    g = s.gather_plan(NEW_WEIGHTS)
    assert g.path is SwitchPath.PARTIAL
    assert g.d2d == ((Region(55296, 59392), Region(0, 4096)),)
    assert g.h2d == ((Region(4096, 8192), Region(4096, 8192)), (Region(8192, 10000), Region(8192, 10000)))
    assert (g.staged_bytes, g.dirty_bytes, g.total_bytes, g.h2d_bytes) == (4096, 4096, 10_000, 5904)


def test_gather_plan_includes_unplaced_chunks_from_host():
    s = staged_b(weight_bytes=52_000)
    stage_all(s)
    g = s.gather_plan(Region(0, 52224))
    assert g.path is SwitchPath.PARTIAL and len(g.d2d) == 1 and len(g.h2d) == 12
    assert g.h2d[-1] == (Region(49152, 52000), Region(49152, 52000))


def test_gather_plan_guards():
    with pytest.raises(StagingError, match="target"):
        Stager(CHUNK).gather_plan(NEW_WEIGHTS)
    s = staged_b()
    stage_all(s)
    with pytest.raises(ValueError, match="needs 10000"):
        s.gather_plan(Region(0, 9999))
    with pytest.raises(StagingError, match="overlaps"):
        s.gather_plan(Region(50000, 60000))  # a weights region over the staged bytes


# ---- telemetry ---------------------------------------------------------------------------------


def test_slack_and_coverage():
    s = staged_b()
    assert s.slack_bytes(all_free) == 10_000 and s.coverage() == 0.0
    assert s.slack_bytes(free_except(22)) == 10_000 - 4096  # chunk 0 sits under live KV
    c0 = s.next_chunk(all_free)
    assert s.slack_bytes(all_free) == 4096 + 1808  # WRITING is not slack
    s.written(c0)
    assert s.coverage() == 4096 / 10_000
    stage_all(s)
    assert s.slack_bytes(all_free) == 0 and s.coverage() == 1.0
    s.on_allocate([19])
    assert s.coverage() == 8192 / 10_000
    assert s.slack_bytes(free_except(19)) == 0 and s.slack_bytes(all_free) == 1808


def test_held_bytes_count_written_and_in_flight_chunks_but_not_dirty_ones():
    s = staged_b()
    assert s.held_bytes() == 0
    c0 = s.next_chunk(all_free)
    assert s.held_bytes() == 4096  # a chunk being written already holds its destination
    s.written(c0)
    stage_all(s)
    assert s.held_bytes() == 10_000
    s.on_allocate([19])  # chunk 2's bytes now belong to a KV page
    assert s.held_bytes() == 8192
    s.on_allocate([19])  # dirty already: nothing more leaves
    assert s.held_bytes() == 8192
    s.written(s.next_chunk(all_free))  # restaged
    assert s.held_bytes() == 10_000
    s.clear()
    assert s.held_bytes() == 0


def test_switch_path_severity_order():
    assert [p.severity for p in (SwitchPath.FULL_D2D, SwitchPath.PARTIAL, SwitchPath.H2D_ONLY)] == [0, 1, 2]
