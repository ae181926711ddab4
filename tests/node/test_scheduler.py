"""Instance scheduler on toy batchers: round-robin over models, cancel, usage and timings.

Time comes from a fake clock the test sets by hand, so every timing below is exact.
"""

from __future__ import annotations

from talaria.contracts.call import CallOutput, CallTimings, FinishReason, InstanceCall, SamplingParams, Usage
from talaria.node.batcher import Batcher
from talaria.node.memory.page_manager import PageManager
from talaria.node.scheduler import Scheduler
from talaria.node.step_plan import StepPlan

PS = 4
PROMPT = (10, 11, 12, 13, 14, 15)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler(*models: str, clock: FakeClock | None = None, max_batch_tokens: int = 32) -> Scheduler:
    batchers = {m: Batcher(m, PageManager(8, PS), max_batch_tokens, 8, 64, (2,)) for m in models}
    return Scheduler("inst0", batchers, clock or FakeClock())


def call(request_id: str, model: str = "m", prompt=PROMPT, max_tokens: int = 16) -> InstanceCall:
    return InstanceCall(request_id, model, tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def commit(s: Scheduler, plan: StepPlan, token: int, step_s: float = 0.0) -> list[CallOutput]:
    """Commit `plan` as if every sampling chunk drew `token`."""
    return s.commit(plan, {c.seq_id: token for c in plan.chunks if c.sample}, step_s)


def test_round_robin_alternates_between_models_with_work():
    s = scheduler("a", "b")
    s.add(call("ra", "a", max_tokens=2))
    s.add(call("rb", "b", max_tokens=4))
    models = []
    while (plan := s.plan()) is not None:
        models.append(plan.model)
        commit(s, plan, 50)
    assert models == ["a", "b", "a", "b", "b", "b"]
    assert not s.has_work


def test_round_robin_skips_a_model_without_work_and_resumes_after_the_last_served():
    s = scheduler("a", "b", "c")
    s.add(call("rc", "c", max_tokens=3))
    s.add(call("ra", "a", max_tokens=3))
    models = []
    while (plan := s.plan()) is not None:
        models.append(plan.model)
        commit(s, plan, 50)
    assert models == ["a", "c", "a", "c", "a", "c"]


def test_final_output_carries_usage_and_timings_from_the_clock():
    clock = FakeClock()
    s = scheduler("m", clock=clock)
    clock.now = 1.0
    assert s.add(call("r0", max_tokens=3)) == []
    clock.now = 3.0
    plan = s.plan()
    clock.now = 4.0
    assert commit(s, plan, 50, step_s=0.5) == [CallOutput("r0", (50,), committed_kv_tokens=6)]
    clock.now = 6.0
    plan = s.plan()
    clock.now = 7.0
    assert commit(s, plan, 51, step_s=0.25) == [CallOutput("r0", (51,), committed_kv_tokens=7)]
    clock.now = 9.0
    plan = s.plan()
    clock.now = 10.0
    assert commit(s, plan, 52, step_s=0.25) == [CallOutput(
        "r0", (52,), FinishReason.LENGTH, Usage(prompt_tokens=6, completion_tokens=3, cached_tokens=0),
        committed_kv_tokens=8,
        timings=CallTimings(queued_s=2.0, prefill_s=0.5, decode_s=6.0, first_token_at=4.0))]
    assert not s.has_work

    # the same prompt again: its first page (4 tokens) comes from the prefix cache
    clock.now = 11.0
    s.add(call("r1", max_tokens=1))
    clock.now = 12.0
    plan = s.plan()
    assert plan.chunks[0].start_pos == 4
    clock.now = 13.0
    assert commit(s, plan, 60, step_s=0.125) == [CallOutput(
        "r1", (60,), FinishReason.LENGTH, Usage(6, 1, 4), committed_kv_tokens=6,
        timings=CallTimings(queued_s=1.0, prefill_s=0.125, decode_s=0.0, first_token_at=13.0))]
    assert s.stats().prefix_hit_tokens == 4


def test_prefill_time_sums_every_step_of_a_chunked_prompt_until_the_first_token():
    clock = FakeClock()
    s = scheduler("m", clock=clock, max_batch_tokens=4)
    s.add(call("r0", prompt=range(10, 20), max_tokens=2))
    outputs = []
    for t, step_s in ((1.0, 0.25), (2.0, 0.5), (3.0, 0.125), (4.0, 1.0)):
        clock.now = t
        outputs += commit(s, s.plan(), 70, step_s)
    assert [o.token_ids for o in outputs] == [(70,), (70,)]
    assert outputs[-1].timings == CallTimings(queued_s=1.0, prefill_s=0.875, decode_s=1.0, first_token_at=3.0)


def test_timings_are_exact_when_the_clock_starts_at_zero():
    # a simulator's clock starts at 0.0: a first token at t = 0.0 is a time, not "no time"
    clock = FakeClock()
    s = scheduler("m", clock=clock)
    s.add(call("r0", max_tokens=2))
    commit(s, s.plan(), 50)
    clock.now = 5.0
    [out] = commit(s, s.plan(), 51)
    assert out.timings == CallTimings(queued_s=0.0, prefill_s=0.0, decode_s=5.0, first_token_at=0.0)


def test_cancel_of_a_running_call_gives_a_cancelled_output_and_frees_its_pages():
    s = scheduler("m")
    s.add(call("r0"))
    commit(s, s.plan(), 50)
    pages = s.batchers["m"].pages
    assert pages.num_free == 6
    [out] = s.cancel("r0")
    assert (out.request_id, out.token_ids, out.finish) == ("r0", (), FinishReason.CANCELLED)
    assert out.usage == Usage(6, 1, 0)
    assert pages.num_free == 8 and not s.has_work
    assert s.cancel("r0") == []  # already gone


def test_cancel_while_a_step_runs_drops_that_steps_result():
    s = scheduler("m")
    s.add(call("r0"))
    plan = s.plan()
    [out] = s.cancel("r0")
    assert out.finish is FinishReason.CANCELLED and out.usage == Usage(6, 0, 0)
    assert commit(s, plan, 50) == []
    assert s.batchers["m"].pages.num_free == 8 and not s.has_work


def test_cancel_of_a_waiting_call_leaves_the_queue():
    s = scheduler("m")
    s.add(call("r0", prompt=range(28)))  # 7 of 8 pages
    s.add(call("r1", prompt=range(100, 108)))  # needs 2: waits
    s.plan()
    [out] = s.cancel("r1")
    assert (out.request_id, out.finish, out.usage) == ("r1", FinishReason.CANCELLED, Usage(8, 0, 0))
    assert s.stats().waiting == 0 and s.stats().running == 1


def test_unknown_model_is_answered_with_an_error():
    s = scheduler("m")
    [out] = s.add(call("r0", model="other"))
    assert (out.request_id, out.token_ids, out.finish) == ("r0", (), FinishReason.ERROR)
    assert "inst0" in out.error and "'other'" in out.error
    assert not s.has_work and s.cancel("r0") == []


def test_a_prompt_larger_than_the_pool_is_answered_with_an_error():
    s = scheduler("m")
    [out] = s.add(call("r0", prompt=range(32)))
    assert out.finish is FinishReason.ERROR and "raise arena_bytes" in out.error
    assert not s.has_work
