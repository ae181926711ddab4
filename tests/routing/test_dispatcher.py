"""`talaria.routing.dispatcher`: views kept current from the node's instances, sessions named,
the overload policy applied, completions turned into leases and remembered conversations.

The node is the gateway tests' in-process `FakeEchoSupervisor` (a `NodeHandle` with a real event
log); its instances carry the toy cost profile of the router tests when they are "ready".
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from talaria.config.schema import Overload, RouterConfig, RouterPolicy
from talaria.contracts.call import InstanceReady, Usage
from talaria.contracts.events import EventKind
from talaria.node.errors import InstanceUnavailable
from talaria.routing.decision import Reason, RouteRequest
from talaria.routing.dispatcher import Dispatcher
from talaria.routing.errors import Overloaded
from talaria.routing.session_lengths import prior_remaining_calls
from tests.gateway.fakes import MODEL, FakeEchoGroup, FakeEchoSupervisor
from tests.routing.test_router import PROFILE, snapshot

NOW = 50.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


PROFILE_ECHO = PROFILE.with_model(dataclasses.replace(PROFILE.models["m"], name=MODEL))


def ready(group: FakeEchoGroup, version: int = 1, waiting: int = 0) -> None:
    """What a started instance has: a ready message with its profile and a snapshot taken now."""
    group.ready = InstanceReady(group.name, (MODEL,), 100, 0.1, profile=PROFILE_ECHO)
    group.stats = dataclasses.replace(snapshot(group.name, active=MODEL, waiting=waiting, version=version), time=NOW)


def dispatcher(*groups: FakeEchoGroup, clock: Clock, **router) -> tuple[Dispatcher, FakeEchoSupervisor]:
    node = FakeEchoSupervisor(list(groups), router=RouterConfig(**{"policy": RouterPolicy.FULL, **router}))
    return Dispatcher(node, node.config.router, clock), node


def request(session: str | None = "s1", prompt_tokens: int = 40) -> RouteRequest:
    return RouteRequest(MODEL, session, prompt_tokens, 4, "r1")


def place(d: Dispatcher, req: RouteRequest, chain=(), inferred=False, chat=True):
    return asyncio.run(d.place(req, chain, inferred, chat, tuple(range(req.prompt_tokens))))


def test_sync_copies_health_load_profile_and_snapshot_into_the_views():
    clock = Clock()
    a, b = FakeEchoGroup("hot0"), FakeEchoGroup("hot1", healthy=False, in_flight=3)
    ready(a, version=7)
    d, _ = dispatcher(a, b, clock=clock)
    d.sync()
    va, vb = d.router.views["hot0"], d.router.views["hot1"]
    assert (va.healthy, va.profile, va.snapshot.version, va.models) == (True, PROFILE_ECHO, 7, (MODEL,))
    assert va.received_at == a.stats.time  # the instance's own clock dates its snapshot
    assert (vb.healthy, vb.in_flight, vb.profile, vb.snapshot) == (False, 3, None, None)


def test_a_call_goes_to_a_healthy_ready_instance_and_counts_as_sent():
    clock = Clock()
    a, b = FakeEchoGroup("hot0", healthy=False), FakeEchoGroup("hot1")
    ready(a)
    ready(b)
    d, node = dispatcher(a, b, clock=clock)
    placement = place(d, request())
    assert placement.group is b and placement.peer is None
    assert placement.decision.reason is Reason.RANKED
    assert d.router.views["hot1"].sent == 1
    routes = [e for e in node.events.since(0) if e.kind is EventKind.ROUTE]
    assert [(e.instance, e.data["target"], e.data["reason"]) for e in routes] == [("router", "hot1", "ranked")]


def test_no_healthy_instance_is_unavailable_and_a_full_one_is_overloaded():
    clock = Clock()
    down = FakeEchoGroup("hot0", healthy=False)
    d, _ = dispatcher(down, clock=clock)
    with pytest.raises(InstanceUnavailable, match=f"no healthy instance serves model {MODEL!r}"):
        place(d, request())
    busy = FakeEchoGroup("hot0")
    ready(busy, waiting=10_000)  # a queue no call could start behind within max_queue_s
    d, _ = dispatcher(busy, clock=clock)
    with pytest.raises(Overloaded, match="at capacity") as info:
        place(d, request())
    assert info.value.retry_after_s > 0


def test_a_queued_call_waits_until_an_instance_admits_it():
    clock = Clock()
    group = FakeEchoGroup("hot0")
    ready(group, waiting=10_000)
    d, _ = dispatcher(group, clock=clock, overload=Overload.QUEUE, queue_timeout_s=60.0)

    async def scenario():
        task = asyncio.create_task(d.place(request(), (), False, True, tuple(range(40))))
        await asyncio.sleep(0.12)  # a couple of polls, still full
        assert not task.done()
        ready(group, version=2)  # the queue drained
        return await task
    placement = asyncio.run(scenario())
    assert placement.group is group


def test_a_finished_call_leaves_a_lease_and_its_conversation_for_the_next_call():
    clock = Clock()
    group = FakeEchoGroup("hot0")
    ready(group)
    d, _ = dispatcher(group, clock=clock)
    messages = [{"role": "user", "content": "list the files"}]
    session, chain, inferred = d.session(MODEL, None, messages, ())
    assert inferred and session.startswith("auto-")
    placement = place(d, request(session), chain, inferred)
    d.finished(placement, Usage(40, 4, 0), {"role": "assistant", "content": "a.txt b.txt"}, (1, 2, 3, 4))
    lease = d.router.leases.get(session, MODEL)
    assert lease is not None and lease.instance == "hot0"
    assert d.router.views["hot0"].in_flight == 0
    follow_up = messages + [{"role": "assistant", "content": "a.txt b.txt"}, {"role": "user", "content": "read a.txt"}]
    assert d.session(MODEL, None, follow_up, ())[0] == session  # recognised by its conversation
    assert d.session(MODEL, "client-id", follow_up, ()) == ("client-id", (), False)  # the client's id wins
    again = place(d, request(session))
    assert again.decision.reason is Reason.LEASE_HIT


def test_a_failed_call_releases_its_slot_without_a_lease():
    clock = Clock()
    group = FakeEchoGroup("hot0")
    ready(group)
    d, _ = dispatcher(group, clock=clock)
    placement = place(d, request("s9"))
    d.finished(placement, None, None, ())
    assert d.router.leases.get("s9", MODEL) is None


def test_sessions_overload_holds_admitted_sessions_and_lines_up_new_ones_fairly():
    clock = Clock()
    group = FakeEchoGroup("hot0")
    ready(group)
    d, _ = dispatcher(group, clock=clock)  # overload = "sessions", the default

    def call(session: str, tenant: str) -> RouteRequest:
        return RouteRequest(MODEL, session, 40, 4, "r", tenant)

    for i in range(3):  # team-a's sessions are admitted while there is room
        place(d, call(f"a{i}", "team-a"))
        d.router.finished("hot0")
    versions = iter(range(2, 100))
    ready(group, version=next(versions), waiting=10_000)  # now full: no call is admitted

    async def held(req: RouteRequest) -> bool:
        """Whether the call waits for room (rather than being refused), then is placed once there is some."""
        task = asyncio.create_task(d.place(req, (), False, True, tuple(range(40))))
        await asyncio.sleep(0.12)
        if task.done():
            task.exception()
            return False
        ready(group, version=next(versions))  # room again
        await task
        d.router.finished("hot0")
        ready(group, version=next(versions), waiting=10_000)
        return True

    assert asyncio.run(held(call("a1", "team-a")))  # a session already admitted waits for room
    for session, tenant in (("a-new1", "team-a"), ("a-new2", "team-a"), ("a-new3", "team-a"), ("b-new", "team-b")):
        with pytest.raises(Overloaded, match="in line"):  # new sessions are never held: they take a place in line
            place(d, call(session, tenant))
    # team-b's one new session goes ahead of team-a's second and third: one of each tenant per round
    assert [w.session for w in d.line.order(MODEL)] == ["a-new1", "b-new", "a-new2", "a-new3"]
    assert not asyncio.run(held(call("a-new4", "team-a")))  # and a new session is not held, whatever its tenant


# ---- admission of new sessions against the admitted ones' load, and held calls oldest first --------


def test_sessions_in_tool_gaps_fill_the_instance_new_ones_are_shed_and_held_calls_go_oldest_first():
    """Four admitted sessions, all in tool gaps, whose next calls are predicted at 1.5 s each: the
    instance is idle, but a new session would share it with those four calls. It is admitted against
    the longer of its own prefill (1 s) and the model's next calls (1.5 s): they hold that back 6 s,
    past the 2 s TTFT target. It is shed with its place in line, while an admitted session's call
    goes straight in. Then with the instance full, two admitted sessions'
    calls are held; when there is room for one, the older is placed."""
    clock = Clock()
    group = FakeEchoGroup("hot0")  # ttft_s 2.0; round admission here: 0.2 rounds of 10 s
    versions = iter(range(1, 1000))

    def fresh(waiting: int = 0) -> None:
        group.ready = InstanceReady(group.name, (MODEL,), 100, 0.1, profile=PROFILE_ECHO)
        group.stats = dataclasses.replace(snapshot(group.name, active=MODEL, waiting=waiting, version=next(versions)),
                                          time=clock.now)

    fresh()
    d, node = dispatcher(group, clock=clock, lease_s=0.0, admit_rounds=0.2, line_hold_s=0.0)

    def call(session: str, prompt: int) -> RouteRequest:
        return RouteRequest(MODEL, session, prompt, 4, f"{session}@{prompt}")

    def serve(session: str, prompt: int) -> None:
        fresh()
        d.finished(place(d, call(session, prompt)), Usage(prompt, 4, 0), None, ())

    sessions = [f"s{i}" for i in range(4)]
    for s in sessions:
        serve(s, 100)
    clock.now += 1.5
    for s in sessions:  # the tool result added 1,500 tokens: so will the next turn, predicted from this one
        serve(s, 1604)
    clock.now += 1.0
    fresh()
    d.sync()
    assert d.router.views["hot0"].load.total_s == pytest.approx(4 * 1.501)  # 1,501 tokens past each prefix
    with pytest.raises(Overloaded, match="at capacity for new sessions") as shed:
        place(d, call("newcomer", 1000))
    # 4 x 1.501 s of theirs (its own prefill is not held against it), 2 s allowed: it waits for three to leave.
    # With no session seen ending, each is expected to make as many calls more as the paper's agent sessions
    # that made 2 (15.09), a turn (1.5 s) each, and then go quiet as it would now (srtt + 4 rttvar of the gaps
    # seen when it rested: 4.5, 3.75, 3.19 and 2.77 s): the third to leave at 51.5 + 1.5 * 15.09 + 3.75
    assert d.router.views["hot0"].load.admit_x(MODEL, 1.0) == pytest.approx(1.501)
    assert shed.value.retry_after_ms == pytest.approx((51.5 + 1.5 * prior_remaining_calls(2) + 3.75 - 52.5) * 1000,
                                                      abs=1)
    assert [w.session for w in d.line.order(MODEL)] == ["newcomer"]
    assert place(d, call("s0", 3108)).group is group  # an admitted session is not held for the load
    clock.now += 10.0  # they all went quiet: nothing ahead, and the newcomer gets in
    fresh()
    assert place(d, call("newcomer", 1000)).group is group

    async def scenario() -> list[str]:
        fresh(waiting=10_000)  # full: no call is admitted
        first = asyncio.create_task(d.place(call("s1", 3108), (), False, True, ()))
        await asyncio.sleep(0)
        second = asyncio.create_task(d.place(call("s2", 3108), (), False, True, ()))
        await asyncio.sleep(0)
        assert [c.req.session for c in d.held] == ["s1", "s2"]
        fresh()  # room for one call: the second would start 2 s out, behind the first
        d.pump()
        await asyncio.sleep(0)
        assert first.done() and not second.done()
        assert (await first).group is group
        fresh()
        d.pump()
        assert (await second).group is group
        return [e.data["request"] for e in node.events.since(0) if e.kind is EventKind.ROUTE and e.data["target"]]

    placed = asyncio.run(scenario())
    assert placed[-2:] == ["s1@3108", "s2@3108"]


def test_a_held_call_whose_client_leaves_gives_up_its_place():
    clock = Clock()
    group = FakeEchoGroup("hot0")
    ready(group, waiting=10_000)  # full
    d, node = dispatcher(group, clock=clock, overload=Overload.QUEUE)

    async def scenario() -> None:
        gone = asyncio.Event()
        task = asyncio.create_task(d.place(request(), (), False, True, tuple(range(40)), left=gone.wait))
        await asyncio.sleep(0)
        assert len(d.held) == 1
        gone.set()
        with pytest.raises(Overloaded, match="client left"):
            await task
        assert len(d.held) == 0
    asyncio.run(scenario())
    routes = [e.data["overload"] for e in node.events.since(0) if e.kind is EventKind.ROUTE]
    assert routes == ["client-gone"]  # counted once, when it gave up
