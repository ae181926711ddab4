"""Session-aware residency routing (paper §3.3, §4.1, Algorithm 1, Eq. (1)-(2)).

The router decides which instance serves a call; it never runs tokens. It sees each instance
through an `InstanceView`: the latest telemetry snapshot, the instance's cost profile, its health,
and an overlay of what the router itself sent since that snapshot. A call is placed by:

1. **Lease.** A live lease for (session, model) on a healthy instance whose snapshot does not say
   the prefix is gone is consumed, and the call goes there (`lease-hit`). Otherwise the lease is
   discarded and placement continues.
2. **Cost ranking.** Each instance serving the model, with a fresh snapshot and healthy, gets
   `Cost = dR_req + C_kv + C_act` in seconds, each term charged once:
   - `dR_req`: the queue ahead of the call (calls waiting or sent since the snapshot, and other
     sessions' live leases, each an admission unit), the wait for the model's slot on a cold
     instance where it is not active, the prefill of the prompt past the reusable prefix, and the
     decode of its tokens;
   - `C_kv`: 0 for a device-resident prefix, its restore for a host-restorable one, its recompute
     otherwise (and on every instance other than the session's own);
   - `C_act`: 0 when the model is active there, the staged switch cost when it is staged, a full
     H2D open otherwise.
   Candidates must pass the round-admission check (the call would start within `admit_rounds`
   rounds, or `max_queue_s` on a hot instance) and the HBM check (its KV fits the pool).
3. **Replica rule.** Choosing an instance that must open a model another instance holds is a
   replica decision, allowed only when `gain > T_swap + mu * dW + nu` (Eq. (2)), where gain is what
   it saves over the best instance holding the model.
4. **Overload.** No candidate: the configured policy answers (reject with 429, queue, or spill to
   the least loaded instance anywhere, peers included).

The comparison policies of §5.3 (`least-pressure`, `session-sticky`) use the same views. Time
comes from the injected clock; every decision carries its reason and cost terms for the event log.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from talaria.config.schema import RouterConfig, RouterPolicy
from talaria.contracts.call import PrefixHandle
from talaria.contracts.profile import ModelProfile, Profile
from talaria.contracts.telemetry import InstanceStats
from talaria.routing.leases import Lease, LeaseTable
from talaria.routing.sessions import LastCall, SessionTable

GIB = float(1 << 30)


class Reason(str, Enum):
    LEASE_HIT = "lease-hit"  # a live lease was consumed
    RANKED = "ranked"  # the cheapest candidate holding the model (or nobody holds it)
    REPLICA = "replica"  # a new replica: the gain beat T_swap + mu*dW + nu
    STICKY = "sticky"  # session-sticky: the session's last instance
    LEAST_PRESSURE = "least-pressure"  # the instance with the fewest calls in flight
    OVERLOAD = "overload"  # no candidate passed the checks: the overload policy decides


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str
    session: str | None  # from X-Session-Id / session_id, or inferred by the continuity index
    prompt_tokens: int
    max_tokens: int
    request_id: str = ""


@dataclass(slots=True)
class InstanceView:
    """What the router knows about one instance; `node` is None here, a peer's base URL otherwise.

    `observe` derives from each snapshot what every decision reads, so a decision does dict lookups,
    not scans: the sessions it lists, the models it holds, and per model the cost terms that do not
    depend on the call (`terms`, filled lazily, cleared by the next snapshot)."""

    name: str
    models: tuple[str, ...]
    node: str | None = None
    healthy: bool = False
    snapshot: InstanceStats | None = None
    received_at: float = -math.inf  # router clock when the snapshot was taken (or arrived)
    profile: Profile | None = None
    sent: int = 0  # calls routed here since the snapshot (the in-flight overlay)
    in_flight: int = 0  # calls routed here and not finished
    # (session, model) -> (kv_tokens, location) of the snapshot's entry for it
    listed: dict[tuple[str, str], tuple[int, str]] = field(default_factory=dict)
    holds: frozenset[str] = frozenset()  # models active, staged or with work here
    terms: dict[str, _Terms] = field(default_factory=dict)


@dataclass(slots=True)
class _Terms:
    """One model's call-independent cost terms on one instance, from its latest snapshot."""

    model: ModelProfile
    active: bool
    staged: bool
    c_act_s: float  # 0 active; the staged switch; else an H2D open
    slot_wait_s: float  # a cold instance where the model is not active: the rest of the round
    free_pages: int  # KV pages the model's pool has free
    admit_s: float  # round admission: the latest start a call may be predicted to have


@dataclass(slots=True)
class Cost:
    """Eq. (1) for one candidate, in seconds; dR_req is split into its queue, prefill and decode."""

    instance: str
    queue_s: float  # calls ahead (and the wait for the model's slot on a cold instance)
    prefill_s: float  # the prompt past the reusable prefix
    decode_s: float  # the call's output tokens
    c_kv_s: float
    c_act_s: float
    kv: str  # device | host | missing: what C_kv charged for the session's prefix
    opens: bool  # the instance must open the model: not active, staged or with calls queued there
    total_s: float  # dR_req + C_kv + C_act, summed once: a decision compares it many times

    @property
    def delta_r_s(self) -> float:
        return self.queue_s + self.prefill_s + self.decode_s

    @property
    def start_s(self) -> float:
        """Until the call's first token: what the round-admission check bounds."""
        return self.queue_s + self.c_act_s + self.c_kv_s + self.prefill_s


@dataclass(slots=True)
class RouteDecision:
    """What `route` decided. Records on the decision path are plain slotted dataclasses, not frozen
    ones: a frozen dataclass's __init__ costs ~2 us here, and a lease hit has a 20 us budget."""

    instance: str | None  # None: rejected by the overload policy
    reason: Reason
    cost: Cost | None = None
    candidates: int = 0  # instances that passed both checks
    avoidable_open: bool = False  # the chosen instance opens a model another instance holds
    lease: Lease | None = None  # the lease consumed
    overload: str | None = None  # the overload policy applied
    same_instance: bool | None = None  # a returning session went back to its last instance (None: new)


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
        self._emit = emit  # emit(kind, **data) into the event log; None: nobody listens
        self.views: dict[str, InstanceView] = {}
        self.sessions = SessionTable(config.session_ttl_s, clock, config.max_sessions)
        self.leases = LeaseTable(config.lease_s, self._expired)
        self.stats = RouterStats()
        self._mean_prompt: dict[str, float] = {}  # EWMA of routed prompt lengths, per model
        self._local = False  # the call being routed may only go to this node's instances
        self._prompt = 0  # the model's mean prompt, in tokens, for the call being routed

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
        view.listed = {(e.get("session"), e.get("model")): (e.get("kv_tokens") or 0, e.get("location", "missing"))
                       for e in snapshot.sessions}
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
        prefix = PrefixHandle(instance, req.model, kv_tokens, 0)
        lease = self.leases.install(req.session, req.model, instance, prefix, now)
        if lease is not None and self._emit is not None:
            self._emit("lease", op="install", session=req.session, model=req.model, target=instance,
                       t_exp=lease.t_exp, kv_tokens=kv_tokens)
        return lease

    def _expired(self, lease: Lease) -> None:
        self.stats.lease_expiries += 1
        if self._emit is not None:
            self._emit("lease", op="expire", session=lease.session, model=lease.model, target=lease.instance)

    # ---- the verb ---------------------------------------------------------------------------

    def route(self, req: RouteRequest, local: bool = False) -> RouteDecision:
        """Place one call; `local`: only this node's instances (a call a peer forwarded here).

        A lease hit is the hot path: it reads the lease and the instance's listing of the session,
        nothing else (the lease says where the session's last call finished and when)."""
        now = self.clock()
        self._local = local
        leases, stats = self.leases, self.stats
        leases.sweep(now)
        means = self._mean_prompt
        m = means.get(req.model)
        m = means[req.model] = req.prompt_tokens if m is None else 0.9 * m + 0.1 * req.prompt_tokens
        self._prompt = int(m)
        lease = last = None
        if req.session is not None:
            lease = leases.get(req.session, req.model)
            if lease is None:
                last = self.sessions.get(req.session, req.model, now)
        policy = self.config.policy
        if policy is RouterPolicy.FULL:
            decision = self._full(req, now, lease, last)
        elif policy is RouterPolicy.SESSION_STICKY:
            decision = self._sticky(req, now, lease)
        else:
            decision = self._least_pressure(req, now)
        previous = lease.instance if lease is not None else last.instance if last is not None else None
        same = None
        if previous is not None:
            same = decision.same_instance = decision.instance == previous
            stats.returns += 1
            stats.same_instance_returns += same
        if decision.avoidable_open:
            stats.avoidable_opens += 1
        stats.decisions[decision.reason] += 1
        if self._emit is not None:
            c = decision.cost
            self._emit("route", request=req.request_id, session=req.session, model=req.model,
                       target=decision.instance, reason=decision.reason.value, candidates=decision.candidates,
                       same_instance=same, avoidable_open=decision.avoidable_open, overload=decision.overload,
                       cost=None if c is None else {"total_s": c.total_s, "delta_r_s": c.delta_r_s, "c_kv_s": c.c_kv_s,
                                                     "c_act_s": c.c_act_s, "kv": c.kv, "opens": c.opens})
        return decision

    def _full(self, req: RouteRequest, now: float, lease: Lease | None, last: LastCall | None) -> RouteDecision:
        if lease is not None:
            view = self.views.get(lease.instance)
            self.leases.take(lease)
            usable = view is not None and view.healthy and not (self._local and view.node is not None)
            if usable and self._prefix_kept(view, req, lease):
                self.stats.lease_hits += 1
                if self._emit is not None:
                    self._emit("lease", op="consume", session=req.session, model=req.model, target=lease.instance)
                return RouteDecision(lease.instance, Reason.LEASE_HIT, None, 0, False, lease)
            self.stats.lease_misses += 1
            if self._emit is not None:
                self._emit("lease", op="discard", reason="unhealthy" if not usable else "prefix-lost",
                           session=req.session, model=req.model, target=lease.instance)
            last = self.sessions.get(req.session, req.model, now)
        fresh = self._fresh(req.model, now)
        feasible = []
        best_holder = None
        for view in fresh:
            cost = self._cost(view, req, last)
            if cost is None or not self._admits(view, req, cost):
                continue
            feasible.append((view, cost))
            if not cost.opens and (best_holder is None or cost.total_s < best_holder.total_s):
                best_holder = cost
        held = any(req.model in v.holds for v in fresh)
        best = None
        for view, cost in feasible:
            if cost.opens and held:  # Eq. (2): a replica must gain more than it costs
                gain = math.inf if best_holder is None else best_holder.total_s - (cost.delta_r_s + cost.c_kv_s)
                if not gain > self._replica_price(view, req.model, cost):
                    continue
            if best is None or (cost.total_s, cost.instance) < (best.total_s, best.instance):
                best = cost
        if best is None:
            return self._overload(req)
        opens_held = best.opens and held
        return RouteDecision(best.instance, Reason.REPLICA if opens_held else Reason.RANKED, best, len(feasible),
                       opens_held)

    def _sticky(self, req: RouteRequest, now: float, lease: Lease | None) -> RouteDecision:
        if lease is not None:
            self.leases.take(lease)
            view = self.views.get(lease.instance)
            if view is not None and view.healthy and not (self._local and view.node is not None):
                self.stats.lease_hits += 1
                return RouteDecision(lease.instance, Reason.STICKY, None, 1, self._opens_held(view, req.model, now),
                               lease)
            self.stats.lease_misses += 1
        return self._least_pressure(req, now)

    def _least_pressure(self, req: RouteRequest, now: float) -> RouteDecision:
        views = self._serving(req.model)
        if not views:
            return self._overload(req)
        best = min(views, key=lambda v: (v.in_flight, v.name))
        return RouteDecision(best.name, Reason.LEAST_PRESSURE, None, len(views), self._opens_held(best, req.model, now))

    def _overload(self, req: RouteRequest) -> RouteDecision:
        policy = self.config.overload.value
        if policy == "spill":
            views = self._serving(req.model)
            if views:
                best = min(views, key=lambda v: (v.node is None, v.in_flight, v.name))  # peers first
                return RouteDecision(best.name, Reason.OVERLOAD, overload=policy)
        return RouteDecision(None, Reason.OVERLOAD, overload=policy)

    # ---- the terms --------------------------------------------------------------------------

    def _serving(self, model: str) -> list[InstanceView]:
        local = self._local
        return [v for v in self.views.values() if v.healthy and model in v.models and not (local and v.node)]

    def _fresh(self, model: str, now: float) -> list[InstanceView]:
        """Candidates for a new placement: healthy, serving `model`, with a snapshot not too old."""
        oldest = now - self.config.stale_s
        return [v for v in self._serving(model) if v.snapshot is not None and v.profile is not None
                and v.received_at >= oldest]

    def _terms(self, view: InstanceView, model: str) -> _Terms | None:
        t = view.terms.get(model)
        if t is None:
            p, s = view.profile, view.snapshot
            mp = p.models.get(model)
            if mp is None:
                return None
            active, staged = s.active_model == model, s.staged_model == model
            if active:
                c_act = 0.0
            else:
                coverage = s.substrate.get("staging_coverage", 0.0) if staged else 0.0
                c_act = p.switch_s(model, "full_d2d" if coverage >= 1.0 else "partial" if coverage > 0 else "h2d_only")
            wait = s.rounds.round_remaining_s if (s.rounds is not None and not active) else 0.0
            free = s.kv_pages_total - (s.kv_pages_used if active else 0)
            admit = self.config.admit_rounds * s.rounds.round_s if s.rounds is not None else self.config.max_queue_s
            t = view.terms[model] = _Terms(mp, active, staged, c_act, wait, free, admit)
        return t

    def _cost(self, view: InstanceView, req: RouteRequest, last: LastCall | None) -> Cost | None:
        t = self._terms(view, req.model)
        if t is None:
            return None
        mp = t.model
        reusable, kv = 0, "missing"
        if last is not None:
            reusable = min(last.kv_tokens, max(0, req.prompt_tokens - 1))
            if last.instance == view.name:
                kv = self._location(view, req, last.done_at)
        if kv == "device":
            c_kv = 0.0
        elif kv == "host":
            c_kv = reusable * mp.kv_bytes_per_token / view.profile.bandwidth.restore
        else:
            c_kv = mp.prefill.seconds(reusable)
        ahead = view.snapshot.waiting + view.sent + self.leases.count(view.name) * self.config.lease_unit
        queue = ahead * mp.prefill.seconds(self._prompt) + t.slot_wait_s
        batch = view.snapshot.running + 1
        decode = req.max_tokens * mp.decode.seconds(batch, batch * req.prompt_tokens)
        prefill = mp.prefill.seconds(req.prompt_tokens - reusable, reusable)
        return Cost(view.name, queue, prefill, decode, c_kv, t.c_act_s, kv, req.model not in view.holds,
                    queue + prefill + decode + c_kv + t.c_act_s)

    def _admits(self, view: InstanceView, req: RouteRequest, cost: Cost) -> bool:
        """Round admission (the call starts within `admit_rounds` rounds, or `max_queue_s` on a hot
        instance) and HBM (its KV fits what the model's pool has free)."""
        t = view.terms[req.model]
        if cost.start_s > t.admit_s:
            return False
        return -(-(req.prompt_tokens + req.max_tokens) // max(1, view.snapshot.page_size)) <= t.free_pages

    def _replica_price(self, view: InstanceView, model: str, cost: Cost) -> float:
        """T_swap + mu_j * dW_m + nu_m: what opening `model` on this instance must beat."""
        s = view.snapshot
        pressure = s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 1.0
        mu = self.config.hbm_price_s_per_gib * (1.0 + pressure)
        return cost.c_act_s + mu * view.terms[model].model.weights_bytes / GIB + self.config.replica_penalty_s

    def _opens_held(self, view: InstanceView, model: str, now: float) -> bool:
        if view.snapshot is None or model in view.holds:
            return False
        return any(model in v.holds for v in self._fresh(model, now) if v is not view)

    def _location(self, view: InstanceView, req: RouteRequest, done_at: float) -> str:
        """Where the instance says the session's prefix is. A snapshot older than the session's last
        completion cannot know, and a snapshot lists only its most recent sessions, so an unlisted
        prefix counts as kept (device) until a snapshot lists it elsewhere."""
        entry = view.listed.get((req.session, req.model))
        if entry is None or not entry[0]:
            return "device"  # unknown, or not one full page: nothing to lose, nothing to recompute
        if view.received_at <= done_at:
            return "device"
        return entry[1]

    def _prefix_kept(self, view: InstanceView, req: RouteRequest, lease: Lease) -> bool:
        if view.snapshot is None or view.received_at <= lease.t_done:
            return True
        return self._location(view, req, lease.t_done) in ("device", "host")
