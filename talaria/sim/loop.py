"""Virtual time: a clock the policy objects read and a heapq loop of timed callbacks.

As in vidur, the loop knows nothing of LLMs: an event is a time and a callback, and callbacks
schedule their successors. Ties run in scheduling order, so a run is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import count


class VirtualClock:
    """`clock()` returns the simulated time; only the loop moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class EventLoop:
    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = count()
        self.events_run = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(t, self.clock.now), next(self._order), fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.clock.now + delay, fn)

    def run(self, until: float = float("inf"), max_events: int = 50_000_000) -> None:
        """Run callbacks in time order until none is left, `until` passes, or `max_events` ran."""
        while self._heap and self.events_run < max_events:
            t, _, fn = self._heap[0]
            if t > until:
                return
            heapq.heappop(self._heap)
            self.clock.now = t
            self.events_run += 1
            fn()
        if self._heap:
            raise RuntimeError(f"simulation stopped after {max_events} events with work left (a livelock?)")
