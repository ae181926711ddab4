"""Client disconnects: the work done for a request stops the moment its client goes away.

`CancelOnDisconnect` watches a request's `receive` channel in one asyncio task and cancels the
request's own task when `http.disconnect` arrives; the cancellation ends at the `async with`. An
anyio task group does the same job for about thirty times the cost, which on a 1-token completion
was a tenth of everything the gateway adds. `SSEResponse` streams under such a watch.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType
from typing import Self

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)


async def client_left(receive: Receive) -> None:
    """Returns once the client has disconnected; for a request whose body is read (a call held
    before it is placed, talaria/routing/dispatcher.py). Cancelling it consumes nothing."""
    while (await receive())["type"] != "http.disconnect":
        pass


class CancelOnDisconnect:
    """`async with CancelOnDisconnect(receive) as watch:` runs its body in the current task and
    cancels the body if the client disconnects meanwhile; `watch.disconnected` then says so.

    Only its own cancellation ends at the `async with`: one the task was already under when the
    client left (server shutdown) is not doubled, and one that arrives beside it propagates. The
    body must not swallow CancelledError. asyncio delivers a cancellation once, so `finally`
    clauses in the body (closing an instance stream) may await after it.
    """

    __slots__ = ("_baseline", "_ours", "_receive", "_task", "_watcher", "disconnected")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.disconnected = False
        self._ours = False  # the watcher cancelled the task

    async def __aenter__(self) -> Self:
        self._task = asyncio.current_task()
        self._baseline = self._task.cancelling()
        self._watcher = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        self._watcher.cancel()
        if not self._ours:
            return False
        others = self._task.uncancel() > self._baseline  # someone else cancelled too: theirs goes on
        return not others and exc_type is not None and issubclass(exc_type, asyncio.CancelledError)

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        if self._task.cancelling() == self._baseline:  # not being cancelled already
            self._ours = True
            self._task.cancel()


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always stops its body when the client disconnects and
    always closes the body iterator, whatever ASGI spec version the server speaks.

    Starlette's StreamingResponse listens for disconnects only under ASGI < 2.4 and never closes the
    iterator when cancelled between chunks; both would leave a call decoding for nobody.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with CancelOnDisconnect(receive):
            try:
                await self.stream_response(send)
            except OSError:  # ASGI 2.4 servers raise on send once the client is gone
                log.info("client went away mid-stream")

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]
