"""A call placed on another node's instance: forwarded there as the same request, answer relayed.

The request goes out as it came in, with the session id in `X-Session-Id` and
`X-Talaria-Forwarded: 1` so the peer serves it on its own instances rather than routing it again.
Streaming is preserved: the peer's SSE bytes are relayed as they arrive. The finish (with the usage
the peer reported) goes back to the dispatcher, so the session's lease points at the peer.

A peer that cannot be connected to never got the call: it is taken out of placement at once
(`PeerLink.unreachable`) and `PeerUnreachable` tells the gateway to place the call again, so a node
that died is no loss to the calls sent after it did. An error once connected is the call's own 503.

A client that goes away stops the call on the peer too, as it does a local one: the forward runs
under `CancelOnDisconnect` (a stream under `SSEResponse`, which watches the same way), and closing
the peer's response closes its connection, which the peer takes as its own client's disconnect.
"""

from __future__ import annotations

import json
import logging

import httpx
from starlette.requests import Request
from starlette.responses import Response

from talaria.contracts.call import Usage
from talaria.gateway.auth import TENANT_HEADER
from talaria.gateway.errors import RETRY_AFTER_S, UNAVAILABLE, APIError
from talaria.gateway.http import CLIENT_CLOSED
from talaria.gateway.sse import CancelOnDisconnect, SSEResponse
from talaria.routing.dispatcher import Dispatcher, Placement
from talaria.routing.peers import PeerLink

log = logging.getLogger(__name__)

FORWARDED_HEADER = "x-talaria-forwarded"


class PeerUnreachable(APIError):
    """No connection to the peer: the call was not sent, so it may be placed elsewhere."""


async def forward(peer: PeerLink, request: Request, body: dict, session: str, dispatcher: Dispatcher,
                  placement: Placement, tenant: str) -> Response:
    """Send the call to the peer, for `tenant` (which the peer takes from a call made with its
    peer key); relay its answer (streamed or whole) and report the finish."""
    headers = {**peer.headers, FORWARDED_HEADER: "1", "x-session-id": session, TENANT_HEADER: tenant,
               "content-type": "application/json"}
    req = peer.client.build_request("POST", peer.url + request.url.path, content=json.dumps(body).encode(),
                                    headers=headers)
    resp: httpx.Response | None = None
    relay: _Relay | None = None
    usage: Usage | None = None
    try:
        async with CancelOnDisconnect(request.receive) as watch:
            resp = await peer.client.send(req, stream=True)
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                relay = _Relay(resp, dispatcher, placement)
            else:
                content = await resp.aread()
                usage = _usage(content) if resp.status_code == 200 else None
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        peer.unreachable(f"{type(e).__name__}: {e}")
        raise PeerUnreachable(503, f"peer {peer.url} could not be reached: {e}", UNAVAILABLE, None,
                              "peer_unavailable", {"Retry-After": str(RETRY_AFTER_S)}) from None
    except httpx.HTTPError as e:
        raise APIError(503, f"peer {peer.url} did not answer the call: {e}", UNAVAILABLE, None, "peer_unavailable",
                       {"Retry-After": str(RETRY_AFTER_S)}) from None
    finally:
        if relay is None:  # else the relay closes the peer's response and reports the finish
            if resp is not None:
                await resp.aclose()  # mid-call (the client left): the peer sees its client leave
            dispatcher.finished(placement, usage, None, ())
    if watch.disconnected:
        if relay is not None:
            await relay.aclose()
        log.info("%s: client disconnected; the call forwarded to %s cancelled", request.url.path, peer.url)
        return Response(status_code=CLIENT_CLOSED)
    passthrough = {k: v for k, v in resp.headers.items() if k in ("retry-after", "x-request-id")}
    if relay is not None:
        return SSEResponse(relay, resp.status_code, passthrough)
    return Response(content, resp.status_code, passthrough,
                    media_type=resp.headers.get("content-type", "application/json").split(";")[0])


class _Relay:
    """The peer's SSE bytes as they arrive. `aclose`, which `SSEResponse` always calls (whether the
    stream ran out, stopped midway or never started), closes the peer's response, so a call the client
    left is cancelled there, and reports the finish: with its usage when the stream ended in [DONE]."""

    def __init__(self, resp: httpx.Response, dispatcher: Dispatcher, placement: Placement) -> None:
        self._resp, self._dispatcher, self._placement = resp, dispatcher, placement
        self._raw = resp.aiter_raw()
        self._tail = b""  # the usage chunk and [DONE] come last
        self._ended = False  # the peer's stream ran to its end
        self._closed = False

    def __aiter__(self) -> _Relay:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await anext(self._raw)
        except StopAsyncIteration:
            self._ended = True
            raise
        self._tail = (self._tail + chunk)[-4096:]
        return chunk

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._resp.aclose()
        finally:
            ok = self._ended and b"[DONE]" in self._tail
            self._dispatcher.finished(self._placement, _stream_usage(self._tail, self._placement) if ok else None,
                                      None, ())


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
