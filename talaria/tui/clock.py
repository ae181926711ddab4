"""The node's clock as the dashboard sees it.

Event times, lease expiries (`t_exp`) and snapshot times are all on the node's monotonic clock,
whose origin is arbitrary and which need not be this machine's. The dashboard therefore never
compares them with its own clock directly: it anchors a `NodeClock` to a node time it has just
seen (the telemetry `time` field when live, the event being played when replaying) and lets it run
from there on the local clock, `rate` times as fast (a replay's speed factor).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class NodeClock:
    """Node time, extrapolated from the last anchor on an injected local clock."""

    def __init__(self, local: Callable[[], float] = time.monotonic, rate: float = 1.0) -> None:
        self._local = local
        self.rate = rate
        self._node_t: float | None = None  # node time at the anchor
        self._local_t = 0.0  # local time at the anchor
        self.paused = False

    def anchor(self, node_t: float) -> None:
        """The node's clock reads `node_t` now."""
        self._node_t, self._local_t = node_t, self._local()

    def now(self) -> float | None:
        """The node's clock now; None until the first anchor."""
        if self._node_t is None or self.paused:
            return self._node_t
        return self._node_t + (self._local() - self._local_t) * self.rate

    def pause(self) -> None:
        """Stop at the current reading (a paused replay); `resume` runs on from there."""
        self._node_t, self.paused = self.now(), True

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            if self._node_t is not None:
                self.anchor(self._node_t)
