"""Where each agent session was last served: the router's bounded session table.

One entry per (session, model): the instance that finished its last call, the KV length that call
left there, and when it finished. Entries live at most `ttl_s` after their call and at most
`capacity` exist. `get` ignores an entry past its ttl; `put` evicts from the front, kept in finish
order, so a lookup touches only its own entry (at 100,000 sessions every other touch is a cache miss).
invariant: the OrderedDict is sorted by finish time because `put` moves its key to the end and the
clock is monotonic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple


class LastCall(NamedTuple):
    instance: str
    kv_tokens: int
    done_at: float


class SessionTable:
    def __init__(self, ttl_s: float, clock: Callable[[], float], capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError(f"session table capacity must be >= 1, got {capacity}")
        self._ttl_s = ttl_s
        self._clock = clock
        self._capacity = capacity
        self._entries: OrderedDict[tuple[str, str], LastCall] = OrderedDict()

    def get(self, session: str, model: str, now: float | None = None) -> LastCall | None:
        """The session's last call on `model` if it finished at most `ttl_s` ago."""
        entry = self._entries.get((session, model))
        if entry is None or (self._clock() if now is None else now) - entry.done_at > self._ttl_s:
            return None
        return entry

    def put(self, session: str, model: str, instance: str, kv_tokens: int = 0) -> None:
        now = self._clock()
        key = (session, model)
        self._entries[key] = LastCall(instance, kv_tokens, now)
        self._entries.move_to_end(key)
        while self._entries and now - next(iter(self._entries.values())).done_at > self._ttl_s:
            self._entries.popitem(last=False)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        """Entries held, expired ones not yet evicted by a `put` included."""
        return len(self._entries)
