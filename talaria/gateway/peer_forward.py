"""A call placed on another node's instance: forwarded there as the same request, answer relayed.

The request goes out as it came in, with the session id in `X-Session-Id` and
`X-Talaria-Forwarded: 1` so the peer serves it on its own instances rather than routing it again.
Streaming is preserved: the peer's SSE bytes are relayed as they arrive. The finish (with the usage
the peer reported) goes back to the dispatcher, so the session's lease points at the peer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from talaria.contracts.call import Usage
from talaria.gateway.errors import RETRY_AFTER_S, UNAVAILABLE, APIError
from talaria.routing.dispatcher import Dispatcher, Placement
from talaria.routing.peers import PeerLink

FORWARDED_HEADER = "x-talaria-forwarded"


async def forward(peer: PeerLink, request: Request, body: dict, session: str, dispatcher: Dispatcher,
                  placement: Placement) -> Response:
    """Send the call to the peer; relay its answer (streamed or whole) and report the finish."""
    headers = {**peer.headers, FORWARDED_HEADER: "1", "x-session-id": session, "content-type": "application/json"}
    req = peer.client.build_request("POST", peer.url + request.url.path, content=json.dumps(body).encode(),
                                    headers=headers)
    try:
        resp = await peer.client.send(req, stream=True)
    except httpx.HTTPError as e:
        dispatcher.finished(placement, None, None, ())
        raise APIError(503, f"peer {peer.url} did not take the call: {e}", UNAVAILABLE, None, "peer_unavailable",
                       {"Retry-After": str(RETRY_AFTER_S)}) from None
    kind = resp.headers.get("content-type", "application/json")
    passthrough = {k: v for k, v in resp.headers.items() if k in ("retry-after", "x-request-id")}
    if not kind.startswith("text/event-stream"):
        content = await resp.aread()
        await resp.aclose()
        dispatcher.finished(placement, _usage(content) if resp.status_code == 200 else None, None, ())
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
            dispatcher.finished(placement, _stream_usage(seen, placement) if ok else None, None, ())
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
