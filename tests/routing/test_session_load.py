"""`talaria.routing.session_load`: what admitted sessions charge their instance, in calls and in tool
gaps, and when they go quiet. Prices come from a recording stand-in: 1 ms per token past the reusable
prefix, plus 1 ms per output token; a footprint past 10,000 tokens makes the whole prompt count."""

from __future__ import annotations

import pytest

from talaria.routing.session_lengths import ALPHA, prior_second_call
from talaria.routing.session_load import (
    QUIET_FIRST_S,
    QUIET_MIN_S,
    SCALE_BOUNDS,
    GapEstimate,
    InstanceLoad,
    SessionLoad,
)

POOL = 10_000


class Prices:
    def __init__(self) -> None:
        self.asked: list[tuple] = []
        self.said: list[float] = []  # the prices answered, in order

    def __call__(self, instance: str, model: str, prompt: int, reusable: int, max_tokens: int, footprint: int) -> float:
        self.asked.append((instance, model, prompt, reusable, max_tokens, footprint))
        if footprint > POOL:
            reusable = 0
        self.said.append(0.001 * (prompt - reusable + max_tokens))
        return self.said[-1]


def test_a_session_charges_its_call_then_its_next_call_through_its_tool_gap():
    prices = Prices()
    load = SessionLoad(prices, ttl_s=900.0)
    load.placed("s", "m", "a", work_s=0.3, kv_tokens=310, now=0.0)
    assert load.on("a").total_s == pytest.approx(0.3)  # its call, while it runs
    load.completed("s", "m", "a", prompt_tokens=300, reply_tokens=20, max_tokens=20, now=2.0)
    # no growth seen yet for the model: the next prompt is this call's prompt and reply
    assert prices.asked[-1] == ("a", "m", 320, 319, 20, 320)
    # after a first call, the chance of a second: before any session ended, the paper's agents'
    assert load.on("a").total_s == pytest.approx(0.001 * (1 + 20) * prior_second_call())
    assert load.on("a").kv == {"m": 320}
    load.sweep(2.0 + QUIET_FIRST_S - 0.01)
    assert load.on("a").total_s > 0  # still in its tool gap


def test_the_next_call_grows_by_what_the_last_turn_added():
    prices = Prices()
    load = SessionLoad(prices, ttl_s=900.0)
    load.placed("s", "m", "a", 0.3, 310, now=0.0)
    load.completed("s", "m", "a", 300, 20, 20, now=1.0)
    load.arrived("s", "m", prompt_tokens=820, now=1.5)  # the tool result and template added 500 tokens
    load.placed("s", "m", "a", 0.5, 840, now=1.5)
    load.completed("s", "m", "a", 820, 20, 20, now=3.0)
    assert prices.asked[-1] == ("a", "m", 840 + 500, 839, 20, 840 + 500)
    assert load.on("a").total_s == pytest.approx(0.001 * (500 + 1 + 20))
    # a new session of the model, after its first call, is predicted with the model's mean growth
    load.placed("t", "m", "a", 0.2, 210, now=3.0)
    load.completed("t", "m", "a", 200, 10, 10, now=4.0)
    assert prices.asked[-1][2] == 210 + 500


def test_prefixes_past_the_pool_are_priced_as_full_prefills():
    prices = Prices()
    load = SessionLoad(prices, ttl_s=900.0)
    for i, now in enumerate((0.0, 0.1)):
        load.placed(f"s{i}", "m", "a", 1.0, 6000, now=now)
    load.completed("s0", "m", "a", 5980, 20, 20, now=1.0)
    # its footprint counts the other session's prefix (6,000) and its own (6,000, not twice)
    assert prices.asked[-1][5] == 12_000
    assert load.on("a").total_s == pytest.approx(1.0 + 0.001 * (6000 + 20) * prior_second_call())


def test_a_session_goes_quiet_after_the_gap_estimate_and_a_quiet_one_charges_again_when_it_calls():
    load = SessionLoad(Prices(), ttl_s=900.0)
    load.placed("s", "m", "a", 0.3, 310, now=0.0)
    load.completed("s", "m", "a", 300, 20, 20, now=1.0)
    for t in (2.0, 3.0):  # two gaps of 1 s: srtt 1, rttvar 0.5 then 0.375: quiet after 2.5 s
        load.arrived("s", "m", 320, now=t)
        load.placed("s", "m", "a", 0.3, 340, now=t)
        load.completed("s", "m", "a", 320, 20, 20, now=t)
    assert load.quiet_s("m") == 2.5
    load.sweep(3.0 + 2.49)
    assert load.on("a").total_s > 0
    load.sweep(3.0 + 2.5)
    assert (load.on("a").total_s, load.on("a").kv, len(load)) == (0.0, {"m": 0}, 0)
    load.arrived("s", "m", 360, now=10.0)  # back after a long tool run: still admitted, charged once placed
    load.placed("s", "m", "a", 0.4, 380, now=10.0)
    assert load.on("a").total_s == pytest.approx(0.4)


def test_a_call_in_flight_never_goes_quiet_and_a_failed_call_keeps_its_charge_until_quiet():
    load = SessionLoad(Prices(), ttl_s=900.0)
    load.placed("s", "m", "a", 0.3, 310, now=0.0)
    load.sweep(10 * QUIET_FIRST_S)
    assert load.on("a").total_s == pytest.approx(0.3)
    load.failed("s", "m", now=100.0)
    load.sweep(100.0 + QUIET_FIRST_S - 0.01)
    assert load.on("a").total_s == pytest.approx(0.3)
    load.sweep(100.0 + QUIET_FIRST_S)
    assert load.on("a").total_s == 0.0


def test_a_session_served_elsewhere_moves_its_charge():
    load = SessionLoad(Prices(), ttl_s=900.0)
    load.placed("s", "m", "a", 0.3, 310, now=0.0)
    load.completed("s", "m", "a", 300, 10, 10, now=1.0)
    load.arrived("s", "m", 400, now=2.0)
    load.placed("s", "m", "b", 0.5, 410, now=2.0)
    assert (load.on("a").total_s, load.on("b").total_s) == (0.0, pytest.approx(0.5))
    assert (load.on("a").kv, load.on("b").kv) == ({"m": 0}, {"m": 410})


def test_the_gap_estimate_is_rfc_6298s_floored_and_quiet_never_outlasts_the_session_ttl():
    gaps = GapEstimate()
    assert gaps.quiet_s == QUIET_FIRST_S
    gaps.sample(4.0)
    assert (gaps.srtt, gaps.rttvar, gaps.quiet_s) == (4.0, 2.0, 12.0)
    gaps.sample(2.0)
    assert (gaps.srtt, gaps.rttvar) == (pytest.approx(3.75), pytest.approx(2.0))
    short = GapEstimate()
    for _ in range(3):
        short.sample(0.2)  # srtt 0.2, rttvar 0.1 then shrinking: 0.6 s, but never quiet before QUIET_MIN_S
    assert short.quiet_s == QUIET_MIN_S
    assert SessionLoad(Prices(), ttl_s=5.0).quiet_s("m") == 5.0


def test_each_model_learns_its_own_turns_and_session_lengths():
    """A cold model's calls wait for its slot: its sessions turn every 20 s, a hot model's every 2 s,
    and they make 4 calls and 2. A new session of each is expected to last by its own model's."""
    load = SessionLoad(Prices(), ttl_s=900.0)
    for model, turn, calls in (("hot", 2.0, 2), ("cold", 20.0, 4)):
        for c in range(calls):
            if c:
                load.arrived(model, model, 320, now=c * turn)
            load.placed(model, model, "a", 0.3, 340, now=c * turn)
            load.completed(model, model, "a", 320, 20, 20, now=c * turn + 0.5)
    load.sweep(1000.0)
    assert (load.lengths("hot").turn_s, load.lengths("cold").turn_s) == (2.0, pytest.approx(20.0))
    assert (len(load.lengths("hot")), len(load.lengths("cold"))) == (1, 1)
    assert load.lifetime_s(0.5, "hot") == pytest.approx(0.5 + 1 * 2.0 + load.quiet_s("hot"))
    assert load.lifetime_s(0.5, "cold") == pytest.approx(0.5 + 3 * 20.0 + load.quiet_s("cold"))
    assert load.telemetry()["hot"] == {"sessions_seen": 1, "mean_calls": 2.0, "p95_calls": 2, "turn_s": 2.0}


def test_one_call_sessions_are_learned_and_charge_nothing_after_their_call():
    """A client that calls once (a script, an SDK without a session id) never shows a tool gap, so
    it stays charged for QUIET_FIRST_S. Once the model's sessions are seen ending after one call,
    a first call's gap is charged by the share that made a second; a session that has made two is
    charged in full whatever the lengths seen."""
    prices = Prices()
    load = SessionLoad(prices, ttl_s=900.0)
    for i in range(3):  # three one-call sessions, then a two-call one
        load.placed(f"one{i}", "m", "a", 0.1, 110, now=0.0)
        load.completed(f"one{i}", "m", "a", 100, 10, 10, now=1.0)
    load.placed("two", "m", "a", 0.1, 110, now=0.0)
    load.completed("two", "m", "a", 100, 10, 10, now=1.0)
    load.arrived("two", "m", 300, now=2.0)
    load.placed("two", "m", "a", 0.3, 310, now=2.0)
    load.completed("two", "m", "a", 300, 10, 10, now=3.0)
    load.sweep(100.0)
    assert load.lengths("m").second_call() == pytest.approx(1 / 4) and load.on("a").total_s == 0.0
    load.placed("new", "m", "a", 0.1, 110, now=100.0)
    load.completed("new", "m", "a", 100, 10, 10, now=101.0)
    assert prices.said[-1] > 0 and load.on("a").total_s == pytest.approx(prices.said[-1] / 4)
    load.arrived("new", "m", 300, now=102.0)  # it came back: an agent loop, its next call charged in full
    load.placed("new", "m", "a", 0.3, 310, now=102.0)
    load.completed("new", "m", "a", 300, 10, 10, now=103.0)
    assert load.on("a").total_s == pytest.approx(prices.said[-1])
    assert prices.asked[-1][2] > 300  # (priced from its own turn's growth)


def test_a_new_session_is_admitted_against_the_models_next_calls_when_they_are_longer():
    """An agent's first call is its task (100 tokens); its next ones carry tool results (500 tokens
    here). What a newcomer is admitted against is the longer of its own prefill and the next calls
    the model's sessions came back with here, learned only from sessions whose own turn was measured."""
    load = SessionLoad(Prices(), ttl_s=900.0)
    load.placed("s", "m", "a", 0.12, 120, now=0.0)
    load.completed("s", "m", "a", 100, 20, 20, now=1.0)
    assert load.on("a").admit_x("m", 0.1) == 0.1  # no turn measured yet: its own prefill
    for t, prompt in ((2.0, 620), (4.0, 1140)):  # each turn adds 500 tokens
        load.arrived("s", "m", prompt, now=t)
        load.placed("s", "m", "a", 0.52, prompt + 20, now=t)
        load.completed("s", "m", "a", prompt, 20, 20, now=t + 1.0)
    assert load.on("a").nxt == {"m": pytest.approx(0.001 * 501)}  # the next prompt's 500 new tokens and the reply's last
    assert load.on("a").admit_x("m", 0.1) == pytest.approx(0.501)
    assert load.on("a").admit_x("m", 2.0) == 2.0 and load.on("b").admit_x("m", 0.1) == 0.1


def test_a_call_is_held_back_by_each_admitted_session_at_most_by_its_own_prefill():
    """Processor sharing: a 0.5 s prefill behind calls of 0.2 s, 3 s and 40 s (a long decode) waits
    0.2 + 0.5 + 0.5, not 43.2 s."""
    load = InstanceLoad()
    load.work.update({("a", "m"): 0.2, ("b", "m"): 3.0, ("c", "m"): 40.0})
    assert load.ahead_s(0.5) == pytest.approx(1.2)
    assert load.total_s == pytest.approx(43.2)


def test_first_tokens_later_than_predicted_admit_fewer_and_sooner_ones_no_more_than_the_bound():
    """The scale learns measured over predicted starts (gain ALPHA, each ratio within SCALE_BOUNDS): slow
    starts stretch what the admitted sessions hold a newcomer back by; fast ones never shrink it below the
    processor-sharing bound, whose tail is what admitted calls live through."""
    load = InstanceLoad()
    load.work.update({("a", "m"): 0.2, ("b", "m"): 3.0})
    load.observe_start(1.0, 3.0)
    assert load.scale == pytest.approx((1 - ALPHA) + ALPHA * 3.0) and load.samples == 1
    for _ in range(50):
        load.observe_start(1.0, 0.1)  # ten times sooner than predicted, again and again
    assert SCALE_BOUNDS[0] == 1.0 and load.scale == pytest.approx(1.0, abs=1e-4)
    assert load.ahead_s(0.5) == pytest.approx(0.7, abs=1e-4)  # the bound itself
