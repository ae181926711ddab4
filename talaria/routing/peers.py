"""Other Talaria nodes as routing candidates: their telemetry in, mirrored into the router.

Each `[[router.peers]]` entry gets a `PeerLink`. On every heartbeat it reads the peer's
`GET /talaria/telemetry` (a `NodeTelemetry` envelope) and mirrors each remote instance into the
router as an `InstanceView` named `HOST:PORT/INSTANCE` with `node` set to the peer's URL: snapshot,
health and cost profile, so remote instances are ranked by the same cost model as local ones. A call
placed on a remote instance is forwarded by the gateway (`talaria/gateway/peer_forward.py`) over this
link's HTTP client.

A heartbeat that fails in any way marks what it could not read unhealthy, so it gets no placements
(live leases there are discarded, not honoured): the whole peer for no answer, a timeout, an error
status, or a body that is not JSON or not a telemetry envelope; one instance for an entry whose
values do not have the telemetry types (a newer or foreign writer), an exception while mirroring
it, or its absence from the answer. The heartbeat never stops on a bad answer, and the next good
one restores them.

A link says when its peer goes up (a heartbeat read after none, or after failures) or down (a
heartbeat failed after one was read) through `on_change`; the peer set (talaria/routing/peer_set.py)
turns that into events. A peer whose answer carries this node's own id (`NODE_HEADER`) is this node,
reached by an address it did not know was its own: nothing of it is mirrored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import types
from collections.abc import Callable
from enum import Enum
from typing import Any, Union, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit

import httpx

from talaria.config.schema import PeerConfig
from talaria.contracts.profile import Profile, ProfileError
from talaria.contracts.profile_file import parse_profile
from talaria.contracts.telemetry import InstanceTelemetry, NodeTelemetry
from talaria.routing.instance_view import InstanceView
from talaria.routing.router import Router

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 2.0
CALL_TIMEOUT_S = httpx.Timeout(10.0, read=None)  # a long generation streams for minutes
_ROUTED = {"kv_tokens": int, "location": str, "staging_coverage": float}  # in the snapshot's untyped dicts
NODE_HEADER = "x-talaria-node"  # a node's random id, on its telemetry answers


class PeerState(str, Enum):
    JOINING = "joining"  # no heartbeat answered yet
    UP = "up"  # the last heartbeat was read: its instances are candidates
    DOWN = "down"  # the last heartbeat failed: its instances get no placements


class PeerLink:
    """One peer: the heartbeat that mirrors its instances into the router, and the HTTP client that
    calls forwarded to it go through."""

    def __init__(self, peer: PeerConfig, router: Router, clock: Callable[[], float], heartbeat_s: float,
                 node_id: str | None = None, on_change: Callable[[PeerLink], None] | None = None) -> None:
        """`node_id`: this node's own id, to know itself by; `on_change(link)`: it went up or down."""
        self.url = peer.url.rstrip("/")
        self.peer = peer
        self.router = router
        self.clock = clock
        self.heartbeat_s = heartbeat_s
        self.prefix = urlsplit(self.url).netloc
        self.node_id = node_id
        self.on_change = on_change
        self.is_self = False  # its answer carried this node's id
        self._profiles: dict[str, Profile] = {}  # TOML text -> parsed
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None
        self._failing: str | None = None  # why the last heartbeat failed; None when it was read
        self._read = False  # a heartbeat was ever read

    @property
    def state(self) -> PeerState:
        return PeerState.DOWN if self._failing is not None else PeerState.UP if self._read else PeerState.JOINING

    @property
    def why(self) -> str | None:
        """Why its last heartbeat failed; None when it was read."""
        return self._failing

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.peer.api_key}"} if self.peer.api_key else {}

    def start(self) -> None:
        """Start the heartbeat (again, after `pause`: the client and its connections are kept)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=CALL_TIMEOUT_S)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"peer {self.url}")

    async def pause(self) -> None:
        """Stop the heartbeat and take the instances out of placement; calls forwarded over the
        client go on (a peer that left the set finishes what it was sent)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._unmirrored(set())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.heartbeat_s)

    async def refresh(self) -> None:
        """Mirror the peer's instances into the router. Never raises: every view of this peer that
        the answer does not bring, healthy and readable, is marked unhealthy (no placements)."""
        mirrored = set()
        try:
            r = await self._client.get(self.url + "/talaria/telemetry", headers=self.headers, timeout=FETCH_TIMEOUT_S)
            r.raise_for_status()
            if self.node_id is not None and r.headers.get(NODE_HEADER) == self.node_id:
                self.is_self = True
                raise LookupError("this is the node itself")
            body = _envelope(r.json())
            now = self.clock()
        except Exception as e:  # noqa: BLE001 -- whatever went wrong, nothing this peer sent is trusted
            self._failed(f"{type(e).__name__}: {e}")
        else:
            for name, entry in body.instances.items():
                try:
                    self._mirror(name, entry, now, body.time)
                    mirrored.add(f"{self.prefix}/{name}")
                except Exception as e:  # noqa: BLE001 -- one entry costs only itself
                    log.debug("peer %s: instance %s unreadable (%s: %s)", self.url, name, type(e).__name__, e)
            if body.unreadable:
                log.debug("peer %s: instance entries this version cannot read: %s", self.url, body.unreadable)
            was = self.state
            if self._failing is not None:
                log.info("peer %s: telemetry read again", self.url)
            self._failing, self._read = None, True
            if was is not PeerState.UP:
                self._changed()
        self._unmirrored(mirrored)

    def unreachable(self, why: str) -> None:
        """A call could not reach the peer (no connection): down now, not at the next heartbeat."""
        self._failed(why)
        self._unmirrored(set())

    def in_flight(self) -> int:
        """Calls placed on this peer's instances and not finished."""
        return sum(v.in_flight for v in self.router.views.values() if v.node == self.url)

    def forget(self) -> None:
        """Take every instance of this peer out of the router (it left the set)."""
        for name in [name for name, view in self.router.views.items() if view.node == self.url]:
            del self.router.views[name]

    def _unmirrored(self, mirrored: set[str]) -> None:
        for view in self.router.views.values():
            if view.node == self.url and view.name not in mirrored:
                view.healthy = False

    def _failed(self, why: str) -> None:
        if self._failing is None:  # once per outage, not every heartbeat
            log.log(logging.DEBUG if self.is_self else logging.WARNING,
                    "peer %s: telemetry unreadable, its instances get no calls until it answers (%s)", self.url, why)
            self._failing = why
            self._changed()
        else:
            log.debug("peer %s: telemetry failed: %s", self.url, why)
            self._failing = why

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    def _mirror(self, name: str, entry: InstanceTelemetry, now: float, their_now: float) -> None:
        """`their_now`: the peer's clock when it answered; a snapshot's age on its clock dates it on ours."""
        key = f"{self.prefix}/{name}"
        view = self.router.views.get(key)
        if view is None:
            view = self.router.views[key] = InstanceView(key, entry.models, node=self.url)
        view.healthy = entry.healthy
        text = entry.profile
        if text and text not in self._profiles:
            try:
                self._profiles[text] = parse_profile(text, f"{self.url} {name}")
            except ProfileError as e:
                log.warning("peer %s: %s", self.url, e)
        view.profile = self._profiles.get(text) if text else None
        if entry.stats is not None:
            age = max(0.0, their_now - entry.stats.time) if their_now else 0.0
            self.router.observe(key, entry.stats, taken_at=now - age)

    @property
    def client(self) -> httpx.AsyncClient:
        """The HTTP client calls forwarded to this peer go through (open between start and stop)."""
        return self._client


def _envelope(data: Any) -> NodeTelemetry:
    """A peer's telemetry body read back. Raises TypeError when it is not a telemetry envelope;
    instance entries whose JSON does not fit the telemetry types are left out (`unreadable`)."""
    if not isinstance(data, dict) or not isinstance(data.get("instances"), dict) or not _fits(data.get("time"), float):
        raise TypeError('not a Talaria telemetry body: expected an object with a "time" number and an '
                        '"instances" object')
    fitting = {name: entry for name, entry in data["instances"].items()
               if _fits(entry, InstanceTelemetry) and _routable(entry["stats"])}
    body = NodeTelemetry.from_dict({**data, "instances": fitting})
    unreadable = tuple(name for name in data["instances"] if name not in body.instances)
    return dataclasses.replace(body, unreadable=unreadable)


def _fits(value: Any, hint: Any) -> bool:
    """`value`, as JSON decoded it, can stand for a field of type `hint` in the telemetry dataclasses:
    an object for a dataclass (its fields without defaults present, unknown keys ignored), a list
    for a tuple, an Enum's value for the Enum, a finite number for an int or float. So a routing
    decision never meets a string where it computes with a number."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union or origin is types.UnionType:
        return any(_fits(value, a) for a in args)
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int or hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if origin is tuple:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_fits(v, args[1]) for v in value.values())
    if isinstance(hint, type) and issubclass(hint, Enum):
        return any(value == m.value for m in hint)
    if dataclasses.is_dataclass(hint):
        hints = _hints(hint)
        return isinstance(value, dict) and all(
            _fits(value[f.name], hints[f.name]) if f.name in value
            else f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            for f in dataclasses.fields(hint))
    return isinstance(value, hint)  # str, dict


def _routable(stats: dict | None) -> bool:
    """The values routing reads inside the snapshot's untyped dicts (its sessions, its substrate) have
    their types too."""
    if stats is None:
        return True
    entries = [*stats.get("sessions", ()), stats.get("substrate", {})]  # _fits checked these are dicts
    return all(_fits(e[key], hint) for e in entries for key, hint in _ROUTED.items() if key in e)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)
