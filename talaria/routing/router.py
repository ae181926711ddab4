"""Session-aware residency routing (paper §3.3, §4.1, Algorithm 1, Eq. (1)-(2)).

The router decides which instance serves a call; it never runs tokens. It sees each instance
through an `InstanceView` (talaria/routing/instance_view.py): the latest telemetry snapshot, the
instance's cost profile, its health, and an overlay of what the router itself sent since that
snapshot. A call is placed by the configured policy (talaria/routing/policies.py); the full one:

1. **Lease.** A live lease for (session, model) on a healthy instance whose snapshot does not say
   the prefix is gone is consumed, and the call goes there (`lease-hit`). Otherwise the lease is
   discarded and placement continues.
2. **Cost ranking.** Each instance serving the model, with a fresh snapshot and healthy, gets
   `Cost = dR_req + C_kv + C_act` (Eq. (1), talaria/routing/costs.py) and must pass the
   round-admission and HBM checks.
3. **Replica rule.** Choosing an instance that must open a model another instance holds is a
   replica decision, allowed only when `gain > T_swap + mu * dW + nu` (Eq. (2)), where gain is what
   it saves over the best instance holding the model.
4. **Overload.** No candidate: the configured policy answers (reject with 429, queue, or spill to
   the least loaded instance anywhere, peers included). Under `sessions`, the gateway
   (talaria/routing/dispatcher.py) marks calls that open a session: they are admitted against the
   load of the sessions already admitted, tool gaps included (talaria/routing/session_load.py).

The comparison policies of §5.3 (`least-pressure`, `session-sticky`) use the same views. Time
comes from the injected clock; every decision carries its reason and cost terms for the event log.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from talaria.config.schema import Overload, ReplicaGain, RouterConfig
from talaria.contracts.events import EventKind
from talaria.contracts.telemetry import InstanceStats
from talaria.routing.costs import LOCATIONS, MISSING, Cost, PlacementCosts
from talaria.routing.decision import Reason, RouteDecision, RouteRequest
from talaria.routing.instance_view import InstanceView
from talaria.routing.leases import TAU_POLICIES, Lease, LeaseTable
from talaria.routing.policies import POLICIES
from talaria.routing.sessions import SessionTable


@dataclass
class RouterStats:
    decisions: Counter[Reason] = field(default_factory=Counter)  # see by_reason
    lease_hits: int = 0
    lease_misses: int = 0  # a lease existed but failed its checks
    lease_expiries: int = 0
    returns: int = 0  # calls of sessions seen before
    same_instance_returns: int = 0
    avoidable_opens: int = 0

    def by_reason(self) -> dict[str, int]:
        return {reason.value: n for reason, n in self.decisions.items()}


class Router:
    def __init__(self, config: RouterConfig, clock: Callable[[], float],
                 emit: Callable[..., None] | None = None) -> None:
        self.config = config
        self.clock = clock
        self.emit = emit  # emit(EventKind, **data) into the event log; None: nobody listens
        self.views: dict[str, InstanceView] = {}
        self.sessions = SessionTable(config.session_ttl_s, clock, config.max_sessions)
        self.leases = LeaseTable(config.lease_s, self._expired,
                                 TAU_POLICIES[config.lease_policy.value](config.lease_s, config.max_sessions))
        self.costs = PlacementCosts(config, self.leases)
        self.stats = RouterStats()
        self._policy = POLICIES[config.policy]
        self._mean_prompt: dict[str, float] = {}  # EWMA of routed prompt lengths, per model
        self._arrivals: dict[str, tuple[float, float | None]] = {}  # model -> (last arrival, EWMA of the gaps)
        self.local_only = False  # the call being routed may only go to this node's instances
        self.mean_prompt = 0  # the model's mean prompt, in tokens, for the call being routed

    # ---- state in ---------------------------------------------------------------------------

    def observe(self, name: str, snapshot: InstanceStats, taken_at: float | None = None) -> None:
        """A fresh snapshot: it now accounts for what was sent before it. `taken_at`: when the
        instance took it, on the router's clock (a local instance shares the node's monotonic clock);
        default now, for snapshots that arrive as they are taken (peers, tests)."""
        view = self.views[name]
        if view.snapshot is not None and snapshot.version <= view.snapshot.version:
            return
        view.snapshot, view.sent = snapshot, 0
        view.received_at = self.clock() if taken_at is None else taken_at
        view.listed = {(e.get("session"), e.get("model")):
                       (e.get("kv_tokens") or 0, LOCATIONS.get(e.get("location"), MISSING)) for e in snapshot.sessions}
        busy = {q.model for q in snapshot.queues if q.waiting or q.running}
        view.holds = frozenset(busy | {m for m in (snapshot.active_model, snapshot.staged_model) if m})
        view.terms = {}

    def sent(self, name: str) -> None:
        view = self.views[name]
        view.sent += 1
        view.in_flight += 1

    def finished(self, name: str) -> None:
        view = self.views.get(name)
        if view is not None and view.in_flight:
            view.in_flight -= 1

    def complete(self, req: RouteRequest, instance: str, kv_tokens: int) -> Lease | None:
        """A call finished normally: remember where the session is and install its lease."""
        if req.session is None:
            return None
        now = self.clock()
        self.sessions.put(req.session, req.model, instance, kv_tokens)
        lease = self.leases.install(req.session, req.model, instance, now)
        if lease is not None and self.emit is not None:
            self.emit(EventKind.LEASE, op="install", session=req.session, model=req.model, target=instance,
                      t_exp=lease.t_exp, kv_tokens=kv_tokens)
        return lease

    def _expired(self, lease: Lease) -> None:
        self.stats.lease_expiries += 1
        if self.emit is not None:
            self.emit(EventKind.LEASE, op="expire", session=lease.session, model=lease.model, target=lease.instance)

    # ---- the verb ---------------------------------------------------------------------------

    def route(self, req: RouteRequest, local: bool = False) -> RouteDecision:
        """Place one call; `local`: only this node's instances (a call a peer forwarded here).

        A lease hit is the hot path: it reads the lease and the instance's listing of the session,
        nothing else (the lease says where the session's last call finished and when)."""
        self.arrived(req)
        decision = self.decide(req, local)
        self.record(req, decision)
        return decision

    def arrived(self, req: RouteRequest) -> None:
        """A call arrived: its prompt joins the model's mean (what each call queued ahead is charged),
        and with `replica_gain = "window"` its time the model's arrival rate (`window_calls`)."""
        means = self._mean_prompt
        m = means.get(req.model)
        means[req.model] = req.prompt_tokens if m is None else 0.9 * m + 0.1 * req.prompt_tokens
        if self.config.replica_gain is not ReplicaGain.WINDOW:
            return
        now = self.clock()
        last, gap = self._arrivals.get(req.model, (None, None))
        if last is not None:
            gap = now - last if gap is None else 0.9 * gap + 0.1 * (now - last)
        self._arrivals[req.model] = (now, gap)

    def window_calls(self, model: str, window_s: float) -> float:
        """Calls of `model` predicted within the next `window_s`: its observed arrival rate over the
        window, plus its reserved returns (live leases); at least this one."""
        gap = self._arrivals.get(model, (None, None))[1]
        arriving = window_s / gap if gap else 0.0
        return max(1.0, arriving + self.leases.count_model(model))

    def decide(self, req: RouteRequest, local: bool = False) -> RouteDecision:
        """`route` without its bookkeeping: for a call held at the gateway asking again, which is
        counted (`record`) once, when it is placed or gives up, and does not move the mean prompt.
        A live lease is still consumed or discarded on the first ask."""
        now = self.clock()
        self.local_only = local
        leases = self.leases
        leases.sweep(now)
        if req.session is not None:
            leases.arrived(req.session, req.model, now)  # its tool gap, for an adaptive tau (once per completion)
        self.mean_prompt = int(self._mean_prompt.get(req.model, req.prompt_tokens))
        lease = last = None
        if req.session is not None:
            lease = leases.get(req.session, req.model)
            if lease is None:
                last = self.sessions.get(req.session, req.model, now)
        decision = self._policy.place(self, req, now, lease, last)
        previous = lease.instance if lease is not None else last.instance if last is not None else None
        if previous is not None:
            decision.same_instance = decision.instance == previous
        return decision

    def record(self, req: RouteRequest, decision: RouteDecision) -> None:
        """Count a decision in the statistics and emit its route event."""
        stats = self.stats
        same = decision.same_instance
        if same is not None:
            stats.returns += 1
            stats.same_instance_returns += same
        if decision.avoidable_open:
            stats.avoidable_opens += 1
        stats.decisions[decision.reason] += 1
        if self.emit is not None:
            c = decision.cost
            self.emit(EventKind.ROUTE, request=req.request_id, session=req.session, model=req.model,
                      target=decision.instance, reason=decision.reason.value, candidates=decision.candidates,
                      same_instance=same, avoidable_open=decision.avoidable_open, overload=decision.overload,
                      new_session=req.new_session, wait_s=decision.wait_s,
                      cost=None if c is None else {"total_s": c.total_s, "delta_r_s": c.delta_r_s, "c_kv_s": c.c_kv_s,
                                                    "c_act_s": c.c_act_s, "kv": c.kv, "opens": c.opens})

    def telemetry(self) -> dict:
        """Counters and live leases (with seconds left), for the dashboard and operators."""
        now, st = self.clock(), self.stats
        self.leases.sweep(now)
        return {
            "policy": self.config.policy.value, "lease_policy": self.config.lease_policy.value,
            "decisions": st.by_reason(),
            "lease_hits": st.lease_hits, "lease_misses": st.lease_misses, "lease_expiries": st.lease_expiries,
            "returns": st.returns, "same_instance_returns": st.same_instance_returns,
            "avoidable_opens": st.avoidable_opens, "sessions": len(self.sessions),
            "leases": [{"session": lease.session, "model": lease.model, "instance": lease.instance,
                        "expires_in_s": lease.t_exp - now} for lease in self.leases.all()[:256]],
            "views": {v.name: {"node": v.node, "healthy": v.healthy, "in_flight": v.in_flight,
                               "snapshot_age_s": now - v.received_at if v.snapshot is not None else None,
                               "admitted_sessions": len(v.load.work) if v.load is not None else None,
                               "load_s": round(v.load.total_s, 3) if v.load is not None else None}
                      for v in self.views.values()},
        }

    # ---- what the policies ask ------------------------------------------------------------------

    def overload(self, req: RouteRequest, closest: Cost | None = None, wait_s: float | None = None) -> RouteDecision:
        """No candidate passed the checks: the configured overload policy decides. `closest`: the
        candidate nearest to admitting the call, `wait_s` how far it is (for the gateway's hold and
        Retry-After); None when no candidate could be priced."""
        policy = self.config.overload
        if policy is Overload.SPILL:
            views = self.serving(req.model)
            if views:
                best = min(views, key=lambda v: (v.node is None, v.in_flight, v.name))  # peers first
                return RouteDecision(best.name, Reason.OVERLOAD, overload=policy.value)
        return RouteDecision(None, Reason.OVERLOAD, closest, overload=policy.value, wait_s=wait_s)

    def serving(self, model: str) -> list[InstanceView]:
        """Healthy instances serving `model` (only this node's for a forwarded call)."""
        local = self.local_only
        return [v for v in self.views.values() if v.healthy and model in v.models and not (local and v.node)]

    def fresh(self, model: str, now: float) -> list[InstanceView]:
        """Candidates for a new placement: healthy, serving `model`, with a snapshot not too old."""
        oldest = now - self.config.stale_s
        return [v for v in self.serving(model) if v.snapshot is not None and v.profile is not None
                and v.received_at >= oldest]

    def opens_held(self, view: InstanceView, model: str, now: float) -> bool:
        """Placing `model` on `view` opens it there while another fresh instance holds it."""
        if view.snapshot is None or model in view.holds:
            return False
        return any(model in v.holds for v in self.fresh(model, now) if v is not view)
