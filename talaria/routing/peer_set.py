"""The node's peers: the static `[[router.peers]]` and every address `[router] peer_dns` resolves to.

`peer_dns = "NAME:PORT"` names the set of nodes by DNS, as a Kubernetes headless Service names its
ready pods. Every `peer_dns_interval_s` the name is resolved again, and (`discover`, the verb):

- an address that appears becomes a peer: a `PeerLink` to `http://ADDRESS:PORT` that presents this
  node's `[server] peer_key` (every node of a set shares one); its instances join the router's
  candidates with its first heartbeat read;
- an address that no longer resolves leaves the set: its heartbeat stops and its instances get no
  new placements (its live leases are discarded at their sessions' next calls); the calls already
  forwarded there go on, and once none is left its instances are forgotten and its connections
  closed. If it resolves again before, it is the same peer again;
- a peer whose heartbeat fails is down whatever its name says, since DNS lags a node that died:
  its instances get no placements until a heartbeat is read again (talaria/routing/peers.py);
- the node's own addresses are never peers: the address it binds (or, bound to every interface,
  each interface's address and loopback) at its peer port; and a link whose telemetry carries this
  node's id (an address it did not know was its own) is dropped and that address remembered.

A name that does not exist (NXDOMAIN: a headless Service without a ready pod) resolves to no peer;
a lookup that failed (no DNS server answered) changes nothing, so a DNS outage never empties the
set. Static peers are never forgotten. Every change is a `peer` event (instance "router": `up`,
`down`, `left`), and the set is in the telemetry's router section as `peers`.

Lookups go through the C library's resolver (`socket.getaddrinfo`) in a thread, the same for any
event loop (uvloop resolves in libuv otherwise), so the name resolves as it does for every other
program on the host.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import psutil

from talaria.config.schema import PeerConfig, RouterConfig, ServerConfig
from talaria.contracts.events import EventKind
from talaria.routing.peers import PeerLink, PeerState
from talaria.routing.router import Router

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (name, port) -> addresses; raises OSError if the lookup failed
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
_WILDCARDS = {"", "0.0.0.0", "::"}


async def resolve_name(name: str, port: int) -> list[str]:
    """The addresses `name` resolves to: its IPv4 ones when it has any (a dual-stack pod has one of
    each, and one link per node is enough), else its IPv6 ones; [] when the name does not exist.
    Raises OSError when the lookup itself failed."""
    try:
        infos = await asyncio.to_thread(socket.getaddrinfo, name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in _NO_SUCH_NAME:
            return []
        raise
    v4 = [info[4][0] for info in infos if info[0] == socket.AF_INET]
    v6 = [info[4][0] for info in infos if info[0] == socket.AF_INET6]
    return list(dict.fromkeys(v4 or v6))


def peer_url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def own_addresses(host: str) -> tuple[frozenset[str], bool]:
    """(the addresses a node bound to `host` answers on, whether it answers on every loopback one
    too): `host` itself, or for a wildcard bind every address of the machine's interfaces."""
    if host in _WILDCARDS:
        found = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family in (socket.AF_INET, socket.AF_INET6)}
        return frozenset(found), True
    try:
        return frozenset({str(ipaddress.ip_address(host))}), False
    except ValueError:  # a host name: what it resolves to now
        try:
            return frozenset(info[4][0] for info in socket.getaddrinfo(host, None)), False
        except OSError:
            return frozenset({host}), False


@dataclass(slots=True)
class Member:
    link: PeerLink
    source: str  # "static" ([[router.peers]]) or "dns" (peer_dns)


class PeerSet:
    """Every peer link of the node, kept in `links` (the dispatcher's list: a call placed on a peer
    finds its link there), with the static peers first."""

    def __init__(self, config: RouterConfig, server: ServerConfig, router: Router, clock: Callable[[], float],
                 links: list[PeerLink], node_id: str, resolve: Resolver = resolve_name) -> None:
        self.config = config
        self.router = router
        self.clock = clock
        self.links = links
        self.node_id = node_id
        self.resolve = resolve
        self.key = server.peer_key
        self.name, self.port = None, 0
        if config.peer_dns is not None:
            name, _, port = config.peer_dns.rpartition(":")
            self.name, self.port = name.strip("[]"), int(port)
        self._own_port = server.peer_port or server.port
        self._own, self._own_loopback = own_addresses(server.host)
        self._found_own: set[str] = set()  # URLs that turned out to be this node
        self._members: dict[str, Member] = {}
        self._leaving: dict[str, Member] = {}  # left the set, calls forwarded there still running
        self._task: asyncio.Task | None = None
        self._running = False
        self.changes = {"up": 0, "down": 0, "left": 0}  # peer events by op, since start
        self.lookup_failed: str | None = None  # why the last lookup failed; None when it answered
        for peer in config.peers:
            self._add(peer, "static")

    # ---- life -------------------------------------------------------------------------------

    def start(self) -> None:
        self._running = True
        for member in self._members.values():
            member.link.start()
        if self.name is not None:
            self._task = asyncio.create_task(self._run(), name=f"peer_dns {self.config.peer_dns}")

    async def stop(self) -> None:
        self._running = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        members = [*self._members.values(), *self._leaving.values()]
        await asyncio.gather(*(m.link.stop() for m in members), return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await self.discover()
            await asyncio.sleep(self.config.peer_dns_interval_s)

    # ---- the verb ---------------------------------------------------------------------------

    async def discover(self) -> None:
        """Resolve `peer_dns` once and make the discovered peers what it says. Never raises."""
        self._drop_self()
        if self.name is None:
            return
        try:
            addresses = await self.resolve(self.name, self.port)
        except Exception as e:  # noqa: BLE001 -- a lookup that failed says nothing about the set
            if self.lookup_failed is None:
                log.warning("peer_dns %s: lookup failed, the peer set stays as it is (%s: %s)",
                            self.config.peer_dns, type(e).__name__, e)
            self.lookup_failed = f"{type(e).__name__}: {e}"
            return
        self.lookup_failed = None
        found = {peer_url(a, self.port) for a in addresses if not self._is_own(a)} - self._found_own
        for url, member in list(self._members.items()):
            if member.source == "dns" and url not in found:
                await self._leave(url)
        for url in sorted(found - set(self._members)):
            back = self._leaving.pop(url, None)
            if back is not None:  # it left and came back before its last call ended: the same link
                self._members[url] = back
                back.link.start()
                log.info("peer_dns %s: %s is back in the peer set", self.config.peer_dns, url)
            else:
                self._add(PeerConfig(url, self.key), "dns")
        await self._close_left()

    # ---- what the node reports ----------------------------------------------------------------

    def telemetry(self) -> dict:
        """The set, for the telemetry's router section and the dashboard."""
        members = []
        for url, m in self._members.items():
            views = [v for v in self.router.views.values() if v.node == url]
            members.append({"url": url, "source": m.source, "state": m.link.state.value, "why": m.link.why,
                            "instances": len(views), "healthy_instances": sum(v.healthy for v in views)})
        return {"dns": self.config.peer_dns, "interval_s": self.config.peer_dns_interval_s,
                "lookup_failed": self.lookup_failed, "members": members,
                "leaving": [{"url": url, "in_flight": m.link.in_flight()} for url, m in self._leaving.items()]}

    def counts(self) -> dict[str, int]:
        """Peers by state (every state, zeros included)."""
        counts = {s.value: 0 for s in PeerState}
        for m in self._members.values():
            counts[m.link.state.value] += 1
        return counts

    # ---- members ----------------------------------------------------------------------------

    def _is_own(self, address: str) -> bool:
        if self.port != self._own_port:
            return False
        try:
            loopback = ipaddress.ip_address(address).is_loopback
        except ValueError:
            loopback = False
        return address in self._own or (self._own_loopback and loopback)

    def _add(self, peer: PeerConfig, source: str) -> None:
        link = PeerLink(peer, self.router, self.clock, self.config.heartbeat_s, self.node_id, self._changed)
        self._members[link.url] = Member(link, source)
        self.links.append(link)
        if self._running:
            link.start()
        if source == "dns":
            log.info("peer_dns %s: %s joins the peer set", self.config.peer_dns, link.url)

    async def _leave(self, url: str) -> None:
        member = self._members.pop(url)
        self._leaving[url] = member
        await member.link.pause()
        log.info("peer_dns %s: %s no longer resolves; it leaves the peer set", self.config.peer_dns, url)
        self._emit("left", member, "no longer resolves")

    async def _close_left(self) -> None:
        """Peers that left and have no call running there any more: forgotten, connections closed."""
        for url, member in list(self._leaving.items()):
            if member.link.in_flight() == 0:
                del self._leaving[url]
                self.links.remove(member.link)
                member.link.forget()
                await member.link.stop()

    def _drop_self(self) -> None:
        """Links that found this node at the other end go; their addresses are never peers again."""
        for url, member in list(self._members.items()):
            if member.link.is_self:
                self._found_own.add(url)
                log.info("peer %s is this node itself: it is not a peer", url)
                self._members.pop(url)
                self.links.remove(member.link)
                member.link.on_change = None
                asyncio.get_running_loop().create_task(member.link.stop())

    def _changed(self, link: PeerLink) -> None:
        if link.is_self:
            asyncio.get_running_loop().call_soon(self._drop_self)
            return
        member = self._members.get(link.url)
        if member is None:
            return
        self._emit(link.state.value, member, link.why)

    def _emit(self, op: str, member: Member, why: str | None) -> None:
        self.changes[op] += 1
        if self.router.emit is not None:
            self.router.emit(EventKind.PEER, op=op, peer=member.link.url, source=member.source, why=why)
