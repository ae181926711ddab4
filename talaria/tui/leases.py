"""The router's live leases, as the leases panel shows them.

`lease` events (docs/events.md, instance "router") are the primary source: `install` adds a lease
with its expiry on the node's clock, `consume`, `expire` and `discard` end it. The telemetry's
`router.leases` list is the router's own view at one instant; it repairs what the event stream
missed (a dashboard that connected after the buffer dropped an install, or that lost events while
behind). Because a snapshot can be older than the events already folded, it only adds a lease whose
key has not ended since the snapshot was taken, and only drops one installed before it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

ENDINGS = ("consume", "expire", "discard")
KEEP_ENDED = 4096  # keys whose last end is remembered, for reconciling older snapshots
LISTED_MAX = 256  # the router lists at most this many leases (talaria/gateway/admin.py)


@dataclass(frozen=True, slots=True)
class Lease:
    session: str
    model: str
    instance: str  # the event's `target`
    t_exp: float  # node clock
    installed: float  # node clock; t_exp - installed is the lease's length (lease_s)
    kv_tokens: int | None  # the KV the call left; unknown for a lease learnt from telemetry

    def remaining(self, now: float) -> float:
        """Seconds until expiry, not below 0 (the router expires lazily, on its next sweep) nor above
        the lease's length (the dashboard's clock estimate may trail the router's install by a moment)."""
        return min(self.t_exp - self.installed, max(0.0, self.t_exp - now))

    def fraction(self, now: float) -> float:
        """Share of the lease still ahead, 1 at install and 0 at expiry."""
        length = self.t_exp - self.installed
        return min(1.0, self.remaining(now) / length) if length > 0 else 0.0


class LeaseBook:
    """Live leases by (session, model), and how many of each lease operation were seen."""

    def __init__(self) -> None:
        self._live: dict[tuple[str, str], Lease] = {}
        self._ended: OrderedDict[tuple[str, str], float] = OrderedDict()  # key -> node time it last ended
        self.ops: Counter[str] = Counter()  # install / consume / expire / discard
        self.discards: Counter[str] = Counter()  # by reason: unhealthy, prefix-lost

    def apply(self, e: dict[str, Any]) -> None:
        """Fold one `lease` event."""
        op, key = e["op"], (e["session"], e["model"])
        self.ops[op] += 1
        if op == "install":
            self._live[key] = Lease(e["session"], e["model"], e["target"], e["t_exp"], e["t"], e.get("kv_tokens"))
        elif op in ENDINGS:
            self._live.pop(key, None)
            self._ended[key] = e["t"]
            self._ended.move_to_end(key)
            while len(self._ended) > KEEP_ENDED:
                self._ended.popitem(last=False)
            if op == "discard":
                self.discards[e.get("reason", "?")] += 1

    def reconcile(self, listed: list[dict[str, Any]], t: float) -> None:
        """Match the router's lease list from a snapshot taken at node time `t`."""
        seen = set()
        for item in listed:
            key = (item["session"], item["model"])
            seen.add(key)
            if key not in self._live and self._ended.get(key, float("-inf")) < t:
                t_exp = t + item["expires_in_s"]
                # the install time is unknown: take the snapshot's, so the countdown bar starts full
                self._live[key] = Lease(key[0], key[1], item["instance"], t_exp, min(t, t_exp), None)
        if len(listed) >= LISTED_MAX:  # a truncated list cannot say which leases are gone
            return
        for key, lease in list(self._live.items()):
            if key not in seen and lease.installed < t:
                del self._live[key]

    def live(self) -> list[Lease]:
        """Live leases, soonest expiry first."""
        return sorted(self._live.values(), key=lambda x: (x.t_exp, x.session, x.model))
