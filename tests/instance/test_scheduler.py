"""Instance scheduler on real bookkeeping: one model active at a time, slots, switches, host KV saves.

No torch and no engine: a real BumpLayout, HostKVRegistry and MemoryPlanner, Batchers with host
saves, and a RankLedger standing in for the runners' KV. The test samples every token itself and
sets the clock by hand, so every plan, page, slab and timing below is exact.

The toy arena (3584 bytes, 256 of runtime, 256-byte pages of 4 tokens) leaves model "a" (1024 bytes
of weights) 8 KV pages, "b" (1280 bytes) 7 pages and "c" (768 bytes) 9 pages; the host registry has
16 slabs.
"""

from __future__ import annotations

import pytest

from talaria.config.schema import Ablation
from talaria.contracts.call import (
    CallOutput,
    CallTimings,
    FinishReason,
    InstanceCall,
    Usage,
)
from talaria.contracts.step_plan import (
    MemoryOps,
    SaveOp,
    SeqChunk,
    StepPlan,
    SwitchPlan,
)
from talaria.instance.memory_planner import full_h2d
from talaria.instance.sequence import SeqStatus
from talaria.memory.host_kv_registry import RankReport
from tests.instance.scheduler_harness import (
    PAGES,
    PROMPT,
    WEIGHTS,
    call,
    chain,
    instance,
    kind,
)


def test_the_toy_layout_gives_each_model_its_own_pool_size():
    inst = instance("a", "b", "c")
    assert {m: inst.memory.layout.plan(m).num_pages for m in WEIGHTS} == PAGES
    assert inst.scheduler.active == "a"
    assert inst.scheduler.stats().kv_pages_total == PAGES["a"]
    stats = inst.scheduler.stats()  # each model's cache sizes, from its layout, for telemetry
    assert (stats.page_bytes, stats.state_bytes) == ({"a": 256, "b": 256, "c": 256}, {"a": 0, "b": 0, "c": 0})


# ---- which model has the group -----------------------------------------------------------------


def test_the_active_model_keeps_stepping_while_no_other_model_waits():
    inst = instance("a", "b")
    inst.scheduler.add(call("ra", "a", max_tokens=6))
    seen = []
    for t in (0.0, 0.5, 1.0, 2.0, 4.0):  # far past the slot: nobody else wants the group
        inst.clock.now = t
        plan, _ = inst.step()
        seen.append(kind(plan))
    assert seen == ["a"] * 5
    assert inst.scheduler.active == "a"


def test_the_switch_comes_at_once_when_the_active_model_has_no_work():
    inst = instance("a", "b")
    inst.clock.now = 0.125
    inst.scheduler.add(call("rb", "b", max_tokens=2))
    plan, _ = inst.step()  # a is idle: no slot to wait out
    assert kind(plan) == "-> b"
    inst.clock.now = 0.25
    inst.scheduler.add(call("ra", "a"))
    seen = []
    for t in (0.25, 0.375, 0.5):
        inst.clock.now = t
        plan, _ = inst.step()
        seen.append(kind(plan))
    # b prefills and decodes its last token inside its slot, then hands over without waiting
    assert seen == ["b", "b", "-> a"]


def test_a_forced_switch_goes_first_at_the_next_plan():
    inst = instance("a", "b", "c")
    inst.scheduler.add(call("ra", "a"))
    inst.scheduler.add(call("rb", "b"))
    inst.step()
    inst.clock.now = 0.125  # inside a's slot, and c has no work at all
    inst.scheduler.force_switch("c")
    plan, _ = inst.step()
    assert kind(plan) == "-> c"
    # the force is spent: c is idle, so the group moves on at once, in order after c
    inst.clock.now = 0.25
    plan, _ = inst.step()
    assert kind(plan) == "-> a"


def test_an_idle_gap_is_no_part_of_a_round():
    """The rank loop stops stepping when nothing has work: the round ends there, with its work. Left
    open, it would be closed by the next call, 30 s later, with the gap in its wall time: an overrun
    of its 1 s bound that the router reads as deadline risk, and holds calls of the other model at
    the gateway of an idle instance (the 429s the fuzz test saw)."""
    inst = instance("a", "b")

    def serve(request: InstanceCall) -> None:  # as the rank loop does: it plans only while there is work
        inst.scheduler.add(request)
        while inst.scheduler.has_work:
            inst.advance()

    serve(call("ra", "a", prompt=(10,), max_tokens=2))  # less than a page: no save keeps it stepping
    assert inst.scheduler.stats().rounds.round is None
    inst.clock.now += 30.0
    serve(call("rb", "b", prompt=(10,), max_tokens=2))
    rounds = inst.scheduler.stats().rounds
    assert rounds.round is None
    assert [r["slots"][0]["model"] for r in rounds.last_rounds] == ["a", "b"]
    assert all(r["wall_s"] <= rounds.round_s for r in rounds.last_rounds)


def test_forcing_the_active_model_does_nothing():
    inst = instance("a", "b")
    inst.scheduler.add(call("ra", "a"))
    inst.scheduler.add(call("rb", "b"))
    inst.step()
    inst.clock.now = 0.25  # inside a's slot
    inst.scheduler.force_switch("a")
    plan, _ = inst.step()
    assert plan == StepPlan("a", (SeqChunk(0, (50,), 6, (0, 1), True, decode=True),), MemoryOps())
    assert inst.scheduler.switches == [] and inst.scheduler.active == "a"


def test_forcing_the_active_model_does_not_delay_a_due_switch():
    inst = instance("a", "b")
    inst.scheduler.add(call("ra", "a"))
    inst.scheduler.add(call("rb", "b"))
    for t in (0.0, 0.0625, 0.125, 0.1875, 0.25):  # P, then the 4 protected decode steps
        inst.clock.now = t
        assert kind(inst.step()[0]) == "a"
    inst.clock.now = 0.5  # a's slot (0.4375 s: half of what the switch leaves of the 1 s round) is over
    inst.scheduler.force_switch("a")
    assert kind(inst.scheduler.plan()) == "-> b"


def test_forcing_an_unknown_model_raises_key_error():
    inst = instance("a", "b")
    with pytest.raises(KeyError, match="'z'"):
        inst.scheduler.force_switch("z")
    assert kind(inst.scheduler.plan()) is None  # nothing was queued by the failed call


# ---- suspend, save, switch, restore ------------------------------------------------------------

P0 = (20, 21, 22, 23, 24)  # one full page
P1 = (10, 11, 12, 13, 14, 15, 16)


def a_serving_with_b_waiting():
    """a finishes r0 and runs r1 for three tokens while b's call arrives."""
    inst = instance("a", "b")
    inst.scheduler.add(call("r0", "a", P0, max_tokens=1))
    inst.scheduler.add(call("r1", "a", P1, max_tokens=5))
    plan, out = inst.step(50)  # r0: pages 0-1, r1: pages 2-3
    assert [o.finish for o in out] == [FinishReason.LENGTH, None]
    inst.clock.now = 0.125
    plan, _ = inst.step(51)
    assert plan.ops.saves == (SaveOp(0, 0, ((0, 0),)),)  # r0's full page -> slab 0; its copy runs on
    inst.clock.now = 0.25
    inst.scheduler.add(call("rb", "b", max_tokens=1))
    plan, _ = inst.step(52)
    assert kind(plan) == "a" and plan.ops.agree == ()  # r0's copy has not finished
    return inst


def test_a_switch_preempts_the_outgoing_models_sequences_and_saves_their_full_pages():
    inst = a_serving_with_b_waiting()
    a = inst.scheduler.batchers["a"]
    b_pool = inst.scheduler.batchers["b"].pages
    inst.clock.now = 0.5
    inst.scheduler.force_switch("b")  # the switch itself is what this test is about
    plan = inst.scheduler.plan()
    # r1 has KV for 9 tokens: pages 2 and 3 are full and go to slabs 1 and 2; the plan also settles
    # r0's save, still pending, so the outgoing pool is left with nothing in flight
    assert plan == SwitchPlan("b", full_h2d(WEIGHTS["b"]), MemoryOps(
        saves=(SaveOp(1, 1, ((2, 1), (3, 2))),), agree=((0, 0), (1, 1))))
    [r1] = a.waiting
    assert (r1.status, r1.token_ids, r1.num_computed, r1.page_table) == (
        SeqStatus.WAITING, [*P1, 50, 51, 52], 0, [])
    assert a.running == [] and a.preemptions == 1
    assert inst.host.match("a", chain(r1.token_ids)) == []  # in flight: nothing readable yet

    inst.clock.now = 0.625
    inst.run(plan)
    assert inst.host.match("a", chain(P0)) == [0]
    assert inst.host.match("a", chain(r1.token_ids)) == [1, 2]
    assert a.pinned_pages == {} and a.pages.num_used == 0 and not inst.memory.busy
    pool = inst.scheduler.batchers["b"].pages
    assert pool is not b_pool and (pool.num_pages, pool.num_used) == (PAGES["b"], 0)
    st = inst.scheduler.stats()
    assert (st.active_model, st.kv_pages_total, st.waiting, st.running) == ("b", PAGES["b"], 2, 0)


def test_the_preempted_sequence_is_restored_from_host_when_its_model_is_active_again():
    inst = a_serving_with_b_waiting()
    inst.clock.now = 0.5
    inst.scheduler.force_switch("b")
    inst.step()  # -> b
    inst.clock.now = 0.75
    plan, out = inst.step(60)
    assert [(o.request_id, o.finish) for o in out] == [("rb", FinishReason.LENGTH)]
    inst.clock.now = 0.875
    plan, _ = inst.step()  # b is idle: straight back to a, with rb's save (slab 3)
    assert plan == SwitchPlan("a", full_h2d(WEIGHTS["a"]), MemoryOps(
        saves=(SaveOp(2, 2, ((0, 3),)),), agree=((2, 2),)))
    assert inst.scheduler.batchers["a"].pages.num_pages == PAGES["a"]

    inst.clock.now = 1.0
    plan, out = inst.step(53)
    # a fresh pool: pages 0-1 are filled from slabs 1-2 before the forward, only 51, 52 are computed
    # (rb's save was agreed at the switch, so every rank may now forget rb)
    # the admitting chunk carries the restored tokens [0, 8): P1 and r1's first generated token
    assert plan == StepPlan("a", (SeqChunk(1, (51, 52), 8, (0, 1, 2), True,
                                           prefix=(10, 11, 12, 13, 14, 15, 16, 50)),),
                            MemoryOps(restores=((1, 0), (2, 1)), forget=(2,)))
    assert out == [CallOutput("r1", (53,), committed_kv_tokens=10)]
    inst.clock.now = 1.125
    plan, [out] = inst.step(54)
    assert plan.chunks == (SeqChunk(1, (53,), 10, (0, 1, 2), True, decode=True),)
    assert plan.chunks[0].prefix == ()  # a decode after admission carries no prefix
    assert out.token_ids == (54,) and out.finish is FinishReason.LENGTH
    # its prompt was computed at its first admission: the restore is not a prefix hit of this call
    assert out.usage == Usage(prompt_tokens=7, completion_tokens=5, cached_tokens=0, restored_tokens=0)
    assert out.timings == CallTimings(queued_s=0.0, prefill_s=0.0, decode_s=1.125, first_token_at=0.0,
                                       service_s=1.125)


def test_without_hkvr_a_switch_swaps_the_running_sequence_but_keeps_no_finished_prefix():
    """HKVR ablated: host KV holds only what a slot's close takes from running sequences (they stay
    active through the round, paper Eq. (4)); a finished call leaves nothing for its session."""
    inst = instance("a", "b", ablations=(Ablation.HKVR,))
    inst.scheduler.add(call("r0", "a", P0, max_tokens=1))
    inst.scheduler.add(call("r1", "a", P1, max_tokens=5))
    plan, out = inst.step(50)
    assert [o.finish for o in out] == [FinishReason.LENGTH, None]
    inst.clock.now = 0.125
    plan, _ = inst.step(51)
    assert plan.ops.saves == ()  # r0 finished: under HKVR its full page would go to host here
    inst.clock.now = 0.25
    inst.scheduler.add(call("rb", "b", max_tokens=1))
    inst.step(52)
    inst.clock.now = 0.5
    inst.scheduler.force_switch("b")
    plan, _ = inst.step()
    assert plan.ops.saves == (SaveOp(0, 1, ((2, 0), (3, 1))),)  # r1's two full pages, swapped out
    inst.clock.now = 0.75
    inst.step(60)  # rb on b
    inst.clock.now = 0.875
    assert kind(inst.step()[0]) == "-> a"
    inst.clock.now = 1.0
    plan, out = inst.step(53)
    assert plan.ops.restores == ((0, 0), (1, 1)) and plan.chunks[0].start_pos == 8  # swapped back in
    assert out == [CallOutput("r1", (53,), committed_kv_tokens=10)]
    assert inst.scheduler.batchers["a"].lost_tokens == 0
    inst.clock.now = 1.125
    inst.step(54)
    turn2 = (*P0, 50, 70, 71, 72)  # r0's session comes back: its prefix was never saved
    inst.scheduler.add(call("t2", "a", turn2, max_tokens=1))
    plan, [out] = inst.step(80)
    assert plan.ops.restores == () and plan.chunks[0].start_pos == 0
    assert out.usage == Usage(prompt_tokens=9, completion_tokens=1, cached_tokens=0, restored_tokens=0)


def test_a_returning_session_restores_its_prefix_from_host_and_counts_it():
    inst = instance("a", "b")
    inst.scheduler.add(call("t1", "a", P1, max_tokens=2))
    inst.step(50)
    inst.step(51)  # t1 finished with KV for P1 + (50,): two full pages
    inst.clock.now = 0.125
    inst.scheduler.add(call("rb", "b", max_tokens=1))
    plan, _ = inst.step()
    assert plan.ops == MemoryOps(saves=(SaveOp(0, 0, ((0, 0), (1, 1))),), agree=((0, 0),))
    inst.step(60)  # rb runs on b and finishes
    turn2 = (*P1, 50, 51, 70, 71, 72)  # the session comes back after its tool call
    inst.clock.now = 0.25
    inst.scheduler.add(call("t2", "a", turn2, max_tokens=1))
    a = inst.scheduler.batchers["a"]
    assert a.reusable(a.waiting[0]) == (2, 0, 0) and a.holds_prefix(a.waiting[0])  # a's pool, as it was left
    plan, _ = inst.step()
    assert kind(plan) == "-> a"
    assert a.reusable(a.waiting[0]) == (0, 2, 0) and a.holds_prefix(a.waiting[0])  # a fresh pool: on host only
    plan, [out] = inst.step(80)
    assert plan.ops.restores == ((0, 0), (1, 1))
    # the restored tokens [0, 8): P1 and t1's first generated token
    assert plan.chunks == (SeqChunk(2, (51, 70, 71, 72), 8, (0, 1, 2), True,
                                    prefix=(10, 11, 12, 13, 14, 15, 16, 50)),)
    assert out.usage == Usage(prompt_tokens=12, completion_tokens=1, cached_tokens=8, restored_tokens=8)
    st = inst.scheduler.stats()
    assert (st.host_restored_tokens, st.prefix_hit_tokens) == (8, 8)


def test_a_finished_calls_pages_stay_pinned_until_its_save_is_agreed():
    inst = instance("a", "b")
    inst.scheduler.add(call("r0", "a", PROMPT, max_tokens=1))
    inst.scheduler.add(call("r1", "a", P0))
    inst.step()  # r0: pages 0-1 and finished; r1: pages 2-3, room to decode up to 8 tokens
    s = inst.scheduler
    assert s.stats().kv_pages_used == 3  # r0's full page 0 is pinned for its copy; page 1 is free
    plan, _ = inst.step()
    assert plan.ops.saves == (SaveOp(0, 0, ((0, 0),)),) and plan.ops.agree == ()
    plan, _ = inst.step()
    assert plan.ops.agree == () and s.stats().kv_pages_used == 3  # the copy is still running
    inst.events.saves_finished.add(0)
    plan = s.plan()
    assert plan.ops == MemoryOps(agree=((0, 0),))
    assert s.stats().kv_pages_used == 3  # published and unpinned only once every rank reported
    inst.run(plan)
    assert s.stats().kv_pages_used == 2
    assert inst.host.match("a", chain(PROMPT)) == [0]
    plan, _ = inst.step()
    assert plan.ops.forget == (0,)  # no rank needs r0's ledger any more
    assert inst.events.waited == []  # r1 kept the batcher busy: the planner never blocked


def test_has_work_stays_true_until_a_finished_calls_save_is_agreed():
    inst = instance("a", "b")
    s = inst.scheduler
    s.add(call("r0", "a", PROMPT, max_tokens=1))
    inst.step()
    assert s.has_work and s.stats().kv_pages_used == 1
    plan, _ = inst.step()
    assert plan == StepPlan("a", (), MemoryOps(saves=(SaveOp(0, 0, ((0, 0),)),)))
    assert s.has_work and s.stats().kv_pages_used == 1
    plan, _ = inst.step()  # nothing else to do: the planner waits for the copy instead of spinning
    assert inst.events.waited == [0]
    assert plan == StepPlan("a", (), MemoryOps(agree=((0, 0),)))
    assert not s.has_work and s.stats().kv_pages_used == 0


def test_the_agreement_publishes_only_the_head_that_every_rank_holds():
    inst = instance("a", "b")
    s = inst.scheduler
    prompt = tuple(range(30, 43))  # 13 tokens: three full pages
    s.add(call("r0", "a", prompt, max_tokens=1))
    inst.step()
    plan, _ = inst.step()
    assert plan.ops.saves == (SaveOp(0, 0, ((0, 0), (1, 1), (2, 2))),)
    plan = s.plan()
    assert plan.ops.agree == ((0, 0),)
    full = tuple(chain(prompt))
    lagging = [[RankReport(13, full)], [RankReport(9, full)]]  # rank 1 committed only 9 tokens
    s.commit(plan, {}, 0.0, lagging)
    assert inst.host.match("a", full) == [0, 1]
    st = inst.host.stats()
    assert (st.published, st.used, st.in_flight, st.pinned) == (2, 2, 0, 0)  # slab 2 went back
    assert s.stats().kv_pages_used == 0


# ---- usage, timings, cancel, errors ------------------------------------------------------------


def test_final_output_carries_usage_and_timings_from_the_clock():
    inst = instance("a")
    s, clock = inst.scheduler, inst.clock
    clock.now = 1.0
    assert s.add(call("r0", max_tokens=3)) == []
    clock.now = 3.0
    plan = s.plan()
    clock.now = 4.0
    assert inst.run(plan, 50, step_s=0.5) == [CallOutput("r0", (50,), committed_kv_tokens=6)]
    clock.now = 6.0
    plan = s.plan()
    clock.now = 7.0
    assert inst.run(plan, 51, step_s=0.25) == [CallOutput("r0", (51,), committed_kv_tokens=7)]
    clock.now = 9.0
    plan = s.plan()
    clock.now = 10.0
    assert inst.run(plan, 52, step_s=0.25) == [CallOutput(
        "r0", (52,), FinishReason.LENGTH, Usage(prompt_tokens=6, completion_tokens=3, cached_tokens=0),
        committed_kv_tokens=8,
        timings=CallTimings(queued_s=2.0, prefill_s=0.5, decode_s=6.0, first_token_at=4.0, service_s=9.0))]

    # the same prompt again: its first page (4 tokens) comes from the device prefix cache
    clock.now = 11.0
    s.add(call("r1", max_tokens=1))
    clock.now = 12.0
    plan = s.plan()
    assert plan.chunks[0].start_pos == 4 and plan.ops.restores == ()
    clock.now = 13.0
    assert inst.run(plan, 60, step_s=0.125) == [CallOutput(
        "r1", (60,), FinishReason.LENGTH, Usage(6, 1, 4, 0), committed_kv_tokens=6,
        timings=CallTimings(queued_s=1.0, prefill_s=0.125, decode_s=0.0, first_token_at=13.0, service_s=2.0))]
    assert s.stats().prefix_hit_tokens == 4 and s.stats().host_restored_tokens == 0


def test_prefill_time_sums_every_step_of_a_chunked_prompt_until_the_first_token():
    inst = instance("a", max_batch_tokens=4)
    inst.scheduler.add(call("r0", prompt=range(10, 20), max_tokens=2))
    outputs = []
    for t, step_s in ((1.0, 0.25), (2.0, 0.5), (3.0, 0.125), (4.0, 1.0)):
        inst.clock.now = t
        outputs += inst.step(70, step_s)[1]
    assert [o.token_ids for o in outputs] == [(70,), (70,)]
    assert outputs[-1].timings == CallTimings(queued_s=1.0, prefill_s=0.875, decode_s=1.0, first_token_at=3.0,
                                                 service_s=4.0)


def test_timings_are_exact_when_the_clock_starts_at_zero():
    # a simulator's clock starts at 0.0: a first token at t = 0.0 is a time, not "no time"
    inst = instance("a")
    inst.scheduler.add(call("r0", max_tokens=2))
    inst.step(50)
    inst.clock.now = 5.0
    _, [out] = inst.step(51)
    assert out.timings == CallTimings(queued_s=0.0, prefill_s=0.0, decode_s=5.0, first_token_at=0.0, service_s=5.0)


def test_cancel_of_a_running_call_gives_a_cancelled_output_and_frees_its_pages_once_saved():
    inst = instance("a")
    s = inst.scheduler
    s.add(call("r0"))
    inst.step()
    pages = s.batchers["a"].pages
    assert pages.num_free == 6
    [out] = s.cancel("r0")
    assert (out.request_id, out.token_ids, out.finish) == ("r0", (), FinishReason.CANCELLED)
    assert out.usage == Usage(6, 1, 0)
    assert pages.num_free == 7 and s.has_work  # the full page is pinned for its host save
    assert s.cancel("r0") == []  # already gone
    inst.step()
    inst.step()
    assert pages.num_free == 8 and not s.has_work
    assert inst.host.match("a", chain(PROMPT)) == [0]


def test_cancel_while_a_step_runs_drops_that_steps_result():
    inst = instance("a")
    s = inst.scheduler
    s.add(call("r0"))
    plan = s.plan()
    [out] = s.cancel("r0")
    assert out.finish is FinishReason.CANCELLED and out.usage == Usage(6, 0, 0)
    assert inst.run(plan) == []
    assert s.batchers["a"].pages.num_free == 8 and not s.has_work  # nothing computed: nothing to save
    assert inst.host.stats().used == 0


def test_cancel_of_a_waiting_call_leaves_the_queue():
    inst = instance("a")
    s = inst.scheduler
    s.add(call("r0", prompt=range(28)))  # 7 of 8 pages
    s.add(call("r1", prompt=range(100, 108)))  # needs 2: waits
    s.plan()
    [out] = s.cancel("r1")
    assert (out.request_id, out.finish, out.usage) == ("r1", FinishReason.CANCELLED, Usage(8, 0, 0))
    assert s.stats().waiting == 0 and s.stats().running == 1


def test_unknown_model_is_answered_with_an_error():
    inst = instance("a", "b")
    s = inst.scheduler
    [out] = s.add(call("r0", model="other"))
    assert (out.request_id, out.token_ids, out.finish) == ("r0", (), FinishReason.ERROR)
    assert "inst0" in out.error and "'other'" in out.error
    assert not s.has_work and s.cancel("r0") == []


def test_a_prompt_larger_than_the_pool_is_answered_with_an_error():
    inst = instance("a")
    [out] = inst.scheduler.add(call("r0", prompt=range(32)))  # 33 tokens with the next: 9 pages of 8
    assert out.finish is FinishReason.ERROR and "raise arena_bytes" in out.error
    assert not inst.scheduler.has_work
