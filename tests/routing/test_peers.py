"""`talaria.routing.peers`: another node's instances mirrored into the router from its telemetry.

Against a second real node (the test session's shared `talaria up`), and against a loopback HTTP
server that answers what a broken or foreign peer might: whatever a peer sends, its views end up
healthy only when it sends a readable envelope, and the link keeps running.
"""

from __future__ import annotations

import asyncio
import json

import httpx
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from talaria.config.schema import PeerConfig, RouterConfig
from talaria.routing.peers import PeerLink
from talaria.routing.router import Router
from tests.conftest import Server
from tests.gateway.fakes import serve_app


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


def peer_answering(state: dict[str, bytes]):
    """A loopback HTTP server whose /talaria/telemetry answers whatever `state["body"]` holds now."""
    async def telemetry(request):
        return Response(state["body"], media_type="application/json")
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
