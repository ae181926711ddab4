"""Draining a node (`POST /talaria/admin/drain`, `talaria drain`): what a Kubernetes preStop starts.

The draining node is the real gateway over a fake instance, served on loopback; node A is another
real gateway with the draining node as its peer. A draining node still serves what reaches it, but
its probes and its peers see it leaving, and `talaria drain` waits for its calls in flight.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
from click.testing import CliRunner

from talaria.cli.main import cli
from talaria.config.schema import PeerConfig, RouterConfig, RouterPolicy, ServerConfig
from talaria.gateway.gateway import create_app
from tests.conftest import wait_for
from tests.gateway.fakes import MODEL, FakeEchoGroup, FakeEchoSupervisor, serve_app

DRAIN_S = 0.6


def completion(url: str, max_tokens: int = 3, timeout: float = 10) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": max_tokens},
                      timeout=timeout)


def test_a_draining_node_serves_what_reaches_it_but_its_probes_and_peers_see_it_leave():
    app = create_app(FakeEchoSupervisor([FakeEchoGroup("hot-b")]))
    with serve_app(app) as url:
        a = create_app(FakeEchoSupervisor([], router=RouterConfig(policy=RouterPolicy.LEAST_PRESSURE,
                                                                  peers=(PeerConfig(url),))))
        [link] = a.state.gateway.dispatcher.peers

        async def heartbeat() -> dict[str, bool]:
            await link.refresh()
            return {name: v.healthy for name, v in a.state.gateway.dispatcher.router.views.items()}

        async def scenario():
            link.start()
            try:
                before = (await heartbeat(), httpx.get(url + "/health").status_code)
                drained = httpx.post(url + "/talaria/admin/drain").json()
                health = httpx.get(url + "/health")
                entry = httpx.get(url + "/talaria/telemetry").json()["instances"]["hot-b"]
                return before, drained, health, entry, await heartbeat(), completion(url)
            finally:
                await link.stop()
        before, drained, health, entry, after, served = asyncio.run(scenario())
    view = f"{url.removeprefix('http://')}/hot-b"
    assert before == ({view: True}, 200)
    assert drained == {"draining": True, "in_flight": 0, "drain_s": 30.0}
    assert health.status_code == 503 and health.json()["status"] == "draining"  # readiness: out of the Service
    assert (entry["healthy"], entry["state"]) == (False, "draining")
    assert after == {view: False}  # its peers place nothing new there
    assert served.status_code == 200 and served.json()["choices"][0]["text"] == "abc"  # but it serves what comes


def run_drain(url: str, *args: str) -> tuple[float, str]:
    """`talaria drain --url URL ...`: (seconds it took, what it printed)."""
    start = time.monotonic()
    result = CliRunner().invoke(cli, ["drain", "--url", url, *args])
    assert result.exit_code == 0, result.output
    return time.monotonic() - start, result.output


def test_talaria_drain_waits_for_the_calls_in_flight_up_to_drain_s():
    group = FakeEchoGroup("hot-b", hang_after=1)  # its one call never ends
    app = create_app(FakeEchoSupervisor([group], server=ServerConfig(drain_s=DRAIN_S)))
    with serve_app(app) as url:
        took, idle = run_drain(url)
        assert took < DRAIN_S and "done after" in idle and "nothing in flight" in idle

        def call() -> None:
            try:
                completion(url, max_tokens=5, timeout=DRAIN_S + 1)  # then it leaves: the call is cancelled
            except httpx.HTTPError:
                pass
        threading.Thread(target=call, daemon=True).start()
        wait_for(lambda: group.in_flight == 1, 5, "the call running on the instance")
        took, busy = run_drain(url)
    assert took >= DRAIN_S, busy  # it waited for the call, up to drain_s
    assert "1 call(s) in flight" in busy and "1 still in flight, left to SIGTERM's drain_s" in busy


def test_talaria_drain_waits_at_least_settle_s_for_probes_and_peers_to_see_it():
    app = create_app(FakeEchoSupervisor([FakeEchoGroup("hot-b")]))
    with serve_app(app) as url:
        took, out = run_drain(url, "--settle-s", "0.5")
    assert took >= 0.5 and "nothing in flight" in out


def test_the_drain_needs_the_admin_key_when_there_is_one():
    app = create_app(FakeEchoSupervisor([FakeEchoGroup("hot-b")], server=ServerConfig(admin_key="adm")))
    with serve_app(app) as url:
        refused = CliRunner().invoke(cli, ["drain", "--url", url])
        took, out = run_drain(url, "--admin-key", "adm")
        health = httpx.get(url + "/health").json()["status"]
    assert refused.exit_code == 1 and "401" in refused.output
    assert "nothing in flight" in out and health == "draining"
