"""Placement policies: the paper's full policy and the two it is compared with (§5.3).

Each is a small strategy object chosen by `[router] policy` from `POLICIES`, with one verb:
`place(router, req, now, lease, last)` gets the session's live lease (already looked up) or, without
one, where its last call finished, and returns a `RouteDecision`. The router does the bookkeeping
common to all of them (lease sweep, statistics, the route event).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from talaria.config.schema import ReplicaGain, RouterPolicy
from talaria.contracts.events import EventKind
from talaria.routing.costs import window_gain
from talaria.routing.decision import Reason, RouteDecision, RouteRequest
from talaria.routing.leases import Lease
from talaria.routing.sessions import LastCall

if TYPE_CHECKING:
    from talaria.routing.router import Router


class FullPolicy:
    """Paper Algorithm 1: a live lease is honoured where the prefix is kept; otherwise the cheapest
    candidate by Eq. (1) that passes round admission and HBM, a new replica only past Eq. (2)."""

    def place(self, router: Router, req: RouteRequest, now: float, lease: Lease | None,
              last: LastCall | None) -> RouteDecision:
        costs, emit = router.costs, router.emit
        if lease is not None:
            view = router.views.get(lease.instance)
            router.leases.take(lease)
            usable = view is not None and view.healthy and not (router.local_only and view.node is not None)
            if usable and costs.prefix_kept(view, req, lease):
                router.stats.lease_hits += 1
                if emit is not None:
                    emit(EventKind.LEASE, op="consume", session=req.session, model=req.model, target=lease.instance)
                return RouteDecision(lease.instance, Reason.LEASE_HIT, None, 0, False, lease)
            router.stats.lease_misses += 1
            if emit is not None:
                emit(EventKind.LEASE, op="discard", reason="unhealthy" if not usable else "prefix-lost",
                     session=req.session, model=req.model, target=lease.instance)
            last = router.sessions.get(req.session, req.model, now)
        fresh = router.fresh(req.model, now)
        feasible = []
        best_holder = holder_view = closest = None
        wait = 0.0
        for view in fresh:
            cost = costs.cost(view, req, last, router.mean_prompt)
            if cost is None:
                continue
            if not costs.admits(view, req, cost):
                excess = costs.excess_s(view, req, cost)
                if closest is None or excess < wait:
                    closest, wait = cost, excess
                continue
            feasible.append((view, cost))
            if not cost.opens and (best_holder is None or cost.total_s < best_holder.total_s):
                best_holder, holder_view = cost, view
        held = any(req.model in v.holds for v in fresh)
        best = None
        for view, cost in feasible:
            if cost.opens and held:  # Eq. (2): a replica must gain more than it costs, over a control window
                gain = math.inf
                if best_holder is not None:
                    gain = best_holder.total_s - (cost.delta_r_s + cost.c_kv_s)
                    if router.config.replica_gain is ReplicaGain.WINDOW:
                        window = router.window_calls(req.model, costs.terms(view, req.model).admit_s)
                        per_call = costs.terms(holder_view, req.model).per_call_s(router.mean_prompt)
                        gain = window_gain(gain, per_call, window)
                if not gain > costs.replica_price(view, req.model, cost):
                    continue
            if best is None or (cost.total_s, cost.instance) < (best.total_s, best.instance):
                best = cost
        if best is None:
            return router.overload(req, closest, wait if closest is not None else None)
        opens_held = best.opens and held
        return RouteDecision(best.instance, Reason.REPLICA if opens_held else Reason.RANKED, best, len(feasible),
                             opens_held)


class LeastPressurePolicy:
    """The instance serving the model with the fewest calls in flight."""

    def place(self, router: Router, req: RouteRequest, now: float, lease: Lease | None = None,
              last: LastCall | None = None) -> RouteDecision:
        views = router.serving(req.model)
        if not views:
            return router.overload(req)
        best = min(views, key=lambda v: (v.in_flight, v.name))
        return RouteDecision(best.name, Reason.LEAST_PRESSURE, None, len(views), router.opens_held(best, req.model, now))


class SessionStickyPolicy:
    """The session's last instance while its lease lives (healthy, prefix or not), else least-pressure."""

    def place(self, router: Router, req: RouteRequest, now: float, lease: Lease | None,
              last: LastCall | None) -> RouteDecision:
        if lease is not None:
            router.leases.take(lease)
            view = router.views.get(lease.instance)
            if view is not None and view.healthy and not (router.local_only and view.node is not None):
                router.stats.lease_hits += 1
                return RouteDecision(lease.instance, Reason.STICKY, None, 1,
                                     router.opens_held(view, req.model, now), lease)
            router.stats.lease_misses += 1
        return LEAST_PRESSURE.place(router, req, now)


LEAST_PRESSURE = LeastPressurePolicy()
POLICIES = {
    RouterPolicy.FULL: FullPolicy(),
    RouterPolicy.SESSION_STICKY: SessionStickyPolicy(),
    RouterPolicy.LEAST_PRESSURE: LEAST_PRESSURE,
}
