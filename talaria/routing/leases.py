"""Soft reservations (paper §3.3): a returning session's claim on the instance that served it.

When a call completes, the router installs a lease `(session, model, instance, t_done,
t_exp = t_done + tau)`. The session's next call for the same model consumes it, provided the
instance is healthy and still holds the prefix (device-resident or host-restorable) — which the
router reads from the instance's listing of the session in its latest snapshot, not from the lease. Routing never
refreshes a lease: only the next completion installs a successor. While it lives a lease charges one
admission unit to its instance in the router's overlay, so unrelated arrivals do not take the
capacity the likely return will need. A lease is not a KV pin and guarantees nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Lease:
    session: str
    model: str
    instance: str
    t_done: float
    t_exp: float  # t_done + tau


class LeaseTable:
    """Live leases by (session, model), with per-instance counts for the admission overlay.

    Expiry is lazy and exact: `sweep(now)` pops every lease past its t_exp from a heap (stale heap
    entries of consumed or replaced leases are skipped), so lookups and counts stay O(1) at
    100,000 sessions.
    """

    def __init__(self, tau_s: float, on_expire: Callable[[Lease], None] | None = None) -> None:
        self.tau_s = tau_s
        self._leases: dict[tuple[str, str], Lease] = {}
        self._per_instance: dict[str, int] = {}
        self._heap: list[tuple[float, str, str]] = []  # (t_exp, session, model)
        self._on_expire = on_expire

    def install(self, session: str, model: str, instance: str, now: float) -> Lease | None:
        """After a completion; tau = 0 installs nothing (leases off)."""
        self._drop((session, model))
        if self.tau_s <= 0:
            return None
        lease = Lease(session, model, instance, now, now + self.tau_s)
        self._leases[(session, model)] = lease
        self._per_instance[instance] = self._per_instance.get(instance, 0) + 1
        heapq.heappush(self._heap, (lease.t_exp, session, model))
        if len(self._heap) > 2 * len(self._leases) + 1024:  # consumed leases leave stale entries: compact
            self._heap = [(x.t_exp, x.session, x.model) for x in self._leases.values()]
            heapq.heapify(self._heap)
        return lease

    def get(self, session: str, model: str) -> Lease | None:
        """The session's lease for `model`, if any; live as of the last `sweep`."""
        return self._leases.get((session, model))

    def take(self, lease: Lease) -> None:
        """Consume (a matching return) or discard (a failed check) a lease."""
        self._drop((lease.session, lease.model))

    def count(self, instance: str) -> int:
        """Live leases charging `instance` (call `sweep` first for an exact figure)."""
        return self._per_instance.get(instance, 0)

    def sweep(self, now: float) -> None:
        while self._heap and self._heap[0][0] < now:
            t_exp, session, model = heapq.heappop(self._heap)
            lease = self._leases.get((session, model))
            if lease is not None and lease.t_exp == t_exp:
                self._drop((session, model))
                if self._on_expire is not None:
                    self._on_expire(lease)

    def __len__(self) -> int:
        return len(self._leases)

    def all(self) -> list[Lease]:
        return list(self._leases.values())

    def _drop(self, key: tuple[str, str]) -> None:
        lease = self._leases.pop(key, None)
        if lease is not None:
            n = self._per_instance[lease.instance] - 1
            if n:
                self._per_instance[lease.instance] = n
            else:
                del self._per_instance[lease.instance]
