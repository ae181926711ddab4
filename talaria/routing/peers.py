"""Other Talaria nodes as routing candidates: their telemetry in, mirrored into the router.

Each `[[router.peers]]` entry gets a `PeerLink`. On every heartbeat it reads the peer's
`GET /talaria/telemetry` (a `NodeTelemetry` envelope) and mirrors each remote instance into the
router as an `InstanceView` named `HOST:PORT/INSTANCE` with `node` set to the peer's URL: snapshot,
health and cost profile, so remote instances are ranked by the same cost model as local ones. A peer
that does not answer has its instances marked unhealthy (live leases there are then discarded, not
honoured). A call placed on a remote instance is forwarded by the gateway
(`talaria/gateway/peer_forward.py`) over this link's HTTP client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
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


class PeerLink:
    def __init__(self, peer: PeerConfig, router: Router, clock: Callable[[], float], heartbeat_s: float) -> None:
        self.url = peer.url.rstrip("/")
        self.peer = peer
        self.router = router
        self.clock = clock
        self.heartbeat_s = heartbeat_s
        self.prefix = urlsplit(self.url).netloc
        self._profiles: dict[str, Profile] = {}  # TOML text -> parsed
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.peer.api_key}"} if self.peer.api_key else {}

    def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=CALL_TIMEOUT_S)
        self._task = asyncio.create_task(self._run(), name=f"peer {self.url}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    async def _run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.heartbeat_s)

    async def refresh(self) -> None:
        """Mirror the peer's instances into the router; on failure mark them unhealthy."""
        try:
            r = await self._client.get(self.url + "/talaria/telemetry", headers=self.headers, timeout=FETCH_TIMEOUT_S)
            r.raise_for_status()
            body = NodeTelemetry.from_dict(r.json())
        except (httpx.HTTPError, TypeError, ValueError) as e:
            log.debug("peer %s: telemetry failed: %s", self.url, e)
            for view in self.router.views.values():
                if view.node == self.url:
                    view.healthy = False
            return
        now = self.clock()
        for name, entry in body.instances.items():
            self._mirror(name, entry, now, body.time)
        for name in body.unreadable:  # an entry this version cannot read: place nothing there
            view = self.router.views.get(f"{self.prefix}/{name}")
            if view is not None:
                view.healthy = False

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
