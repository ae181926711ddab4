"""What one client may hold, and for how long: `[server] max_connections` and `send_timeout_s`
(`read_timeout_s` is `read_json`'s deadline, talaria/gateway/http.py).

`ConnectionLimit` bounds the requests in progress. HTTP/1.1 carries one request at a time on a
connection, so that is the number of busy connections; an idle keep-alive connection holds no call
and uvicorn closes it after KEEP_ALIVE_S. Requests over the limit get 503 in their API's error shape, with
Retry-After and `connection: close`. uvicorn's own `limit_concurrency` is not used: it answers
`text/plain` "Service Unavailable" (no OpenAI or Anthropic client parses that), refuses `/health`
too, and counts every open connection, the idle ones and the asking one included, so it serves at
most limit - 1.

`send_deadline_protocol` drops a client that stops reading. Once the kernel's buffers are full,
the transport keeps what they refuse and, past 64 KiB, pauses; uvicorn's `send` then waits for it
to resume. A timeout around `send` would end the request but not the connection, whose `close()`
waits for the buffered bytes to drain, for ever; and a whole response, written by one `send`, never
waits at all. So the deadline sits on the transport: while it is paused it is looked at every
`send_timeout_s / LOOKS`, its buffer shrinks only as the client reads, and LOOKS looks in a row
that find it no smaller abort the connection. A client that reads something at least every
`send_timeout_s` is never dropped, however slowly; one that stops is dropped `send_timeout_s` (and
a look at most) after its last read or after the buffers filled, whichever came later. uvicorn then
sees the connection lost: `send` returns, `receive` answers `http.disconnect`, and
`CancelOnDisconnect` cancels the request, so the generation closes its instance stream (CancelCall)
and the call's routing state is released.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from talaria.gateway.errors import RETRY_AFTER_S, UNAVAILABLE, APIError
from talaria.gateway.http import shaped

log = logging.getLogger(__name__)

# Idle keep-alive connections are closed after this, longer than clients keep them pooled (httpx, and so the
# OpenAI and Anthropic SDKs, 5 s; aiohttp 15 s): with uvicorn's default of 5 s a client reusing a connection
# idle for about 5 s races the server's close and gets a connection reset instead of an answer, as clients
# that slept a Retry-After of about that long do
KEEP_ALIVE_S = 30
UNLIMITED_PATHS = frozenset({"/health", "/metrics"})  # probes: the event loop answers them, never an instance
LOOKS = 4  # looks at a paused transport per send_timeout_s


class ConnectionLimit:
    """ASGI middleware: at most `limit` requests in progress, `/health` and `/metrics` aside (a
    node at its limit must still tell its probes and scrapers how it is)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.busy = 0  # requests in progress, refused ones excluded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.busy >= self.limit:
            await self._refuse(scope, receive, send)
            return
        self.busy += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.busy -= 1

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        log.info("503: %d requests in progress (server.max_connections); refused %s", self.busy, scope["path"])
        error = APIError(503, f"the server is serving its limit of {self.limit} connections "
                         "(server.max_connections); retry shortly", UNAVAILABLE, None, "too_many_connections")
        headers = {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"}  # frees the socket too
        await JSONResponse(shaped(error, scope["path"]), 503, headers)(scope, receive, send)


def send_deadline_protocol(send_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools, else h11) that aborts a connection whose client has read
    nothing for `send_timeout_s` seconds while its buffers are full. Pass it as uvicorn's `http`."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    look_s = send_timeout_s / LOOKS

    class SendDeadline(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        # Only asyncio.Protocol's own methods are overridden: the transport calls pause_writing when
        # its buffer passes the high-water mark and resume_writing once it is down to the low one;
        # uvicorn's FlowControl gates `send` on the same two calls.
        _transport: asyncio.Transport
        _look: asyncio.TimerHandle | None = None  # the next look; set while paused
        _held = 0  # bytes the transport held at the last look
        _quiet = 0  # looks in a row that found nothing read

        def connection_made(self, transport: Any) -> None:
            self._transport = transport
            super().connection_made(transport)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._look is None:
                self._held, self._quiet = self._transport.get_write_buffer_size(), 0
                self._look = asyncio.get_running_loop().call_later(look_s, self._check)

        def resume_writing(self) -> None:
            self._stop_looking()
            super().resume_writing()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_looking()
            super().connection_lost(exc)

        def _stop_looking(self) -> None:
            if self._look is not None:
                self._look.cancel()
                self._look = None

        def _check(self) -> None:
            held = self._transport.get_write_buffer_size()
            self._quiet = 0 if held < self._held else self._quiet + 1  # it shrinks only as the client reads
            self._held = held
            if self._quiet < LOOKS:
                self._look = asyncio.get_running_loop().call_later(look_s, self._check)
                return
            self._look = None
            log.info("%s read nothing for %gs (server.send_timeout_s): connection dropped",
                     self._transport.get_extra_info("peername"), send_timeout_s)
            self._transport.abort()  # connection_lost follows: the request sees http.disconnect

    return SendDeadline
