"""`talaria.routing.admission_line`: the line of new sessions, its order and fairness, its bound,
and the Retry-After it promises against when admission actually happens, on an injected clock.

The dispatcher tests drive the gateway's `Dispatcher` over the echo fake with the router tests' toy
profile (prefill 1 ms a token, decode's per-sequence cost 0): a call's predicted work is its prefill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from statistics import NormalDist

import pytest

from talaria.contracts.call import InstanceReady, Usage
from talaria.routing.admission_line import (
    CONTROL_INTERVAL_S,
    GRACE_S,
    AdmissionLine,
    promise_times,
)
from talaria.routing.decision import RouteRequest
from talaria.routing.errors import Overloaded
from talaria.routing.session_lengths import (
    PAPER_DEPTH,
    SessionLengths,
    prior_remaining_calls,
    prior_second_call,
)
from tests.gateway.fakes import MODEL, FakeEchoGroup
from tests.routing.test_dispatcher import PROFILE_ECHO, Clock, dispatcher, place
from tests.routing.test_router import snapshot

# ---- the pure parts ------------------------------------------------------------------------------


def test_promises_walk_the_departures_and_each_admission_adds_its_charge():
    # 2 s past the bound now; four sessions leave at 10, 11, 12, 13, each freeing 1 s of queue
    departures = [(13.0, 1.0), (10.0, 1.0), (12.0, 1.0), (11.0, 1.0)]
    times = promise_times(0.0, 2.0, departures, [1.0, 1.0, 0.5, 1.0], lifetime_s=100.0)
    # the head after two leave; each later one after one more (its predecessor took 1 s back); the
    # fourth once the first admitted leaves again, `lifetime_s` after it came in
    assert times == [11.0, 12.0, 13.0, 111.0]
    # nothing past the bound: the head now; those admitted leave `lifetime_s` later and make room again
    assert promise_times(5.0, 0.0, [], [1.0, 1.0], lifetime_s=30.0) == [5.0, 35.0]
    assert promise_times(0.0, 3.0, [(1.0, 1.0)], [1.0], 30.0) == [math.inf]  # no departure can make room
    # room left (the head would be in with 1.5 s to spare): the next one fits in it too, the third does not
    assert promise_times(5.0, -1.5, [], [1.0, 1.0, 1.0], lifetime_s=30.0) == [5.0, 5.0, 35.0]
    assert promise_times(0.0, 2.0, departures, [1.0], 100.0, scale=1.5) == [16.5]  # every wait stretched


def test_session_lengths_expect_the_calls_left_from_the_sessions_seen_ending():
    lengths = SessionLengths()
    assert lengths.remaining_calls(3) == prior_remaining_calls(3)  # none seen: the paper's agent sessions
    for n in (2, 4, 6, 6):
        lengths.ended(n)
    assert lengths.remaining_calls(1) == pytest.approx((1 + 3 + 5 + 5) / 4)
    assert lengths.remaining_calls(4) == pytest.approx((0 + 2 + 2) / 3)  # those that made 4 or more
    assert lengths.remaining_calls(7) == 7.0  # longer than any seen
    lengths.turn(2.0)
    lengths.turn(4.0)
    assert lengths.turn_s == pytest.approx(0.8 * 2.0 + 0.2 * 4.0)


def test_before_any_session_ends_the_calls_left_are_the_papers_agent_sessions():
    """E[L - k | L >= k] over a lognormal with the paper's median and p95 depth (11, 49 calls), in
    closed form, against the same mean over 100,000 of the distribution's quantiles."""
    p50, p95 = PAPER_DEPTH
    sigma = math.log(p95 / p50) / NormalDist().inv_cdf(0.95)
    grid = [p50 * math.exp(sigma * NormalDist().inv_cdf((i + 0.5) / 100_000)) for i in range(100_000)]
    for k in (1, 3, 11, 49):
        tail = [x for x in grid if x >= k]
        assert prior_remaining_calls(k) == pytest.approx(sum(tail) / len(tail) - k, rel=5e-3)
    assert prior_second_call() == pytest.approx(sum(x >= 2 for x in grid) / len(grid), rel=1e-4)  # 0.97


def test_the_line_is_in_arrival_order_one_session_of_each_tenant_per_round():
    line = AdmissionLine(limit=6)
    for i in range(3):
        line.join(f"a{i}", "team-a", MODEL, 100, 4, float(i))
    line.join("b0", "team-b", MODEL, 100, 4, 3.0)
    line.join("b1", "team-b", MODEL, 100, 4, 4.0)
    assert [w.session for w in line.order(MODEL)] == ["a0", "b0", "a1", "b1", "a2"]
    line.admitted(line.get("a0"), 5.0)
    line.admitted(line.get("b0"), 5.0)
    line.admitted(line.get("a1"), 5.0)  # the line is serving round 1 now
    line.join("c0", "team-c", MODEL, 100, 4, 6.0)  # a tenant new to the line is not put before round 1
    line.join("a3", "team-a", MODEL, 100, 4, 7.0)
    assert [w.session for w in line.order(MODEL)] == ["b1", "c0", "a2", "a3"]
    assert line.join("x", "team-x", MODEL, 100, 4, 8.0) is not None
    assert line.join("y", "team-y", MODEL, 100, 4, 8.0) is not None
    assert line.join("z", "team-z", MODEL, 100, 4, 8.0) is None  # bounded: 6 wait
    assert line.counts["full"] == 1


def test_only_the_due_or_the_first_may_ask_and_a_client_not_back_loses_its_place():
    line = AdmissionLine(limit=10)
    first = line.join("s1", "t", MODEL, 100, 4, 0.0)
    second = line.join("s2", "t", MODEL, 100, 4, 0.0)
    line.promise(first, [10.0, 20.0], 0.0)
    line.promise(second, [10.0, 20.0], 0.0)
    assert not line.may_try(None, MODEL, 15.0)  # a newcomer waits while anyone does
    assert line.may_try(None, "other-model", 15.0)  # lines are per model
    assert line.may_try(first, MODEL, 1.0)  # first in line: it may ask early (room may have come early)
    assert not line.may_try(second, MODEL, 20.0 - 2 * CONTROL_INTERVAL_S)
    assert line.may_try(second, MODEL, 20.0 - CONTROL_INTERVAL_S)  # due, within one control interval
    # a promise is never before one already made to a session ahead of it
    third = line.join("s3", "t", MODEL, 100, 4, 1.0)
    assert line.promise(third, [5.0, 6.0, 7.0], 1.0) == 20.0
    assert line.expire(10.0 + GRACE_S) == []
    assert [w.session for w in line.expire(10.0 + GRACE_S + 0.01)] == ["s1"]
    assert line.counts["expired"] == 1


def test_a_promise_found_late_or_early_corrects_the_next_ones():
    line = AdmissionLine(limit=10)
    w = line.join("s1", "t", MODEL, 100, 4, 0.0)
    line.promise(w, [10.0], 0.0)
    line.ready(w, 20.0)  # the wait was twice the promise: every later wait is stretched towards 2x
    assert line.scale(MODEL) == pytest.approx(0.8 + 0.2 * 2.0) and line.scale("other") == 1.0
    assert line.telemetry(20.0)["promise_error_s"]["p50"] == pytest.approx(10.0)


# ---- the dispatcher keeps the line -----------------------------------------------------------------


class Node:
    """One echo instance (TTFT target 2 s) under the injected clock, sessions served by hand."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.clock = Clock()
        self.group = FakeEchoGroup("hot0")
        self.versions = iter(range(1, 10_000))
        self.fresh()
        self.d, self.node = dispatcher(self.group, clock=self.clock, lease_s=0.0, admit_rounds=0.2,
                                       line_hold_s=hold_s)  # 0: every new session not admitted gets its 429

    def fresh(self) -> None:
        """A snapshot taken now: an idle instance (the load is the admitted sessions')."""
        self.group.ready = InstanceReady(self.group.name, (MODEL,), 100, 0.1, profile=PROFILE_ECHO)
        self.group.stats = dataclasses.replace(snapshot(self.group.name, active=MODEL, version=next(self.versions)),
                                               time=self.clock.now)

    def call(self, session: str, prompt: int, tenant: str = "default") -> RouteRequest:
        return RouteRequest(MODEL, session, prompt, 4, f"{session}@{prompt}", tenant)

    def serve(self, session: str, prompt: int) -> None:
        """The session's call is placed and finishes at once."""
        self.fresh()
        self.d.finished(place(self.d, self.call(session, prompt)), Usage(prompt, 4, 0), None, ())

    def ask(self, session: str, prompt: int = 1000, tenant: str = "default") -> float | None:
        """A new session's first call: None when it is placed (and left running), else the promise it
        was given (now + retry-after-ms)."""
        self.fresh()
        try:
            place(self.d, self.call(session, prompt, tenant))
            return None
        except Overloaded as e:
            assert e.retry_after_s == max(1, math.ceil(e.retry_after_ms / 1000))
            return self.clock.now + e.retry_after_ms / 1000

    def at(self, t: float) -> None:
        self.clock.now = t
        self.fresh()
        self.d.sync()
        self.d.pump()  # a control interval: quiet sessions leave, the line's heads are checked


def two_call_sessions(n: Node, names: list[str], stagger_s: float) -> None:
    """Sessions of two calls (100 tokens, then 1,604: the tool result added 1,500), 1.5 s apart, the
    sessions `stagger_s` apart; each then charges its next call, 1,501 tokens past its prefix (1.501 s)."""
    start = n.clock.now
    for i, s in enumerate(names):
        n.clock.now = start + i * stagger_s
        n.serve(s, 100)
    for i, s in enumerate(names):  # every tool gap 1.5 s
        n.clock.now = start + 1.5 + i * stagger_s
        n.serve(s, 1604)


def sessions_in_tool_gaps(n: Node, names: list[str], stagger_s: float) -> None:
    """`two_call_sessions`, told to the admitted sessions' load directly, as the gateway tells it of
    sessions it admitted before anything was known of their next calls (once the model's next calls
    are known, the dispatcher admits only as many as those fit: two, of 1.5 s, under a 2 s target)."""
    load, start = n.d.load, n.clock.now
    for i, s in enumerate(names):
        load.placed(s, MODEL, "hot0", 0.104, 104, start + i * stagger_s)
        load.completed(s, MODEL, "hot0", 100, 4, 4, start + i * stagger_s)
    for i, s in enumerate(names):  # every tool gap 1.5 s
        n.clock.now = start + 1.5 + i * stagger_s
        load.arrived(s, MODEL, 1604, n.clock.now)
        load.placed(s, MODEL, "hot0", 1.608, 1608, n.clock.now)
        load.completed(s, MODEL, "hot0", 1604, 4, 4, n.clock.now)


def test_retry_after_is_kept_the_client_that_returns_then_is_admitted_and_not_a_moment_before():
    """Sessions seen so far made two calls each: four admitted sessions in their tool gaps, with two
    calls made, are expected to make none more and leave when they go quiet. A new session's first
    call needs 1 s of prefill, but it is admitted against the model's next call here, 1.501 s (an
    agent's later calls carry tool results, and each admitted session's next call waits behind it
    as it waits behind them): 4 x 1.501 s behind them, 4 s past the 2 s target. It is promised the
    third departure; the next newcomer, behind it, the fourth (the first's own call, 1.04 s, takes
    some room back). Each client that comes back when told is admitted then, within one control
    interval, and not one interval before; a newcomer that finds room meanwhile waits behind them."""
    n = Node()
    two_call_sessions(n, ["w0", "w1", "w2", "w3"], 0.0)  # sessions seen ending: two calls each
    n.at(n.clock.now + 30.0)
    assert len(n.d.load.lengths(MODEL)) == 4 and n.d.load.lengths(MODEL).remaining_calls(2) == 0.0
    sessions_in_tool_gaps(n, ["s0", "s1", "s2", "s3"], 0.3)
    quiet = sorted(n.d.load._sessions[(s, MODEL)].quiet_at for s in ("s0", "s1", "s2", "s3"))
    assert len(quiet) == 4 and quiet[0] < quiet[1] < quiet[2] < quiet[3]
    assert n.d.load.on("hot0").admit_x(MODEL, 1.0) == pytest.approx(1.501)
    promised = [n.ask("new0"), n.ask("new1")]
    assert promised == pytest.approx(quiet[2:], abs=1e-3)
    assert [w.session for w in n.d.line.order(MODEL)] == ["new0", "new1"]
    for i, t in enumerate(promised):
        n.at(t - 2 * CONTROL_INTERVAL_S)
        assert n.ask(f"new{i}") is not None  # too early: no room yet, and it keeps its place
        assert [w.session for w in n.d.line.order(MODEL)][0] == f"new{i}"
        n.at(t)
        assert n.ask("latecomer") is not None  # room, but promised to the line: a later arrival waits
        assert n.ask(f"new{i}") is None  # back when told: admitted
    line = n.d.line.telemetry(n.clock.now)
    assert line["counts"]["admitted"] == 2 and line["promise_error_s"]["p95"] <= CONTROL_INTERVAL_S
    assert [w.session for w in n.d.line.order(MODEL)] == ["latecomer"]


def test_a_promise_off_by_seconds_is_measured_and_corrects_the_next_ones():
    """Sessions seen so far made two calls each. Three admitted sessions predicted to be done call
    again (3.1 s of work each) before the head of the line comes back: it is refused and told a new
    time. Having made three calls, more than any session seen, each is expected (Lindy) to make three
    more; but they end after this one, 6 s in: the first control interval at which an instance would
    admit the head is seconds before its promise, measured as the promise's error, and the line's
    scale shrinks, so later promises are shorter than the bare prediction."""
    n = Node()
    two_call_sessions(n, ["w0", "w1"], 0.0)
    n.at(n.clock.now + 30.0)
    sessions_in_tool_gaps(n, ["s0", "s1", "s2", "s3"], 0.0)
    t = n.ask("new0")
    t0 = n.clock.now
    for s in ("s0", "s1", "s2"):  # a session predicted to be done calls again: it stays
        n.d.load.arrived(s, MODEL, 3105, t0)
        n.d.load.placed(s, MODEL, "hot0", 3.105, 3108, t0)
    n.at(t)
    p = n.ask("new0")
    head = n.d.line.get("new0")
    assert p > t + 2.0 and head.returns == 1 and head.ready_at is None
    for s in ("s0", "s1", "s2"):
        n.d.load.completed(s, MODEL, "hot0", 3105, 4, 4, t0 + 6.0)
    while head.ready_at is None and n.clock.now < p + GRACE_S:
        n.at(n.clock.now + CONTROL_INTERVAL_S)
    assert head.ready_at is not None and head.ready_at < p - 1.0
    error = n.d.telemetry()["line"]["promise_error_s"]
    assert error["samples"] == 1 and error["mean_signed"] == pytest.approx(head.ready_at - head.promised_at)
    assert n.d.line.scale(MODEL) < 1.0
    assert n.ask("new0") is None  # it comes back early, first in line, and there is room: admitted


def test_a_session_whose_turn_is_near_is_held_and_placed_when_due_else_told_a_new_time():
    """With line_hold_s 30, three newcomers of the first test ask 0.9 s before the fourth departure.
    The hold is part of a call's time to first token: it may last only as long as that still fits
    1.5 TTFT targets (here 1.5 x 2 s, less the 2 s it may then wait behind the admitted: 1 s). The
    first, due at the third departure, is held rather than sent a 429, and placed at the first
    control interval at which it is due and an instance admits it, not before. The second, due at the
    fourth, is held too; when the session ahead of it calls again instead of leaving, it is sent its
    429 once held 1 s, with a new promise, and keeps its place. The third, due once the first leaves
    again, gets its 429 at once."""
    n = Node(hold_s=30.0)
    two_call_sessions(n, ["w0", "w1", "w2", "w3"], 0.0)
    n.at(n.clock.now + 30.0)
    sessions_in_tool_gaps(n, ["s0", "s1", "s2", "s3"], 0.3)
    quiet = sorted(n.d.load._sessions[(s, MODEL)].quiet_at for s in ("s0", "s1", "s2", "s3"))
    n.at(quiet[3] - 0.9)
    asked = n.clock.now

    async def scenario() -> None:
        first = asyncio.create_task(n.d.place(n.call("new0", 1000), (), False, True, ()))
        await asyncio.sleep(0)
        second = asyncio.create_task(n.d.place(n.call("new1", 1000), (), False, True, ()))
        await asyncio.sleep(0)
        assert [w.session for w in n.d.line.order(MODEL)] == ["new0", "new1"]
        assert n.d.line.get("new0").promised_at == pytest.approx(quiet[2])
        assert n.d.line.get("new1").promised_at == pytest.approx(quiet[3])
        with pytest.raises(Overloaded, match="number 3 in line") as third:
            await asyncio.wait_for(n.d.place(n.call("new2", 1000), (), False, True, ()), 5.0)
        assert third.value.retry_after_ms > 1000
        n.at(quiet[2] - 2 * CONTROL_INTERVAL_S)
        await asyncio.sleep(0)
        assert not first.done()
        n.at(quiet[2])
        await asyncio.sleep(0)
        assert first.done() and first.result().group is n.group  # placed when due
        n.d.load.arrived("s3", MODEL, 3105, n.clock.now)  # it calls again instead of leaving: no room for new1
        n.at(asked + 1.0 - CONTROL_INTERVAL_S)
        await asyncio.sleep(0)
        assert not second.done()
        n.at(asked + 1.0)
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="number 1 in line") as refused:
            await second
        assert refused.value.retry_after_ms > 0 and n.d.line.get("new1").returns == 1
    asyncio.run(scenario())
    assert n.d.line.counts["admitted"] == 1


def test_the_head_of_the_line_back_when_told_is_held_no_longer_than_its_first_token_allows():
    """The head of the line comes back at its promise, but the session predicted to leave then called
    once more instead; the next departure is near, and it is held as any newcomer near its turn is.
    That session does not leave either. The head is held as long as its first token can still come
    within 1.5 TTFT targets (1 s here), not until the two have rested and gone quiet: its client
    counts the wait. Then it gets its 429 with a new promise, still first in line, and is admitted
    when it comes back then."""
    n = Node(hold_s=30.0)
    two_call_sessions(n, ["w0", "w1", "w2", "w3"], 0.0)
    n.at(n.clock.now + 30.0)
    sessions_in_tool_gaps(n, ["s0", "s1", "s2", "s3"], 0.3)
    quiet = sorted(n.d.load._sessions[(s, MODEL)].quiet_at for s in ("s0", "s1", "s2", "s3"))
    assert [n.ask("new0"), n.ask("new1")] == pytest.approx(quiet[2:], abs=1e-3)
    n.at(quiet[2] - 1.0)

    def calls_again(session: str) -> None:  # instead of leaving
        n.d.load.arrived(session, MODEL, 3105, n.clock.now)
        n.d.load.placed(session, MODEL, "hot0", 3.105, 3108, n.clock.now)

    calls_again("s2")

    async def scenario() -> float:
        n.at(quiet[2])
        head = asyncio.create_task(n.d.place(n.call("new0", 1000), (), False, True, ()))
        await asyncio.sleep(0)
        assert not head.done() and n.d.line.get("new0").held is not None  # in at s3's departure: held
        assert n.d.line.get("new0").hold_until - n.clock.now == pytest.approx(1.0)
        calls_again("s3")  # and then s3 does not leave either
        while not head.done() and n.clock.now < quiet[2] + 60.0:
            n.at(n.clock.now + CONTROL_INTERVAL_S)
            await asyncio.sleep(0)
        assert n.clock.now - quiet[2] == pytest.approx(1.0, abs=1.5 * CONTROL_INTERVAL_S)
        with pytest.raises(Overloaded, match="number 1 in line") as refused:
            await head
        return n.clock.now + refused.value.retry_after_ms / 1000
    again = asyncio.run(scenario())
    head = n.d.line.get("new0")
    assert head.returns == 2 and [w.session for w in n.d.line.order(MODEL)] == ["new0", "new1"]  # told twice
    for s in ("s2", "s3"):
        n.d.load.completed(s, MODEL, "hot0", 3105, 4, 4, n.clock.now)
    n.at(again)
    assert n.ask("new0") is None  # back when told the second time: admitted


def test_one_call_clients_are_learned_and_no_longer_reserve_what_they_never_use():
    """Clients that call once and go (scripts, SDKs without a session id), one a second for a minute,
    each coming back at its Retry-After when turned away. The model's one agent so far came back with
    1,500 tokens more (a 1.5 s call): while nothing says otherwise, a first call reserves such a next
    call until the session goes quiet, and two fill the node. Seen ending after one call, they reserve
    only the share that made a second: the line drains, and in the last 15 s every newcomer is
    admitted at its first call. (Were every first call charged in full, the node would admit two per
    quiet time while one arrives each second: the line would only grow.)"""
    n = Node()
    two_call_sessions(n, ["agent"], 0.0)
    n.at(n.clock.now + 30.0)
    start, due, tries = n.clock.now, {}, {}  # session -> when its client comes back; its calls so far
    for step in range(int(75 / CONTROL_INTERVAL_S)):
        n.at(start + step * CONTROL_INTERVAL_S)
        if step % int(1 / CONTROL_INTERVAL_S) == 0 and len(tries) < 60:
            due[f"one{len(tries)}"] = n.clock.now
            tries[f"one{len(tries)}"] = 0
        for session in [s for s, t in due.items() if t <= n.clock.now]:
            tries[session] += 1
            try:
                n.serve(session, 1000)
                del due[session]
            except Overloaded as e:
                due[session] = n.clock.now + e.retry_after_ms / 1000
    assert not due and len(n.d.line) == 0  # every client got in
    assert [tries[f"one{i}"] for i in range(45, 60)] == [1] * 15
    assert sum(t > 1 for t in tries.values()) >= 3  # the first ones waited: the node had learned nothing yet
    assert n.d.load.lengths(MODEL).second_call() < 0.1
