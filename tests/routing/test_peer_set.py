"""`talaria.routing.peer_set`: the peers a name resolves to, kept in step with it.

The peers are real gateways (over fake instances) on 127.0.0.2 and 127.0.0.3, listening on the
same port as "this node" on 127.0.0.1 would, as pods behind a headless Service do; they ask for the
peer key. What the name resolves to is injected (`Names`), and the test drives each resolution
(`discover`) and heartbeat (`refresh`) itself, so every step is deterministic.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import psutil
import pytest

from talaria.config.schema import PeerConfig, RouterConfig, ServerConfig
from talaria.contracts.events import EventKind
from talaria.gateway.gateway import create_app
from talaria.routing.peer_set import PeerSet, resolve_name
from talaria.routing.peers import PeerState
from talaria.routing.router import Router
from tests.gateway.fakes import FakeEchoGroup, FakeEchoSupervisor
from tests.loopback import HOSTS, free_ports, serve_on

KEY = "set-key"
NODE_ID = "this-node"


class Names:
    """What the name resolves to now: addresses, or an error to raise (a lookup that failed)."""

    def __init__(self, *addresses: str) -> None:
        self.addresses, self.error = list(addresses), None
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, name: str, port: int) -> list[str]:
        self.asked.append((name, port))
        if self.error is not None:
            raise self.error
        return list(self.addresses)


@pytest.fixture(scope="module")
def peers() -> Iterator[tuple[int, dict]]:
    """Gateways on 127.0.0.2 and .3 at one port, each with one instance (hot-2, hot-3); the apps by host."""
    [port] = free_ports(1)
    apps = {host: create_app(FakeEchoSupervisor([FakeEchoGroup(f"hot-{host[-1]}")], server=ServerConfig(peer_key=KEY)))
            for host in HOSTS[1:]}
    with serve_on(apps[HOSTS[1]], (HOSTS[1], port)), serve_on(apps[HOSTS[2]], (HOSTS[2], port)):
        yield port, apps


def peer_set(port: int, names: Names, host: str = HOSTS[0], static: tuple[PeerConfig, ...] = (),
             own_port: int | None = None) -> tuple[PeerSet, list]:
    """This node's peer set (bound to `host` at `own_port`, default the peers' `port`) and the events it emits."""
    emitted = []
    router = Router(RouterConfig(), lambda: 100.0, lambda kind, **data: emitted.append((kind, data)))
    config = RouterConfig(peer_dns=f"peers.test:{port}", heartbeat_s=3600.0, peers=static)
    server = ServerConfig(host=host, port=own_port or port, peer_key=KEY)
    return PeerSet(config, server, router, router.clock, [], NODE_ID, names), emitted


async def heartbeat(ps: PeerSet) -> None:
    """Each link started (its client open) and one heartbeat read, one link after the other."""
    for link in ps.links:
        link.start()
        await link.refresh()


def url(host: str, port: int) -> str:
    return f"http://{host}:{port}"


def health(ps: PeerSet) -> dict[str, bool]:
    return {name: v.healthy for name, v in ps.router.views.items()}


def ops(emitted: list) -> list[tuple[str, str]]:
    assert all(kind is EventKind.PEER for kind, _ in emitted)
    return [(data["op"], data["peer"]) for _, data in emitted]


def test_every_address_but_its_own_becomes_a_peer_presenting_the_peer_key(peers):
    port, _ = peers
    names = Names(*HOSTS)  # the name lists this node too

    async def scenario():
        ps, emitted = peer_set(port, names)
        await ps.discover()
        await heartbeat(ps)
        try:
            return [link.url for link in ps.links], health(ps), ops(emitted), ps.telemetry(), ps.counts()
        finally:
            await ps.stop()
    links, views, changes, telemetry, counts = asyncio.run(scenario())
    b, c = url(HOSTS[1], port), url(HOSTS[2], port)
    assert names.asked == [("peers.test", port)]
    assert links == [b, c]
    # their telemetry answered (it asks for the peer key) and their instances are candidates
    assert views == {f"{HOSTS[1]}:{port}/hot-2": True, f"{HOSTS[2]}:{port}/hot-3": True}
    assert changes == [("up", b), ("up", c)]
    assert [(m["url"], m["source"], m["state"], m["instances"], m["healthy_instances"])
            for m in telemetry["members"]] == [(b, "dns", "up", 1, 1), (c, "dns", "up", 1, 1)]
    assert counts == {"joining": 0, "up": 2, "down": 0}


def test_an_address_that_stops_resolving_leaves_and_is_forgotten_once_its_calls_end(peers):
    port, _ = peers
    names = Names(*HOSTS)
    b, c = url(HOSTS[1], port), url(HOSTS[2], port)
    view_c = f"{HOSTS[2]}:{port}/hot-3"

    async def scenario():
        ps, emitted = peer_set(port, names)
        await ps.discover()
        await heartbeat(ps)
        link_c = ps.links[1]
        ps.router.sent(view_c)  # a call forwarded to C, still running
        names.addresses = [HOSTS[0], HOSTS[1]]
        await ps.discover()
        leaving = (health(ps), [link.url for link in ps.links], ps.telemetry()["leaving"], link_c.client is not None)
        ps.router.finished(view_c)  # its call ends
        await ps.discover()
        gone = (health(ps), [link.url for link in ps.links], ps.telemetry()["leaving"], link_c.client)
        names.addresses = list(HOSTS)  # and it resolves again
        await ps.discover()
        await heartbeat(ps)
        back = (health(ps), ops(emitted))
        await ps.stop()
        return leaving, gone, back
    leaving, gone, back = asyncio.run(scenario())
    views, links, left, open_client = leaving
    assert views == {f"{HOSTS[1]}:{port}/hot-2": True, view_c: False}  # no new placement on C
    assert links == [b, c] and left == [{"url": c, "in_flight": 1}] and open_client  # its call goes on
    views, links, left, client = gone
    assert views == {f"{HOSTS[1]}:{port}/hot-2": True} and links == [b] and left == [] and client is None
    views, changes = back
    assert views == {f"{HOSTS[1]}:{port}/hot-2": True, view_c: True}
    assert changes == [("up", b), ("up", c), ("left", c), ("up", c)]


def test_a_name_that_does_not_exist_empties_the_set_but_a_failed_lookup_keeps_it(peers):
    port, _ = peers
    names = Names(HOSTS[1])
    static = url(HOSTS[2], port)

    async def scenario():
        ps, emitted = peer_set(port, names, static=(PeerConfig(static, KEY),))
        await ps.discover()
        names.error = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        await ps.discover()  # no DNS server answered: nothing is known about the set
        failed = ([link.url for link in ps.links], ps.telemetry()["lookup_failed"])
        names.error, names.addresses = None, []  # NXDOMAIN: a headless Service with no ready pod
        await ps.discover()
        empty = ([link.url for link in ps.links], ps.telemetry()["lookup_failed"], ops(emitted))
        await ps.stop()
        return failed, empty
    failed, empty = asyncio.run(scenario())
    b = url(HOSTS[1], port)
    assert failed == ([static, b], "gaierror: [Errno -3] Temporary failure in name resolution")
    assert empty == ([static], None, [("left", b)])  # the static peer stays


def test_a_peer_that_answers_with_this_nodes_id_is_this_node_and_never_a_peer_again(peers):
    port, apps = peers
    names = Names(HOSTS[2])  # an address this node does not know is its own (a Service in front of it)
    apps[HOSTS[2]].state.gateway.node_id = NODE_ID

    async def scenario():
        ps, emitted = peer_set(port, names)
        try:
            await ps.discover()
            await heartbeat(ps)
            await asyncio.sleep(0)  # the link's change is handled on the next turn of the loop
            dropped = ([link.url for link in ps.links], health(ps), ops(emitted))
            await ps.discover()
            return dropped, [link.url for link in ps.links]
        finally:
            await ps.stop()
    try:
        dropped, again = asyncio.run(scenario())
    finally:
        apps[HOSTS[2]].state.gateway.node_id = "another"
    assert dropped == ([], {}, [])  # nothing of it mirrored, no event
    assert again == []


@pytest.mark.parametrize("peer_port_differs", [False, True])
def test_bound_to_every_interface_its_interface_and_loopback_addresses_are_its_own(peer_port_differs: bool):
    interface = next(a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                     if a.family == socket.AF_INET and not a.address.startswith("127."))
    names = Names("127.0.0.9", interface, "192.0.2.77")  # 192.0.2.77: TEST-NET-1, on no machine
    port = 8001

    async def scenario():
        ps, _ = peer_set(port, names, host="0.0.0.0", own_port=port + peer_port_differs)
        await ps.discover()
        found = [link.url for link in ps.links]
        await ps.stop()
        return found
    found = asyncio.run(scenario())
    others = [url("192.0.2.77", port)]
    assert found == (sorted([url("127.0.0.9", port), url(interface, port), *others]) if peer_port_differs else others)


def test_the_real_resolver_prefers_ipv4_and_reads_no_such_name_as_no_peers():
    assert asyncio.run(resolve_name("localhost", 8001)) == ["127.0.0.1"]
    assert asyncio.run(resolve_name("no-such-host.invalid", 8001)) == []  # RFC 6761: never resolves


def test_a_link_is_joining_until_its_first_heartbeat(peers):
    port, _ = peers

    async def scenario():
        ps, _ = peer_set(port, Names(HOSTS[1]))
        await ps.discover()
        before = ps.links[0].state
        await heartbeat(ps)
        after = ps.links[0].state
        await ps.stop()
        return before, after
    assert asyncio.run(scenario()) == (PeerState.JOINING, PeerState.UP)
