"""Server-sent events that stop the moment the client goes away, under any ASGI version."""

from __future__ import annotations

import logging

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always stops its body when the client disconnects and
    always closes the body iterator, whatever ASGI spec version the server speaks.

    Starlette's StreamingResponse listens for disconnects only under ASGI < 2.4 and never closes the
    iterator when cancelled between chunks; both would leave a call decoding for nobody.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_disconnect, receive, tg.cancel_scope)
            try:
                await self.stream_response(send)
            except OSError:  # ASGI 2.4 servers raise on send once the client is gone
                log.info("client went away mid-stream")
            tg.cancel_scope.cancel()

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[union-attr]


async def cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Wait until the client disconnects, then cancel `scope` (the work done on its behalf)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
