"""`talaria.routing.costs` for sessions: a new session is charged the load of the sessions admitted
before it and must start within the TTFT target and leave their prefixes room; what one call of an
admitted session is priced at; the instance's measured cost scale; the resume rule for a model whose
cache keeps per-sequence state. Only the wait the others cause is held against a new session, never
its own prefill. Toy profile of the router tests
(prefill 1 ms per token; decode 10 ms a step, nothing per sequence), one cold instance whose rounds
last 10 s (round admission: 20 s), a pool of 1,000 pages of 16 tokens."""

from __future__ import annotations

import dataclasses

import pytest

from talaria.config.schema import ReplicaGain
from talaria.contracts.profile import DecodeCurve
from talaria.routing.costs import window_gain
from talaria.routing.decision import Reason, RouteRequest
from talaria.routing.session_load import InstanceLoad
from tests.routing.test_router import PROFILE, Clock, req, router, serve, snapshot

# model m with a state slot of 400 tokens' bytes: its snapshot restores in 0.1 s (a token in 0.25 ms)
STATEFUL = PROFILE.with_model(dataclasses.replace(PROFILE.models["m"],
                                                  state_bytes=400 * PROFILE.models["m"].token_bytes))


def new(prompt: int = 500, session: str = "new") -> RouteRequest:
    return RouteRequest("m", session, prompt, 1, "r", new_session=True)


def one(*works: float, ttft_s: float | None = 2.0, **snap):
    """A router over one instance "a" whose admitted sessions' calls are predicted at `works` seconds."""
    r, _ = router(("a", snapshot("a", **snap)), clock=Clock())
    view = r.views["a"]
    view.ttft_s, view.load = ttft_s, InstanceLoad()
    view.load.work.update({(f"s{i}", "m"): w for i, w in enumerate(works)})
    return r, view


def test_a_new_session_is_held_back_by_the_admitted_sessions_within_the_ttft_target():
    r, view = one(0.3, 0.4, 30.0)  # its 0.5 s prefill waits 0.3 + 0.4 + 0.5 (a long decode: a prefill's worth)
    d = r.route(new())
    assert (d.instance, d.cost.queue_s, d.cost.start_s) == ("a", pytest.approx(1.2), pytest.approx(1.7))
    view.load.work[("s3", "m")] = 2.0  # two more sessions, in their tool gaps: others hold it back 2.2 s
    view.load.work[("s4", "m")] = 2.0
    d = r.route(new())
    assert (d.instance, d.reason) == (None, Reason.OVERLOAD)
    assert d.cost.instance == "a" and d.wait_s == pytest.approx(0.2)
    returning = RouteRequest("m", "old", 500, 1, "r")  # an admitted session's call: round admission only
    assert r.route(returning).instance == "a"


def test_a_new_session_is_charged_the_larger_of_the_snapshot_queue_and_the_session_load():
    r, _ = one(0.3, waiting=1)  # one call of the mean prompt (500 tokens) waits: 0.5 s
    assert r.route(new()).cost.queue_s == pytest.approx(0.5)


def test_without_a_ttft_target_a_new_session_gets_the_round_admission_bound():
    r, _ = one(*[1.0] * 30, ttft_s=None)  # a peer's instance: its target is not known here
    assert r.route(new()).instance == "a"  # 15 s of others' work, within two rounds of 10 s
    r, _ = one(*[1.0] * 41, ttft_s=None)  # 20.5 s of others' work
    assert r.route(new()).wait_s == pytest.approx(0.5)


def test_a_new_session_leaves_the_admitted_sessions_prefixes_room_in_the_pool():
    r, view = one(0.5)
    view.load.kv["m"] = 16_000 - 501  # 1,000 pages of 16 tokens; it needs 500 + 1
    assert r.route(new()).instance == "a"
    view.load.kv["m"] = 16_000 - 500
    assert r.route(new()).instance is None
    assert r.route(RouteRequest("m", "old", 500, 1, "r")).instance == "a"  # the HBM check alone
    view.load.work.clear()  # nothing ahead of it: not refused for its own size
    assert r.route(new()).instance == "a"


def test_prices_are_scaled_by_what_the_instance_measured():
    r, _ = router(("a", dataclasses.replace(snapshot("a"), cost_scale={"m/prefill": 2.0, "m/decode": 3.0})),
                  clock=Clock())
    cost = r.route(RouteRequest("m", "s", 500, 1, "r")).cost
    assert (cost.prefill_s, cost.decode_s) == (pytest.approx(1.0), pytest.approx(0.03))


def test_a_call_of_an_admitted_session_is_priced_at_its_prefill_and_its_share_of_decode_steps():
    r, view = one()
    m = PROFILE.models["m"]
    view.profile = PROFILE.with_model(dataclasses.replace(m, decode=DecodeCurve(0.01, 0.002, 1e-5)))
    view.terms = {}
    # 100 tokens past a 900-token prefix: 0.1 s; 10 steps of 2 ms + 1e-5 * 1000 (the 10 ms base is shared)
    assert r.costs.work_s(view, "m", 1000, 900, 10) == pytest.approx(0.1 + 10 * 0.012)
    # the admitted sessions' prefixes outgrow the pool (16,000 tokens): they cannot all stay, recompute
    assert r.costs.work_s(view, "m", 1000, 900, 10, footprint_tokens=16_001) == pytest.approx(1.0 + 10 * 0.012)
    view.snapshot = dataclasses.replace(view.snapshot, cost_scale={"m/prefill": 2.0})
    view.terms = {}
    assert r.costs.work_s(view, "m", 1000, 900, 10) == pytest.approx(0.2 + 10 * 0.012)
    assert r.costs.work_s(view, "unknown-model", 1000, 900, 10) is None


def test_on_a_cold_instance_new_sessions_of_the_active_and_the_waiting_model_are_admitted_alike():
    """The rest of the open round is where the round happens to be when a call arrives, not load:
    the model whose slot is open must not take every new session of a burst."""
    r, view = one(*[0.25] * 5)
    view.snapshot = dataclasses.replace(view.snapshot, rounds=dataclasses.replace(view.snapshot.rounds,
                                                                                  round_remaining_s=1.5))
    view.terms = {}
    active, waiting = new(), RouteRequest("n", "new-n", 500, 1, "r", new_session=True)
    assert r.route(active).cost.queue_s == r.route(waiting).cost.queue_s == pytest.approx(1.25)
    assert r.route(RouteRequest("n", "old", 500, 1, "r")).cost.queue_s == pytest.approx(1.5)  # a call waits


@pytest.mark.parametrize(("saving", "per_call", "calls", "gain"), [
    (5.0, 1.0, 1.0, 5.0),  # a window of this call alone: its saving
    (5.0, 1.0, 10.0, 5.0 + 3.0 + 1.0),  # it takes calls while they save: 5, 3, 1 (the next would save -1)
    (5.0, 1.0, 2.5, 5.0 + 3.0),  # ... but no more than the window brings
    (-1.0, 1.0, 10.0, -1.0),  # no saving for the first: none for the rest
    (5.0, 0.0, 3.0, 15.0),  # free calls: each saves the same
])
def test_window_gain_counts_what_each_call_the_replica_would_take_saves(saving, per_call, calls, gain):
    assert window_gain(saving, per_call, calls) == pytest.approx(gain)


@pytest.mark.parametrize(("replica_gain", "expected"), [(ReplicaGain.CALL, "a"), (ReplicaGain.WINDOW, "b")])
def test_a_control_window_of_arrivals_can_pay_for_a_replica_one_call_cannot(replica_gain, expected):
    """a holds m, not active, with 2 calls queued and rounds of 10 s; b would open m. One call saves 4 s
    (a's queue of 2 s and its open of 2 s), short of b's T_swap 2 s + nu 3 s; with a call every 2 s,
    the 20 s admission window (2 rounds) brings 10, of which the replica would take 3 (saving 4, 2
    and 0 s: 6 s > 5 s)."""
    clock = Clock()
    r, _ = router(("a", snapshot("a", active="n", waiting=2, busy=("m",))), ("b", snapshot("b", active="n")),
                  clock=clock, replica_penalty_s=3.0, admit_rounds=2.0, replica_gain=replica_gain)
    for _ in range(5):  # arrivals of m every 2 s, placed and forgotten (no session: no leases)
        r.arrived(RouteRequest("m", None, 1000, 1, "x"))
        clock.now += 2.0
    r.observe("a", snapshot("a", active="n", waiting=2, busy=("m",), version=2))
    r.observe("b", snapshot("b", active="n", version=2))
    assert r.route(RouteRequest("m", None, 1000, 1, "r")).instance == expected


@pytest.mark.parametrize(("location", "c_kv"), [("host", 2000 * 0.00025 + 0.1), ("device", 0.0)])
def test_a_stateful_session_resumes_at_its_last_full_page_and_restores_its_state_with_its_pages(location, c_kv):
    """The session kept 2,010 tokens; its state was snapshotted at page 125 (2,000 tokens), so its
    next call of 2,100 reuses 2,000 and prefills 100. From host: 2,000 tokens' pages and the state."""
    clock = Clock()
    r, _ = router(("a", snapshot("a")), clock=clock, lease_s=0.0)
    r.views["a"].profile = STATEFUL
    serve(r, req(prompt=2010), clock)
    clock.now += 0.1  # a snapshot taken after the call completed
    r.observe("a", snapshot("a", version=2, sessions=[{"session": "s", "model": "m", "location": location,
                                                       "kv_tokens": 2010}]))
    cost = r.route(req(prompt=2100)).cost
    assert (cost.kv, cost.c_kv_s, cost.prefill_s) == (location, pytest.approx(c_kv, rel=1e-12),
                                                     pytest.approx(100 * 0.001, rel=1e-12))
    r.views["a"].profile = PROFILE  # attention KV alone resumes at any token: 2,010 restored, 90 prefilled
    r.views["a"].terms = {}
    cost = r.route(req(prompt=2100)).cost
    assert (cost.c_kv_s, cost.prefill_s) == (pytest.approx(2010 * 0.00025 if location == "host" else 0.0),
                                             pytest.approx(90 * 0.001))


def test_an_admitted_stateful_session_is_priced_from_its_snapshot_not_from_its_last_token():
    r, view = one()
    view.profile, view.terms = STATEFUL, {}
    # 990 kept tokens: the snapshot after page 61 (976 tokens); the other 24 are prefilled again
    assert r.costs.work_s(view, "m", 1000, 990, 0) == pytest.approx(24 * 0.001)
    # a prompt shorter than the kept prefix reuses less than its snapshot: the state starts from zeros
    assert r.costs.work_s(view, "m", 500, 990, 0) == pytest.approx(500 * 0.001)
    view.profile, view.terms = PROFILE, {}
    assert r.costs.work_s(view, "m", 1000, 990, 0) == pytest.approx(10 * 0.001)
