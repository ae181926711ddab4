"""`talaria.gateway.peer_forward`: a forwarded call is relayed, and cancelled on the peer when its client leaves.

Node A is the real gateway with no instances of its own and one peer, driven through the raw ASGI
interface so the test decides when its client goes away. The peer is a second real gateway served
on loopback (`serve_app`) over a fake group that hangs after two tokens; it runs on its own
thread's event loop, so it signals through thread-safe events, and the test waits on those.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager
from typing import Any

import pytest

from talaria.config.schema import (
    ApiKeyConfig,
    PeerConfig,
    RouterConfig,
    RouterPolicy,
    ServerConfig,
)
from talaria.gateway.gateway import create_app
from tests.gateway.fakes import MODEL, FakeEchoGroup, FakeEchoSupervisor, serve_app

WAIT_S = 10.0


class WatchedGroup(FakeEchoGroup):
    """Hangs after two tokens; says when it hangs (`hanging`) and when its call has ended (`ended`)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, hang_after=2, hanging=threading.Event())
        self.ended = threading.Event()

    async def generate(self, call):
        try:
            async with aclosing(super().generate(call)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            self.ended.set()


class Client:
    """An ASGI client of node A: what A sent it (`sent`, `arrived` is set on each message), and
    `gone`, set to disconnect."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.arrived = asyncio.Event()
        self.gone = asyncio.Event()

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    async def relayed(self, text: bytes) -> None:
        while text not in self.body():
            self.arrived.clear()
            await self.arrived.wait()


async def post_then_leave(app, body: dict, client: Client, spec: str, key: str | None = None) -> None:
    """POST /v1/completions to `app`; the client disconnects when `client.gone` is set."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                    *([(b"authorization", f"Bearer {key}".encode())] if key else [])],
    }
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await client.gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        client.sent.append(message)
        client.arrived.set()

    await app(scope, receive, send)


@contextmanager
def forwarding_to(group: FakeEchoGroup, peer: ServerConfig | None = None, peer_key: str | None = None,
                  node: ServerConfig | None = None) -> Iterator[Any]:
    """Node A (no instances of its own) whose one peer, served on loopback, runs `group`."""
    with serve_app(create_app(FakeEchoSupervisor([group], server=peer))) as peer_url:
        router = RouterConfig(policy=RouterPolicy.LEAST_PRESSURE, peers=(PeerConfig(peer_url, peer_key),))
        yield create_app(FakeEchoSupervisor([], router=router, server=node))


@asynccontextmanager
async def linked(app) -> AsyncIterator[None]:
    """A's heartbeat to its peer running, and A's view of the peer fresh."""
    link = app.state.gateway.dispatcher.peers[0]
    link.start()
    try:
        await link.refresh()
        yield
    finally:
        await link.stop()


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_cancels_the_forwarded_call_on_the_peer(stream: bool, spec: str):
    group = WatchedGroup("hot-b")
    with forwarding_to(group) as app:
        dispatcher = app.state.gateway.dispatcher
        client = Client()

        async def scenario() -> None:
            async with linked(app):
                call = asyncio.create_task(post_then_leave(app, {"model": MODEL, "prompt": "abc", "max_tokens": 50,
                                                                 "stream": stream}, client, spec))
                assert await asyncio.to_thread(group.hanging.wait, WAIT_S), "the peer never got the call"
                if stream:  # two tokens out, and relayed; the third never comes
                    await asyncio.wait_for(client.relayed(b'"text":"b"'), WAIT_S)
                assert group.in_flight == 1 and group.closed == []
                client.gone.set()
                await asyncio.wait_for(call, WAIT_S)
                assert await asyncio.to_thread(group.ended.wait, WAIT_S), "the peer's call was never cancelled"
        asyncio.run(scenario())
    assert group.closed == [group.calls[0].request_id] and group.completed == []
    assert group.in_flight == 0
    assert [v.in_flight for v in dispatcher.router.views.values()] == [0]  # A recorded the call's end
    if stream:
        assert b"[DONE]" not in client.body()
    else:
        assert client.sent[0]["status"] == 499


@pytest.mark.parametrize("stream", [False, True])
def test_a_forwarded_call_that_completes_is_relayed_and_leaves_a_lease(stream: bool):
    group = FakeEchoGroup("hot-b")
    with forwarding_to(group) as app:
        dispatcher = app.state.gateway.dispatcher
        client = Client()

        async def scenario() -> None:
            async with linked(app):
                body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": stream, "session_id": "s1"}
                await asyncio.wait_for(post_then_leave(app, body, client, "2.4"), WAIT_S)
        asyncio.run(scenario())
    assert client.sent[0]["status"] == 200
    assert group.completed == [group.calls[0].request_id]
    if stream:
        assert b'"text":"c"' in client.body() and client.body().rstrip().endswith(b"data: [DONE]")
    else:
        assert json.loads(client.body())["choices"][0]["text"] == "abc"
    assert [v.in_flight for v in dispatcher.router.views.values()] == [0]
    assert [(lease.session, lease.model) for lease in dispatcher.router.leases.all()] == [("s1", MODEL)]


def test_a_forwarded_call_runs_on_the_peer_for_its_tenant():
    """Node A's client is tenant team-a; A forwards with the peer's peer key, and the peer runs the
    call in team-a's namespace (its prefixes and session), not in the peer key's."""
    group = FakeEchoGroup("hot-b")
    peer_server = ServerConfig(api_keys=(ApiKeyConfig("key-b", "team-b"),), peer_key="peer-b")
    node = ServerConfig(api_keys=(ApiKeyConfig("key-a", "team-a"),))
    with forwarding_to(group, peer_server, "peer-b", node) as app:
        client = Client()

        async def scenario() -> None:
            async with linked(app):
                body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "session_id": "s1"}
                await asyncio.wait_for(post_then_leave(app, body, client, "2.4", key="key-a"), WAIT_S)
        asyncio.run(scenario())
    assert client.sent[0]["status"] == 200, client.body()
    [call] = group.calls
    assert call.cache_salt == "team-a" and call.session_id.startswith("team-a/")


def test_a_call_placed_on_a_peer_that_died_is_placed_again_on_another():
    """Two peers serve the model; the one A prefers dies between heartbeats. A's call finds no one
    listening there, takes that peer out of placement and goes to the other: the client sees a 200."""
    dead, alive = FakeEchoGroup("hot-b"), FakeEchoGroup("hot-c")
    with serve_app(create_app(FakeEchoSupervisor([alive]))) as alive_url:
        with serve_app(create_app(FakeEchoSupervisor([dead]))) as dead_url:
            router = RouterConfig(policy=RouterPolicy.LEAST_PRESSURE, peers=(PeerConfig(dead_url), PeerConfig(alive_url)))
            app = create_app(FakeEchoSupervisor([], router=router))
            gateway = app.state.gateway
            links = gateway.dispatcher.peers

            async def heartbeats() -> None:
                for link in links:
                    link.start()
                    await link.refresh()
            loop = asyncio.new_event_loop()  # one loop for the links' whole life: their clients live on it
            loop.run_until_complete(heartbeats())
        # dead_url's server is gone; A's views of it are still healthy until its next heartbeat
        client = Client()
        router_ = gateway.dispatcher.router
        alive_view = next(v for v in router_.views.values() if v.node == alive_url)
        router_.sent(alive_view.name)  # busier than the dead one, so least-pressure tries the dead one first
        try:
            loop.run_until_complete(asyncio.wait_for(
                post_then_leave(app, {"model": MODEL, "prompt": "abc", "max_tokens": 3}, client, "2.4"), WAIT_S))
            states = [link.state.value for link in links]
        finally:
            router_.finished(alive_view.name)
            loop.run_until_complete(gateway.peers.stop())
            loop.close()
    assert client.sent[0]["status"] == 200, client.body()
    assert json.loads(client.body())["choices"][0]["text"] == "abc"
    assert len(alive.completed) == 1 and dead.calls == []
    assert states == ["down", "up"]
    routes = [e.data["target"] for e in gateway.supervisor.events.since(0) if e.kind.value == "route"]
    assert routes == [f"{dead_url.removeprefix('http://')}/hot-b", alive_view.name]  # placed twice, on each
