"""`talaria.routing.peers`: another node's instances mirrored into the router from its telemetry.

Against a second real node (the test session's shared `talaria up`), and against a loopback HTTP
server that answers what a broken, foreign or version-skewed peer might: whatever a peer sends, its
instances get placements only while it sends a readable envelope, and the heartbeat keeps running.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import threading
from collections.abc import Callable, Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from talaria.config.schema import PeerConfig, RouterConfig
from talaria.contracts.profile_file import dump_profile
from talaria.contracts.telemetry import InstanceTelemetry, NodeTelemetry
from talaria.routing import peers
from talaria.routing.decision import RouteRequest
from talaria.routing.peers import PeerLink
from talaria.routing.router import Router
from tests.conftest import Server
from tests.gateway.fakes import serve_app
from tests.routing.test_router import PROFILE, snapshot


def link_to(url: str) -> tuple[PeerLink, Router]:
    router = Router(RouterConfig(), lambda: 100.0)
    return PeerLink(PeerConfig(url), router, router.clock, heartbeat_s=3600.0), router


async def refreshed(link: PeerLink, times: int = 1) -> None:
    link.start()
    try:
        for _ in range(times):
            await link.refresh()
    finally:
        await link.stop()


def test_a_real_nodes_instances_are_mirrored_with_snapshot_profile_and_health(server: Server):
    link, router = link_to(server.base_url)
    asyncio.run(refreshed(link))
    host = server.base_url.removeprefix("http://")
    assert set(router.views) == {f"{host}/hot-0", f"{host}/cold-0"}
    hot, cold = router.views[f"{host}/hot-0"], router.views[f"{host}/cold-0"]
    assert hot.node == cold.node == server.base_url
    assert hot.healthy and cold.healthy
    assert hot.models == ("smollm2",) and cold.models == ("tiny-llama", "tiny-qwen3")
    assert hot.snapshot.instance == "hot-0" and cold.snapshot.rounds is not None
    assert set(hot.profile.models) == {"smollm2"} and set(cold.profile.models) == set(cold.models)
    assert hot.received_at <= 100.0  # dated by the snapshot's age on the peer's clock


def peer_answering(state: dict):
    """A loopback HTTP server whose /talaria/telemetry answers whatever `state["body"]` holds now,
    with `state["status"]` (default 200); given `state["held"]` (a threading.Event), not before it is set."""
    async def telemetry(request):
        held = state.get("held")
        if held is not None:
            await asyncio.to_thread(held.wait, 10)
        return Response(state["body"], state.get("status", 200), media_type="application/json")
    return serve_app(Starlette(routes=[Route("/talaria/telemetry", telemetry)]))


def test_a_garbled_foreign_or_vanished_peer_is_marked_unhealthy_and_the_link_goes_on(server: Server):
    good = httpx.get(server.base_url + "/talaria/telemetry", timeout=5).json()
    garbled_entry = {**good, "instances": {**good["instances"], "hot-0": {"healthy": True, "stats": {"pool": 7}}}}
    answers = [json.dumps(good).encode(), json.dumps(garbled_entry).encode(), b"[1, 2, 3]", b"not json",
               json.dumps(good).encode()]
    state = {"body": answers[0]}
    with peer_answering(state) as url:
        link, router = link_to(url)
        host = url.removeprefix("http://")

        def health() -> dict[str, bool]:
            return {name.removeprefix(host + "/"): v.healthy for name, v in router.views.items()}

        async def scenario() -> list[dict[str, bool]]:
            seen = []
            link.start()
            for body in answers:
                state["body"] = body
                await link.refresh()
                seen.append(health())
            return seen
        loop = asyncio.new_event_loop()  # one loop for the link's whole life: its client lives on it
        seen = loop.run_until_complete(scenario())
    # the peer is gone now: the next heartbeat marks everything it had unhealthy
    loop.run_until_complete(link.refresh())
    gone = health()
    loop.run_until_complete(link.stop())
    loop.close()
    assert seen[0] == {"hot-0": True, "cold-0": True}
    assert seen[1] == {"hot-0": False, "cold-0": True}  # only the entry it could not read
    assert seen[2] == seen[3] == {"hot-0": False, "cold-0": False}  # not a telemetry body at all
    assert seen[4] == {"hot-0": True, "cold-0": True}  # and back once it answers sensibly
    assert gone == {"hot-0": False, "cold-0": False}


# ---- any failed heartbeat: no placements on that peer until it answers well again ------------------


def envelope() -> dict:
    """A good telemetry body, as JSON: one healthy cold instance "i0" serving "m" and "n", with the
    toy profile and one session listed; the peer's clock and the snapshot's agree (age 0)."""
    stats = dataclasses.replace(snapshot("i0", sessions=({"session": "s", "model": "m", "kv_tokens": 32,
                                                          "location": "device"},)), time=50.0)
    entry = InstanceTelemetry(True, 0, ("m", "n"), stats, dump_profile(PROFILE))
    return json.loads(json.dumps(NodeTelemetry(50.0, {"i0": entry}, {}).to_dict()))


def garbled(change: Callable[[dict], object]) -> bytes:
    body = copy.deepcopy(envelope())
    change(body)
    return json.dumps(body).encode()


def entry(body: dict) -> dict:
    return body["instances"]["i0"]


GOOD = json.dumps(envelope()).encode()
BAD_ANSWERS = {  # (status, body) a broken, foreign or version-skewed peer might answer
    "HTTP 500": (500, GOOD),
    "not JSON": (200, b"<html>not json</html>"),
    "a JSON list": (200, b"[1, 2, 3]"),
    "no instances": (200, garbled(lambda b: b.pop("instances"))),
    "instances a list": (200, garbled(lambda b: b.update(instances=[entry(b)]))),
    "instance gone": (200, garbled(lambda b: b["instances"].clear())),
    "no time": (200, garbled(lambda b: b.pop("time"))),
    "health as text": (200, garbled(lambda b: entry(b).update(healthy="yes"))),
    "no models": (200, garbled(lambda b: entry(b).pop("models"))),
    "profile a number": (200, garbled(lambda b: entry(b).update(profile=5))),
    "stats a list": (200, garbled(lambda b: entry(b).update(stats=[1]))),
    "waiting null": (200, garbled(lambda b: entry(b)["stats"].update(waiting=None))),
    "snapshot time NaN": (200, garbled(lambda b: entry(b)["stats"].update(time=float("nan")))),
    "unknown pool": (200, garbled(lambda b: entry(b)["stats"].update(pool="warm"))),
    "queue count as text": (200, garbled(lambda b: entry(b)["stats"]["queues"][0].update(waiting="3"))),
    "round budget as text": (200, garbled(lambda b: entry(b)["stats"]["rounds"].update(round_s="10"))),
    "session tokens as text": (200, garbled(lambda b: entry(b)["stats"]["sessions"][0].update(kv_tokens="32"))),
}


@pytest.fixture(scope="module")
def peer() -> Iterator[tuple[str, dict]]:
    state: dict = {"body": GOOD}
    with peer_answering(state) as url:
        yield url, state


def placements(link: PeerLink, router: Router, state: dict, answers: list[dict]) -> list[str | None]:
    """For each answer (what to put in the peer's `state`), one refresh; where a call for "m" goes
    after each (None: nowhere)."""
    async def scenario() -> list[str | None]:
        link.start()
        try:
            placed = []
            for answer in answers:
                state.update({"status": 200, "body": GOOD, "held": None, **answer})
                await link.refresh()
                placed.append(router.route(RouteRequest("m", None, 10, 1)).instance)
            return placed
        finally:
            await link.stop()
    return asyncio.run(scenario())


@pytest.mark.parametrize("answer", BAD_ANSWERS.values(), ids=BAD_ANSWERS.keys())
def test_a_bad_heartbeat_takes_the_peer_out_of_placement_until_it_answers_well(peer, answer):
    url, state = peer
    link, router = link_to(url)
    i0 = url.removeprefix("http://") + "/i0"
    status, body = answer
    assert placements(link, router, state, [{}, {"status": status, "body": body}, {}]) == [i0, None, i0]


def test_a_heartbeat_that_times_out_takes_the_peer_out_of_placement(peer, monkeypatch):
    url, state = peer
    monkeypatch.setattr(peers, "FETCH_TIMEOUT_S", 0.05)
    link, router = link_to(url)
    i0 = url.removeprefix("http://") + "/i0"
    held = threading.Event()  # never set while the link waits
    try:
        placed = placements(link, router, state, [{}, {"held": held}, {}])
    finally:
        held.set()
    assert placed == [i0, None, i0]


BUGGY_VERSION = 7  # a snapshot the router fails on (`buggy_router`): an exception while mirroring
BUGGY = garbled(lambda b: entry(b)["stats"].update(version=BUGGY_VERSION))


@pytest.fixture
def buggy_router(monkeypatch) -> None:
    real = Router.observe

    def observe(self, name, snap, taken_at=None):
        if snap.version == BUGGY_VERSION:
            raise RuntimeError("a bug met while mirroring")
        return real(self, name, snap, taken_at)
    monkeypatch.setattr(Router, "observe", observe)


def test_an_exception_while_mirroring_takes_the_instance_out_until_it_answers_well(peer, buggy_router):
    url, state = peer
    link, router = link_to(url)
    i0 = url.removeprefix("http://") + "/i0"
    assert placements(link, router, state, [{}, {"body": BUGGY}, {}]) == [i0, None, i0]


def test_the_heartbeat_goes_on_through_every_bad_answer(buggy_router):
    answers = [*BAD_ANSWERS.values(), (200, BUGGY), (200, GOOD)]
    asked, asked_again = [], threading.Event()  # asked again after the last answer: its refresh ended

    async def telemetry(request):
        asked.append(1)
        if len(asked) > len(answers):
            asked_again.set()
        status, body = answers[min(len(asked), len(answers)) - 1]
        return Response(body, status, media_type="application/json")
    with serve_app(Starlette(routes=[Route("/talaria/telemetry", telemetry)])) as url:
        router = Router(RouterConfig(), lambda: 100.0)
        link = PeerLink(PeerConfig(url), router, router.clock, heartbeat_s=0.0)

        async def scenario() -> str | None:
            link.start()
            try:
                assert await asyncio.to_thread(asked_again.wait, 10), f"the heartbeat stopped after {len(asked)}"
                return router.route(RouteRequest("m", None, 10, 1)).instance
            finally:
                await link.stop()
        assert asyncio.run(scenario()) == url.removeprefix("http://") + "/i0"
