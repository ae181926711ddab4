"""Model switches by load path, for the switch-paths panel.

A switch is reported twice: once as a `switch` event, and in the instance's telemetry
`last_switches` (the last four records) for as long as it is recent. Both are folded here, and a
telemetry record is matched to the others by its contents, so connecting late still shows the last
switches and none is counted twice.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from typing import Any

from talaria.contracts.profile import PHASE_NAMES
from talaria.contracts.vocabulary import SwitchPath

KEEP_RECENT = 64
KEEP_LATENCIES = 1000  # per path, for the percentiles


@dataclass(frozen=True, slots=True)
class SwitchView:
    """One switch record, reduced to what the panel shows; phases are the slowest rank's, since a
    switch ends when its last rank does."""

    instance: str
    from_model: str | None
    to_model: str
    path: str
    total_ms: float
    phase_ms: tuple[float, ...]  # in PHASE_NAMES order
    staged_bytes: int  # the slowest rank's weights gathered device-to-device
    dirty_bytes: int  # of those, reloaded from host because KV overwrote them
    total_bytes: int  # the model's weights on that rank
    rebuilt_runtime: bool
    t: float | None  # node clock when it ended; None when learnt from telemetry

    @classmethod
    def from_record(cls, instance: str, r: dict[str, Any], t: float | None) -> SwitchView:
        ranks = r.get("ranks") or [{}]
        slowest = max(ranks, key=lambda x: x.get("total_ms", 0.0))
        phases = slowest.get("phase_ms", {})
        return cls(instance, r.get("from_model"), r["to_model"], r["path"], r["total_ms"],
                   tuple(phases.get(p, 0.0) for p in PHASE_NAMES), slowest.get("staged_bytes", 0),
                   slowest.get("dirty_bytes", 0), slowest.get("total_bytes", 0), r.get("rebuilt_runtime", False), t)

    @property
    def key(self) -> tuple:
        return self.instance, self.from_model, self.to_model, self.path, self.total_ms


class SwitchLog:
    """Counts and latencies by path, and the most recent switches."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._latencies: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=KEEP_LATENCIES))
        self._recent: deque[SwitchView] = deque(maxlen=KEEP_RECENT)

    def add(self, instance: str, record: dict[str, Any], t: float | None = None) -> None:
        """Fold a switch record; `t` is its event's time (None for a telemetry record).

        Events are never duplicates of each other (a simulator repeats identical switches), so an
        event only matches a record telemetry showed first, and takes its place."""
        view = SwitchView.from_record(instance, record, t)
        for i, known in enumerate(self._recent):
            if known.key == view.key and (t is None or known.t is None):
                if t is not None:
                    self._recent[i] = view
                return
        self._recent.append(view)
        self.counts[view.path] += 1
        self._latencies[view.path].append(view.total_ms)

    def paths(self) -> list[str]:
        """The known paths first, best first, then any other path seen."""
        known = [p.value for p in SwitchPath]
        return known + sorted(p for p in self.counts if p not in known)

    def percentile(self, path: str, q: float) -> float | None:
        """The nearest-rank q-quantile (0 < q <= 1) of the path's recent switch times, ms."""
        xs = sorted(self._latencies.get(path, ()))
        if not xs:
            return None
        return xs[max(0, math.ceil(q * len(xs)) - 1)]

    def recent(self, n: int) -> list[SwitchView]:
        """The last `n` switches, newest first."""
        return list(self._recent)[-n:][::-1] if n > 0 else []
