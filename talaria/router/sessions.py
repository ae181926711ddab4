"""Where each agent session was last served: the router's bounded session table.

One entry per (session, model): the instance that finished its last call, the KV length that call
left there, and when it finished. Entries live at most `ttl_s` after their call and at most
`capacity` exist; both bounds evict from the front, kept in finish order.
invariant: the OrderedDict is sorted by finish time because `put` moves its key to the end and the
clock is monotonic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class SessionTable:
    def __init__(self, ttl_s: float, clock: Callable[[], float], capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError(f"session table capacity must be >= 1, got {capacity}")
        self._ttl_s = ttl_s
        self._clock = clock
        self._capacity = capacity
        self._entries: OrderedDict[tuple[str, str], tuple[str, int, float]] = OrderedDict()

    def get(self, session: str, model: str, now: float | None = None) -> tuple[str, int] | None:
        """(instance, kv_tokens) of the session's last call if it finished at most `ttl_s` ago."""
        self._expire(self._clock() if now is None else now)
        entry = self._entries.get((session, model))
        return None if entry is None else entry[:2]

    def finished_at(self, session: str, model: str) -> float | None:
        entry = self._entries.get((session, model))
        return None if entry is None else entry[2]

    def put(self, session: str, model: str, instance: str, kv_tokens: int = 0) -> None:
        now = self._clock()
        key = (session, model)
        self._entries[key] = (instance, kv_tokens, now)
        self._entries.move_to_end(key)
        self._expire(now)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self, now: float) -> None:
        while self._entries:
            *_, done_at = next(iter(self._entries.values()))
            if now - done_at <= self._ttl_s:
                return
            self._entries.popitem(last=False)
