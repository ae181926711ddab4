"""The node's event log: numbers every event, keeps the recent ones, fans them out.

Events from every instance (and later the router) arrive here on the supervisor's event loop.
Each gets the next node-wide sequence number, goes into a bounded ring (so a dashboard that
connects late can replay from a sequence number), is appended to the JSONL file when one is
configured, is handed to every tap (a synchronous counter, such as the metrics' count of switches
by path), and is pushed to every live subscriber. A subscriber that falls behind loses its
oldest unread events rather than slowing the node down. The file never takes the node down: the
first write that fails (a full disk, a removed mount) is logged and the file sink turned off; the
ring and the subscribers go on.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from talaria.contracts.events import Event

log = logging.getLogger("talaria.node")

SUBSCRIBER_QUEUE = 1000  # events a slow subscriber may lag before it loses the oldest


class EventLog:
    def __init__(self, capacity: int = 10000, path: Path | None = None) -> None:
        self._ring: deque[Event] = deque(maxlen=capacity)
        self._next = 1
        self._subscribers: set[asyncio.Queue] = set()
        self._taps: list[Callable[[Event], None]] = []
        self._path = path
        self._file = path.open("a", encoding="utf-8") if path is not None else None

    def append(self, events: list[Event]) -> None:
        if not events:
            return
        first = self._next
        self._next += len(events)
        numbered = [Event(e.t, e.instance, e.kind, e.data, seq) for seq, e in enumerate(events, first)]
        self._ring.extend(numbered)
        if self._file is not None:
            try:
                self._file.write("".join(e.to_json() + "\n" for e in numbered))
                self._file.flush()
            except OSError as e:
                log.error("event log: writing %s failed (%s); events are no longer written to it", self._path, e)
                self._drop_file()
        for tap in self._taps:
            for e in numbered:
                try:
                    tap(e)
                except Exception:  # a tap is bookkeeping beside the log: it must not cost the node its events
                    log.exception("event log: a tap failed on a %s event", e.kind.value)
        for q in self._subscribers:
            for e in numbered:
                if q.full():
                    q.get_nowait()  # drop the oldest unread: never block the node on a slow reader
                q.put_nowait(e)

    def tap(self, fn: Callable[[Event], None]) -> None:
        """Call `fn` with every event from now on, as it is appended (on the appending thread)."""
        self._taps.append(fn)

    def since(self, seq: int) -> list[Event]:
        """Buffered events with a sequence number above `seq`."""
        return [e for e in self._ring if e.seq > seq]

    async def follow(self, since: int = 0) -> AsyncIterator[Event]:
        """Buffered events after `since`, then live ones, until the consumer stops."""
        q: asyncio.Queue = asyncio.Queue(SUBSCRIBER_QUEUE)
        self._subscribers.add(q)  # subscribe before replaying: nothing falls in between
        try:
            last = since
            for e in self.since(since):
                last = e.seq
                yield e
            while True:
                e = await q.get()
                if e.seq > last:
                    last = e.seq
                    yield e
        finally:
            self._subscribers.discard(q)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # what was buffered could not be written either
                pass
            self._file = None

    def _drop_file(self) -> None:
        file, self._file = self._file, None
        try:
            file.close()
        except OSError:
            pass
