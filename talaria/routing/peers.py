"""Other Talaria nodes as routing candidates: their telemetry in, forwarded calls out.

Each `[[router.peers]]` entry gets a `PeerLink`. On every heartbeat it reads the peer's
`GET /talaria/telemetry` and mirrors each remote instance into the router as an `InstanceView`
named `HOST:PORT/INSTANCE` with `node` set to the peer's URL: snapshot, health and cost profile,
so remote instances are ranked by the same cost model as local ones. A peer that does not answer
has its instances marked unhealthy (live leases there are then discarded, not honoured).

A call placed on a remote instance is forwarded as the same OpenAI request, with the session id in
`X-Session-Id` and `X-Talaria-Forwarded: 1` so the peer serves it on its own instances rather than
routing it again. Streaming is preserved: the peer's SSE bytes are relayed as they arrive.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from talaria.config.schema import PeerConfig
from talaria.contracts.call import Usage
from talaria.contracts.profile import Profile, ProfileError, parse_profile
from talaria.contracts.telemetry import stats_from_dict
from talaria.gateway.errors import RETRY_AFTER_S, UNAVAILABLE, APIError
from talaria.routing.router import InstanceView, Router

if TYPE_CHECKING:
    from talaria.routing.dispatcher import Dispatcher, Placement

log = logging.getLogger(__name__)

FORWARDED_HEADER = "x-talaria-forwarded"
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
            body = r.json()
            instances, their_now = body["instances"], float(body.get("time", 0.0))
        except (httpx.HTTPError, ValueError, KeyError) as e:
            log.debug("peer %s: telemetry failed: %s", self.url, e)
            for view in self.router.views.values():
                if view.node == self.url:
                    view.healthy = False
            return
        now = self.clock()
        for name, entry in instances.items():
            self._mirror(name, entry, now, their_now)

    def _mirror(self, name: str, entry: dict[str, Any], now: float, their_now: float) -> None:
        """`their_now`: the peer's clock when it answered; a snapshot's age on its clock dates it on ours."""
        key = f"{self.prefix}/{name}"
        view = self.router.views.get(key)
        if view is None:
            view = self.router.views[key] = InstanceView(key, tuple(entry.get("models", ())), node=self.url)
        view.healthy = bool(entry.get("healthy"))
        text = entry.get("profile")
        if text and text not in self._profiles:
            try:
                self._profiles[text] = parse_profile(text, f"{self.url} {name}")
            except ProfileError as e:
                log.warning("peer %s: %s", self.url, e)
        view.profile = self._profiles.get(text) if text else None
        if entry.get("stats"):
            stats = stats_from_dict(entry["stats"])
            age = max(0.0, their_now - stats.time) if their_now else 0.0
            self.router.observe(key, stats, taken_at=now - age)

    async def forward(self, request: Request, body: dict, session: str, dispatcher: Dispatcher,
                      placement: Placement) -> Response:
        """Send the call to the peer; relay its answer (streamed or whole) and report the finish."""
        headers = {**self.headers, FORWARDED_HEADER: "1", "x-session-id": session, "content-type": "application/json"}
        req = self._client.build_request("POST", self.url + request.url.path, content=json.dumps(body).encode(),
                                         headers=headers)
        try:
            resp = await self._client.send(req, stream=True)
        except httpx.HTTPError as e:
            dispatcher.finished(placement, None, "", ())
            raise APIError(503, f"peer {self.url} did not take the call: {e}", UNAVAILABLE, None, "peer_unavailable",
                           {"Retry-After": str(RETRY_AFTER_S)}) from None
        kind = resp.headers.get("content-type", "application/json")
        passthrough = {k: v for k, v in resp.headers.items() if k in ("retry-after", "x-request-id")}
        if not kind.startswith("text/event-stream"):
            content = await resp.aread()
            await resp.aclose()
            dispatcher.finished(placement, _usage(content) if resp.status_code == 200 else None, "", ())
            return Response(content, resp.status_code, passthrough, media_type=kind.split(";")[0])

        async def relay() -> AsyncIterator[bytes]:
            seen, ok = b"", False
            try:
                async for chunk in resp.aiter_raw():
                    seen = (seen + chunk)[-4096:]  # the usage chunk and [DONE] come last
                    yield chunk
                ok = b"[DONE]" in seen
            finally:
                await resp.aclose()
                dispatcher.finished(placement, _stream_usage(seen, placement) if ok else None, "", ())
        return StreamingResponse(relay(), resp.status_code, passthrough, media_type="text/event-stream")


def _usage(content: bytes) -> Usage | None:
    try:
        u = json.loads(content)["usage"]
        return Usage(int(u["prompt_tokens"]), int(u["completion_tokens"]), 0)
    except (ValueError, KeyError, TypeError):
        return None


def _stream_usage(tail: bytes, placement: Placement) -> Usage:
    """The usage chunk if the client asked for one, else the prompt alone (a lease needs a length)."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            found = _usage(line[6:])
            if found is not None:
                return found
    return Usage(placement.request.prompt_tokens, 0, 0)
