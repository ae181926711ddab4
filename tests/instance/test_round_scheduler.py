"""Cold-pool rounds with session-prefill on the injected clock: exact event sequences.

The harness (tests/instance/scheduler_harness.py) runs every plan in exactly the time the toy profile
predicts: prefill 1/64 s per token, a decode step 1/16 s, an H2D switch 1/8 s. A round is
gamma * ttft = 1 s and protects ceil(1 s / tpot 0.25 s) = 4 decode steps per model. Every time
below is therefore an exact binary fraction, and each trace is the whole event log of the run.
"""

from __future__ import annotations

import dataclasses

from talaria.contracts.call import InstanceCall, SamplingParams
from talaria.contracts.events import Event
from talaria.instance.rounds import RoundConfig
from tests.instance.scheduler_harness import ROUNDS, instance

T1 = tuple(range(100, 108))  # two full pages: a session's first prompt


def call(rid: str, prompt, session: str | None = None, model: str = "a", max_tokens: int = 1) -> InstanceCall:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return InstanceCall(rid, model, tuple(prompt), sampling, session)


def trace(events: list[Event]) -> list[tuple]:
    """The round structure: phases (start, model, phase, steps, tokens), SP events, switches, rounds."""
    out = []
    for e in events:
        d = e.data
        if e.kind.value == "slot_phase":
            out.append((d["start"], d["model"], d["phase"], d["steps"], d["tokens"]))
        elif e.kind.value == "sp_admit":
            out.append((e.t, "sp_admit", d["request"], d["opportunity"]))
        elif e.kind.value == "sp_park":
            out.append((e.t, "sp_park", d["request"], d["reason"]))
        elif e.kind.value == "switch":
            out.append((e.t, "switch", d["to_model"]))
        elif e.kind.value == "round":
            out.append((e.t, "round", d["round"], d["wall_s"]))
    return out


def rounds(events: list[Event]) -> list[dict]:
    return [e.data for e in events if e.kind.value == "round"]


def test_a_continuation_returning_mid_slot_is_admitted_at_the_next_sp_opportunity():
    inst = instance("a", "b")
    inst.until_idle(arrivals={0.0: [call("t1", T1, "s1"), call("long", range(200, 204), max_tokens=14)],
                              0.3: [call("t2", (*T1, 50, 60, 61, 62), "s1")]})  # t1's prompt + output + tool
    events = inst.log()
    assert trace(events) == [
        (0.0, "a", "P", 1, 12),  # t1 and long, queued when the slot opened
        (0.1875, "a", "D1", 2, 2),  # long decodes; t2 returns at 0.3, mid-step
        (0.3125, "sp_admit", "t2", 1),  # the next decode boundary: its 8-token prefix is on device
        (0.3125, "a", "SP", 1, 4),  # only the 4 new tokens are computed
        (0.375, "a", "D", 10, 10),
        (1.0, "round", 1, 1.0),
        (1.0, "a", "D1", 1, 1),  # long's last token, in the next round
        (1.0625, "round", 2, 0.0625),
    ]
    [admit] = [e.data for e in events if e.kind.value == "sp_admit"]
    assert (admit["cached_tokens"], admit["restored_tokens"]) == (8, 0)


def test_a_continuation_that_does_not_fit_waits_for_the_next_slot():
    inst = instance("a", "b")
    # a 5-token prompt for long moves every decode boundary by 1/64 s: t2 comes back at 0.9, and at
    # the boundary 0.953125 the slot has 0.046875 s left, less than a 4-token chunk (0.0625 s)
    inst.until_idle(arrivals={0.0: [call("t1", T1, "s1"), call("long", range(200, 205), max_tokens=14)],
                              0.9: [call("t2", (*T1, 50, 60, 61, 62), "s1")]})
    assert trace(inst.log()) == [
        (0.0, "a", "P", 1, 13),
        (0.953125, "sp_park", "t2", "budget"),
        (0.203125, "a", "D1", 12, 12),
        (0.953125, "round", 1, 0.953125),  # another decode step would overrun the 1 s round
        (0.953125, "a", "P", 1, 4),  # t2 in the next slot's P
        (1.015625, "a", "D1", 1, 1),
        (1.078125, "round", 2, 0.125),
    ]


def test_a_long_continuation_advances_chunk_by_chunk_between_decode_steps():
    inst = instance("c", "b", max_batch_tokens=4)  # 4 tokens per step: t2's 12 new tokens take 3 SP steps
    inst.until_idle(arrivals={0.0: [call("t1", T1, "s1", "c"), call("long", range(200, 204), "", "c", 10)],
                              0.4: [call("t2", (*T1, 50, *range(60, 71)), "s1", "c")]})
    assert trace(inst.log()) == [
        (0.0, "c", "P", 3, 12),
        (0.1875, "c", "D1", 4, 4),
        (0.4375, "sp_admit", "t2", 1),
        (0.4375, "c", "SP", 1, 4),
        (0.5, "c", "D", 1, 1),
        (0.5625, "c", "SP", 1, 4),
        (0.625, "c", "D", 1, 1),
        (0.6875, "c", "SP", 1, 4),
        (0.75, "c", "D", 3, 3),
        (0.9375, "round", 1, 0.9375),
    ]


def test_a_new_session_never_bypasses_p():
    inst = instance("a", "b")
    inst.until_idle(arrivals={0.0: [call("t1", T1, "s1"), call("long", range(200, 204), max_tokens=14)],
                              0.3: [call("n1", range(300, 305), "s9")]})  # unknown session: not a continuation
    assert trace(inst.log()) == [
        (0.0, "a", "P", 1, 12),
        (0.1875, "a", "D1", 13, 13),
        (1.0, "round", 1, 1.0),
        (1.0, "a", "P", 1, 5),  # n1 waited for the next P
        (1.078125, "round", 2, 0.078125),
    ]


def test_with_sp_off_a_returning_continuation_is_parked_until_the_next_slot():
    inst = instance("a", "b", rounds=dataclasses.replace(ROUNDS, sp=False))
    inst.until_idle(arrivals={0.0: [call("t1", T1, "s1"), call("long", range(200, 204), max_tokens=14)],
                              0.3: [call("t2", (*T1, 50, 60, 61, 62), "s1")]})
    assert trace(inst.log()) == [
        (0.0, "a", "P", 1, 12),
        (0.3125, "sp_park", "t2", "sp-off"),
        (0.1875, "a", "D1", 13, 13),
        (1.0, "round", 1, 1.0),
        (1.0, "a", "P", 1, 4),
        (1.0625, "round", 2, 0.0625),
    ]


def test_an_sp_step_is_taken_only_when_its_fixed_cost_fits_the_decoders_tpot_slack():
    """An SP step stalls the slot's decoders for its whole time. Slack: T_tpot 1/4 s less a decode
    step 1/16 s = 3/16 s. A prefill fixed cost of 1/8 s fits it and t2 is admitted mid-slot; one of
    1/4 s does not, so t2 is parked ("tpot") and waits for the next slot's P (one fixed cost for all
    its queue)."""
    arrivals = {0.0: [call("t1", T1, "s1"), call("long", range(200, 204), max_tokens=14)],
                0.5: [call("t2", (*T1, 50, 60, 61, 62), "s1")]}
    fits = instance("a", "b", prefill_base_s=1 / 8)
    fits.until_idle(arrivals=arrivals)
    assert trace(fits.log()) == [
        (0.0, "a", "P", 1, 12),
        (0.3125, "a", "D1", 3, 3),
        (0.5, "sp_admit", "t2", 1),
        (0.5, "a", "SP", 1, 4),  # its fixed cost, 1/8 s, is within the slack
        (0.6875, "a", "D", 3, 3),
        (0.875, "a", "Dfin", 2, 2),
        (1.0, "round", 1, 1.0),
        (1.0, "a", "D1", 5, 5),
        (1.3125, "round", 2, 0.3125),
    ]
    too_slow = instance("a", "b", prefill_base_s=1 / 4)
    too_slow.until_idle(arrivals=arrivals)
    assert trace(too_slow.log()) == [
        (0.0, "a", "P", 1, 12),
        (0.5, "sp_park", "t2", "tpot"),
        (0.4375, "a", "D1", 5, 5),
        (0.75, "a", "Dfin", 4, 4),
        (1.0, "round", 1, 1.0),
        (1.0, "a", "P", 1, 4),  # t2, in the next slot's P
        (1.3125, "a", "D1", 4, 4),
        (1.5625, "round", 2, 0.5625),
    ]
    for base, sp in ((3 / 16, ("sp_admit", "t2", 1)), (3 / 16 + 1 / 1024, ("sp_park", "t2", "tpot"))):
        edge = instance("a", "b", prefill_base_s=base)  # a fixed cost equal to the slack is within it
        edge.until_idle(arrivals=arrivals)
        assert [t[1:] for t in trace(edge.log()) if t[1] in ("sp_admit", "sp_park")] == [sp]


def test_decode_share_holds_under_heavy_prefill_pressure():
    inst = instance("a", "b", max_batch_tokens=32, extra_pages=64)
    prompts = [call(f"p{i}", range(200 + 50 * i, 240 + 50 * i)) for i in range(6)]  # 240 tokens: 3.75 s
    inst.until_idle(arrivals={0.0: [call("dec", range(100, 104), max_tokens=40)], 0.1: prompts})
    events = inst.log()
    # each round: P gets 1 s - 4 protected decode steps = 0.75 s (48 tokens), then the 4 decode steps
    assert trace(events)[3:9] == [
        (1.0, "a", "P", 2, 48),
        (1.75, "a", "Dfin", 4, 4),
        (2.0, "round", 2, 1.0),
        (2.0, "a", "P", 2, 48),
        (2.75, "a", "Dfin", 4, 4),
        (3.0, "round", 3, 1.0),
    ]
    for r in rounds(events):
        [slot] = r["slots"]
        assert slot["decode_steps"] >= slot["protected"] == 4
    assert inst.scheduler.rounds.deadline_risk["prefill_shortfall"] == 4  # reported, not hidden


def test_decode_share_holds_when_every_step_takes_three_times_its_prediction():
    inst = instance("a", "b", max_batch_tokens=32, extra_pages=64, learn=False)  # predictions stay 3x short
    prompts = [call(f"p{i}", range(200 + 50 * i, 240 + 50 * i)) for i in range(6)]
    inst.until_idle(arrivals={0.0: [call("dec", range(100, 104), max_tokens=40)], 0.1: prompts}, slowdown=3.0)
    for r in rounds(inst.log())[:-1]:  # in the last round dec runs out of tokens
        [slot] = r["slots"]
        assert slot["decode_steps"] >= slot["protected"] == 4  # the slot overruns rather than skip decode
    assert inst.scheduler.rounds.deadline_risk["round_over"] > 0  # and says so


def test_each_round_stays_within_gamma_ttft_and_skips_models_without_work():
    inst = instance("a", "b", "c")  # b never has work
    inst.until_idle(arrivals={0.0: [call("ra", range(100, 108), max_tokens=12),
                                    call("rc", range(300, 308), model="c", max_tokens=12)]})
    events = inst.log()
    assert trace(events)[:6] == [
        (0.0, "a", "P", 1, 8),
        (0.125, "a", "D1", 5, 5),  # a's slot: 0.4375 s, half of what the 0.125 s switch leaves
        (0.5625, "switch", "c"),
        (0.5625, "c", "P", 1, 8),
        (0.6875, "c", "D1", 5, 5),
        (1.0, "round", 1, 1.0),  # 0.4375 + 0.125 + 0.4375
    ]
    # round 2 opens with c, which finishes in its slot: a's queued call is priced as the P will run it
    # (a host restore and a 2-token tail), not as its whole 13-token context, so c's budget is enough
    assert [e.data["to_model"] for e in events if e.kind.value == "switch"] == ["c", "a"]
    for r in rounds(events):
        assert r["wall_s"] <= ROUNDS.round_s
        assert r["wall_s"] == r["active_s"] + r["switch_s"]
        assert "b" not in [s["model"] for s in r["slots"]]
    assert inst.scheduler.rounds.deadline_risk["round_over"] == 0


def test_an_infeasible_tpot_target_is_reported():
    inst = instance("a", "b", rounds=RoundConfig(ttft_s=1.25, tpot_s=1 / 32, gamma=0.8, max_batch_tokens=32))
    inst.until_idle(arrivals={0.0: [call("r", range(100, 104), max_tokens=3)]})
    assert inst.scheduler.rounds.deadline_risk["tpot_infeasible"] >= 1  # a decode step takes 1/16 s > 1/32
    assert inst.scheduler.stats().rounds.deadline_risk["tpot_infeasible"] >= 1  # and telemetry says so


def test_by_default_a_prefill_chunk_is_at_least_a_quarter_of_the_step_budget():
    """A forward pass has a fixed cost: SP steps of a page each would spend the slot on overhead."""
    inst = instance("a", "b", rounds=dataclasses.replace(ROUNDS, min_chunk_tokens=0))
    assert inst.scheduler.rounds.min_chunk == 32 // 4
    inst = instance("a", "b", rounds=dataclasses.replace(ROUNDS, min_chunk_tokens=0), max_batch_tokens=8)
    assert inst.scheduler.rounds.min_chunk == 4  # never below a page


def test_without_host_kv_a_slot_keeps_its_budget_and_a_switched_out_call_is_recomputed():
    """40 decode steps (2.5 s) outlast any slot of a 1 s round. Without a host KV registry the slot
    still closes on its budget (as the paper's baselines do): the call loses its KV at the switch,
    is recomputed (prompt and tokens so far, to the end, whatever its next slot's budget) and goes
    on; b is served within the first round instead of after the long call."""
    inst = instance("a", "b", hkvr=False, extra_pages=16)
    outputs = inst.until_idle(arrivals={0.0: [call("long", range(200, 204), max_tokens=40),
                                                call("other", range(300, 304), model="b", max_tokens=2)]})
    done = {o.request_id: o for o in outputs if o.finish is not None}
    assert done["long"].usage.completion_tokens == 40 and done["other"].usage.completion_tokens == 2
    a = inst.scheduler.batchers["a"]
    assert a.preemptions >= 1 and a.lost_tokens > 0
    first_switch = next(e for e in inst.log() if e.kind.value == "switch")
    assert first_switch.t < ROUNDS.round_s  # b opened in the first round, not after the long call


def _three_models_in_short_rounds(thrash_k: float, host_slabs: int = 2):
    """Rounds of 0.25 s, two 0.125 s switches long; six 24-token prompts over three models, prefilled a
    page per step; a host KV registry of `host_slabs` pages, so KV saved at a switch is soon evicted."""
    rc = dataclasses.replace(ROUNDS, ttft_s=0.3125, thrash_k=thrash_k)
    inst = instance("a", "b", "c", rounds=rc, max_batch_tokens=4, host_slabs=host_slabs, extra_pages=8)
    calls = [call(f"{m}{i}", range(100 + 40 * i + 200 * j, 124 + 40 * i + 200 * j), model=m, max_tokens=6)
             for j, m in enumerate("abc") for i in range(2)]
    outputs = inst.until_idle(limit=3000, arrivals={0.0: calls})
    return inst, {o.request_id: o for o in outputs if o.finish is not None}


def test_a_prompt_whose_kv_was_lost_finishes_its_prefill_in_its_next_slot():
    """With the guard off, every slot is a chunk or two and two host slabs cannot keep what a switch
    saves: a prompt that restarted at every slot would never finish (chaos found this live). A prompt
    that has lost KV once is prefilled to the end in its next slot, which yields a token each time."""
    inst, done = _three_models_in_short_rounds(thrash_k=0.0)
    assert sorted(done) == ["a0", "a1", "b0", "b1", "c0", "c1"]
    assert all(o.usage.completion_tokens == 6 for o in done.values())
    assert sum(b.lost_tokens for b in inst.scheduler.batchers.values()) > 0  # the case really arose
    assert inst.scheduler.stats().lost_tokens > 0  # and telemetry counts it


def test_the_thrash_guard_switches_only_into_slots_worth_the_switch_and_starves_no_model():
    """Rounds shorter than their switches: unguarded, every slot pays a switch to serve a chunk; with
    the guard (k = 1) a model whose slot would serve less than its switch costs is deferred, at most
    max_deferrals rounds in a row, and its next slot gets at least the switch's worth of budget."""
    unguarded, _ = _three_models_in_short_rounds(thrash_k=0.0)
    unguarded_switches = sum(1 for e in unguarded.log() if e.kind.value == "switch")
    guarded, done = _three_models_in_short_rounds(thrash_k=1.0)
    events = guarded.log()
    assert len(done) == 6
    switches = sum(1 for e in events if e.kind.value == "switch")
    assert switches < unguarded_switches and guarded.clock.now < unguarded.clock.now
    risk = guarded.scheduler.rounds.deadline_risk
    assert risk["thrash_deferred"] > 0  # deferrals are reported
    streak: dict[str, int] = {}
    for r in rounds(events):
        for m in "abc":
            streak[m] = streak.get(m, 0) + 1 if m in r["deferred"] else 0
            assert streak[m] <= guarded.scheduler.rounds.config.max_deferrals
        for slot in r["slots"]:
            if slot["model"] in r["deferred"]:
                raise AssertionError(f"round {r['round']} ran a deferred model")
