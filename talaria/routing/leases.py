"""Soft reservations (paper §3.3): a returning session's claim on the instance that served it.

When a call completes, the router installs a lease `(session, model, instance, t_done,
t_exp = t_done + tau)`. The session's next call for the same model consumes it, provided the
instance is healthy and still holds the prefix (device-resident or host-restorable) — which the
router reads from the instance's listing of the session in its latest snapshot, not from the lease. Routing never
refreshes a lease: only the next completion installs a successor. While it lives a lease charges one
admission unit to its instance in the router's overlay, so unrelated arrivals do not take the
capacity the likely return will need. A lease is not a KV pin and guarantees nothing.

How long a lease lives is a small strategy chosen by `[router] lease_policy`:

- `fixed` (the paper's, App. E): every lease lives `lease_s`.
- `adaptive` (issue 20, beyond the paper): each session's tau comes from its own tool gaps, measured
  from a completion to the session's next call for that model and smoothed as TCP smooths round
  trips (`GapEstimate`, the estimator session_load.py uses for quiet sessions):
  `tau = srtt + 4 * rttvar`, at least `2 * srtt` and at most `max(lease_s, 10 s)`; `lease_s` until
  the session's first gap is seen. The paper picked tau as about the p90 of all sessions' gaps; a
  session's own smoothed bound follows a session whose tools are slower or faster than the crowd's.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from talaria.routing.session_load import QUIET_FIRST_S, GapEstimate

TAU_CEILING_S = QUIET_FIRST_S  # adaptive tau at most this (or lease_s if longer): the paper's replay caps gaps at 10 s
TAU_FLOOR_SRTT = 2.0  # adaptive tau at least this x the session's mean gap (RFC 793's beta): steady gaps have no variance

Key = tuple[str, str]  # (session, model)


@dataclass(frozen=True, slots=True)
class Lease:
    session: str
    model: str
    instance: str
    t_done: float
    t_exp: float  # t_done + tau


class FixedTau:
    """The paper's tau: every lease lives `first_s` (`lease_s`)."""

    def __init__(self, first_s: float, capacity: int = 0) -> None:  # capacity: nothing is remembered
        self.first_s = first_s

    def tau_s(self, key: Key) -> float:
        return self.first_s

    def completed(self, key: Key, now: float) -> None:
        """A call of `key` finished at `now` (nothing to learn)."""

    def arrived(self, key: Key, now: float) -> None:
        """A call of `key` arrived at `now` (nothing to learn)."""


@dataclass(slots=True)
class _Gaps:
    estimate: GapEstimate
    done_at: float | None  # the last completion whose next call has not arrived yet


class AdaptiveTau:
    """Per session and model, tau from its own tool gaps: `srtt + 4 * rttvar` of `GapEstimate`, within
    [`TAU_FLOOR_SRTT` x srtt, `max(first_s, TAU_CEILING_S)`]; `first_s` before its first gap.

    A gap is sampled once, when the first call after a completion arrives (asking again while held
    samples nothing), capped at the ceiling: no lease could have covered a longer one, and one long
    tool run should not hold the session at the ceiling for many turns. At most `capacity` sessions
    are remembered, the least recently served forgotten first (they start again from `first_s`).
    """

    def __init__(self, first_s: float, capacity: int = 100_000) -> None:
        self.first_s = first_s
        self.ceiling_s = max(first_s, TAU_CEILING_S)
        self._capacity = capacity
        self._sessions: OrderedDict[Key, _Gaps] = OrderedDict()  # least recently completed first

    def tau_s(self, key: Key) -> float:
        entry = self._sessions.get(key)
        bound = None if entry is None else entry.estimate.bound_s
        if bound is None:
            return self.first_s
        return min(self.ceiling_s, max(TAU_FLOOR_SRTT * entry.estimate.srtt, bound))

    def completed(self, key: Key, now: float) -> None:
        entry = self._sessions.get(key)
        if entry is None:
            entry = self._sessions[key] = _Gaps(GapEstimate(), now)
            while len(self._sessions) > self._capacity:
                self._sessions.popitem(last=False)
        entry.done_at = now
        self._sessions.move_to_end(key)

    def arrived(self, key: Key, now: float) -> None:
        entry = self._sessions.get(key)
        if entry is not None and entry.done_at is not None:
            entry.estimate.sample(min(self.ceiling_s, max(0.0, now - entry.done_at)))
            entry.done_at = None

    def __len__(self) -> int:
        return len(self._sessions)


TAU_POLICIES: dict[str, type[FixedTau | AdaptiveTau]] = {"fixed": FixedTau, "adaptive": AdaptiveTau}


class LeaseTable:
    """Live leases by (session, model), with per-instance counts for the admission overlay.

    Expiry is lazy and exact: `sweep(now)` pops every lease past its t_exp from a heap (stale heap
    entries of consumed or replaced leases are skipped), so lookups and counts stay O(1) at
    100,000 sessions.
    """

    def __init__(self, tau_s: float, on_expire: Callable[[Lease], None] | None = None,
                 tau: FixedTau | AdaptiveTau | None = None) -> None:
        self.tau_s = tau_s  # lease_s: 0 turns leases off whatever the policy
        self.tau = FixedTau(tau_s) if tau is None else tau  # each lease's lifetime
        self._leases: dict[tuple[str, str], Lease] = {}
        self._per_instance: dict[str, int] = {}
        self._per_model: dict[str, int] = {}
        self._heap: list[tuple[float, str, str]] = []  # (t_exp, session, model)
        self._on_expire = on_expire

    def install(self, session: str, model: str, instance: str, now: float) -> Lease | None:
        """After a completion; tau = 0 installs nothing (leases off)."""
        key = (session, model)
        self._drop(key)
        if self.tau_s <= 0:
            return None
        lease = Lease(session, model, instance, now, now + self.tau.tau_s(key))
        self.tau.completed(key, now)
        self._leases[(session, model)] = lease
        self._per_instance[instance] = self._per_instance.get(instance, 0) + 1
        self._per_model[model] = self._per_model.get(model, 0) + 1
        heapq.heappush(self._heap, (lease.t_exp, session, model))
        if len(self._heap) > 2 * len(self._leases) + 1024:  # consumed leases leave stale entries: compact
            self._heap = [(x.t_exp, x.session, x.model) for x in self._leases.values()]
            heapq.heapify(self._heap)
        return lease

    def arrived(self, session: str, model: str, now: float) -> None:
        """A call of the session arrived: the lease policy measures its tool gap (once per completion)."""
        self.tau.arrived((session, model), now)

    def get(self, session: str, model: str) -> Lease | None:
        """The session's lease for `model`, if any; live as of the last `sweep`."""
        return self._leases.get((session, model))

    def take(self, lease: Lease) -> None:
        """Consume (a matching return) or discard (a failed check) a lease."""
        self._drop((lease.session, lease.model))

    def count(self, instance: str) -> int:
        """Live leases charging `instance` (call `sweep` first for an exact figure)."""
        return self._per_instance.get(instance, 0)

    def count_model(self, model: str) -> int:
        """Live leases for `model`, on any instance: its reserved returns."""
        return self._per_model.get(model, 0)

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
            for counts, k in ((self._per_instance, lease.instance), (self._per_model, lease.model)):
                n = counts[k] - 1
                if n:
                    counts[k] = n
                else:
                    del counts[k]
