"""The cost terms of placement: Eq. (1) for a candidate instance and Eq. (2)'s replica price.

`Cost = dR_req + C_kv + C_act`, in seconds, each term charged once:
- `dR_req`: the queue ahead of the call (calls waiting or sent since the snapshot, and other
  sessions' live leases, each an admission unit), the wait for the model's slot on a cold instance
  where it is not active (the rest of the open round, plus the deadline risk below), the prefill of
  the prompt past the reusable prefix, and the decode of its tokens;
- `C_kv`: 0 for a device-resident prefix, its restore for a host-restorable one (with its state
  snapshot, for a model whose cache keeps per-sequence state), its recompute otherwise (and on every
  instance other than the session's own);
- `C_act`: 0 when the model is active there, the staged switch cost when it is staged, a full H2D
  open otherwise.
The reusable prefix follows the cache layout's resume rule (`KVLayout.resume_pages`): all of the
session's kept tokens for attention KV; for a stateful model only up to its last full page, where
the snapshot of its state was taken (`resumable`).
A candidate must also pass the round-admission check (the call would start within `admit_rounds`
rounds, or `max_queue_s` on a hot instance; a call with nothing ahead of it always passes) and the
HBM check (its KV fits the pool). A replica (an instance that must open a model another instance
holds) is worth it only when its gain beats `T_swap + mu * dW + nu` (Eq. (2)).

A call that opens a session (`RouteRequest.new_session`, overload = "sessions") is charged, as its
queue, at least what the sessions already admitted there will hold it back by (`InstanceView.load`:
their calls held or running and the next calls of those in tool gaps, each by at most the call's
own prefill, or the model's typical next call there if longer: processor sharing,
talaria/routing/session_load.py), must start within the instance's
TTFT target rather than the round-admission bound, and must leave every admitted session's prefix
room in the KV pool. `work_s` prices one call for that load.

Deadline risk: a cold instance reports its recent rounds (`RoundState.last_rounds`). When they ran
past their bound (`round_s`: slots overran their budgets, work was left for a later slot), the rest
of the open round, predicted from its budgets, is short by about as much: the mean overrun of those
rounds is added to the slot wait. Between rounds (an idle instance) there is no slot to wait for:
the call opens the next round itself (`slot_wait_s`). It makes such an instance a worse target and
its models' holders costlier, so Eq. (2) opens a replica elsewhere sooner (paper §3.3: "deadline-risk
telemetry makes an underestimated instance less attractive in subsequent decisions").

Every price is the profile's, scaled by what the instance measured against it
(`InstanceStats.cost_scale`: its EWMA of measured / profile-priced prefill, decode and opens by each
switch path), so a machine slower than its profile (other load, a profile taken elsewhere) is not
overcommitted, and placement moves away from it (tests/sim/test_router_learning.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from talaria.config.schema import RouterConfig
from talaria.contracts.kv_layout import KVLayout
from talaria.contracts.profile import ModelProfile
from talaria.contracts.telemetry import RoundState
from talaria.contracts.vocabulary import KVLocation, SwitchPath
from talaria.routing.decision import RouteRequest
from talaria.routing.instance_view import InstanceView
from talaria.routing.leases import Lease, LeaseTable
from talaria.routing.sessions import LastCall

GIB = float(1 << 30)
LOCATIONS = {loc.value: loc for loc in KVLocation}  # a snapshot's location, as sent (str) or pickled (enum)
DEVICE, HOST, MISSING = KVLocation.DEVICE, KVLocation.HOST, KVLocation.MISSING  # module globals: a decision
# compares them for every candidate, and a global is read 7x faster than an Enum class attribute


@dataclass(slots=True)
class Terms:
    """One model's call-independent cost terms on one instance, from its latest snapshot."""

    model: ModelProfile
    layout: KVLayout  # the model's cache in the instance's pages (ModelProfile.layout): the resume rule
    active: bool
    staged: bool
    c_act_s: float  # 0 active; the staged switch; else an H2D open
    slot_wait_s: float  # a cold instance where the model is not active: the rest of the round, plus its overrun
    free_pages: int  # KV pages the model's pool has free
    admit_s: float  # round admission: the latest start a call may be predicted to have
    ttft_s: float  # a new session's first call must start within this: the TTFT target (else admit_s)
    prefill_scale: float  # measured / profile-priced, from the snapshot's cost_scale (1: as priced)
    decode_scale: float

    def per_call_s(self, mean_prompt: int) -> float:
        """What each call queued here is charged: the prefill of the model's mean prompt."""
        return self.model.prefill.seconds(mean_prompt) * self.prefill_scale

    def resumable(self, reusable: int, kept: int) -> int:
        """Tokens of a kept prefix of `kept` tokens that a call reusing up to `reusable` of them resumes
        from: all `reusable` without per-sequence state; with it, the pages up to the snapshot taken at
        the prefix's last full page (none when the call reuses less than that). An upper bound: the
        instance published that snapshot only if a step ended there (a decode step, or the end of a
        prompt chunk), and its slot may have been taken since."""
        layout = self.layout
        if not layout.stateful:
            return reusable
        page = layout.page_size
        snapshot = kept // page
        return layout.resume_pages(reusable // page, lambda n: n == snapshot) * page


@dataclass(slots=True)
class Cost:
    """Eq. (1) for one candidate, in seconds; dR_req is split into its queue, prefill and decode."""

    instance: str
    queue_s: float  # calls ahead (and the wait for the model's slot on a cold instance)
    prefill_s: float  # the prompt past the reusable prefix
    decode_s: float  # the call's output tokens
    c_kv_s: float
    c_act_s: float
    kv: KVLocation  # what C_kv charged for the session's prefix
    opens: bool  # the instance must open the model: not active, staged or with calls queued there
    total_s: float  # dR_req + C_kv + C_act, summed once: a decision compares it many times

    @property
    def delta_r_s(self) -> float:
        return self.queue_s + self.prefill_s + self.decode_s

    @property
    def start_s(self) -> float:
        """Until the call's first token: what the round-admission check bounds."""
        return self.queue_s + self.c_act_s + self.c_kv_s + self.prefill_s


def window_gain(saving_s: float, per_call_s: float, calls: float) -> float:
    """Eq. (2)'s gain over a control window: what a replica saves the calls it would take in it.

    The first call saves `saving_s` (the best holder's cost less the replica's). Each call it takes
    makes the holder's queue one call's work (`per_call_s`) shorter and its own one longer, so the
    next saves twice that less; it takes calls while they still save, at most the `calls` the window
    brings. A window of one call, or a saving that is not positive, gives `saving_s` itself."""
    if saving_s <= 0 or calls <= 1:
        return saving_s
    k = calls if per_call_s <= 0 else min(calls, saving_s / (2 * per_call_s) + 1)
    k = max(1, int(k))
    return k * saving_s - per_call_s * k * (k - 1)  # sum over i < k of (saving - 2 i per_call)


def slot_wait_s(rounds: RoundState) -> float:
    """How long a call of a model that is not active waits for its slot: the rest of the open round,
    plus the deadline risk. Between rounds (an idle instance) nothing: the call opens the next round
    at once, and only its switch (C_act) is in its way; how far past rounds overran says nothing
    about a round not yet open."""
    if rounds.round is None:
        return 0.0
    return rounds.round_remaining_s + round_overrun_s(rounds)


def round_overrun_s(rounds: RoundState) -> float:
    """Deadline risk in seconds: how far the instance's recent rounds ran past their bound, on average
    (0 when they kept to it, or none has finished)."""
    if not rounds.last_rounds or rounds.round_s <= 0:
        return 0.0
    return sum(max(0.0, r["wall_s"] - rounds.round_s) for r in rounds.last_rounds) / len(rounds.last_rounds)


class PlacementCosts:
    """Eq. (1) and (2) over the router's views, with the router's knobs and its live leases."""

    def __init__(self, config: RouterConfig, leases: LeaseTable) -> None:
        self.config = config
        self.leases = leases

    def terms(self, view: InstanceView, model: str) -> Terms | None:
        """The model's call-independent terms on `view` (cached until its next snapshot)."""
        t = view.terms.get(model)
        if t is None:
            p, s = view.profile, view.snapshot
            mp = p.models.get(model)
            if mp is None:
                return None
            active, staged = s.active_model == model, s.staged_model == model
            scale = s.cost_scale
            if active:
                c_act = 0.0
            else:  # the open as priced, times what this instance measured for opens by that path
                coverage = s.substrate.get("staging_coverage", 0.0) if staged else 0.0
                path = SwitchPath.for_coverage(coverage).value
                c_act = p.switch_s(model, coverage) * scale.get(f"{model}/switch:{path}", 1.0)
            wait = slot_wait_s(s.rounds) if s.rounds is not None and not active else 0.0
            free = s.kv_pages_total - (s.kv_pages_used if active else 0)
            admit = self.config.admit_rounds * s.rounds.round_s if s.rounds is not None else self.config.max_queue_s
            layout = mp.layout(max(1, s.page_size))  # a snapshot without a page size: resume anywhere
            t = view.terms[model] = Terms(mp, layout, active, staged, c_act, wait, free, admit,
                                          admit if view.ttft_s is None else view.ttft_s,
                                          scale.get(f"{model}/prefill", 1.0), scale.get(f"{model}/decode", 1.0))
        return t

    def cost(self, view: InstanceView, req: RouteRequest, last: LastCall | None, mean_prompt: int) -> Cost | None:
        """Eq. (1) on `view`; `last`: where the session's previous call finished; `mean_prompt`:
        the model's mean prompt in tokens (what each call queued ahead is charged)."""
        t = self.terms(view, req.model)
        if t is None:
            return None
        mp = t.model  # its curves are the profile's prices (Profile.prefill_s and decode_s read the same)
        reusable, kv = 0, MISSING
        if last is not None:
            reusable = t.resumable(min(last.kv_tokens, max(0, req.prompt_tokens - 1)), last.kv_tokens)
            if last.instance == view.name:
                kv = self.location(view, req, last.done_at)
        p_scale = t.prefill_scale
        if kv is DEVICE:
            c_kv = 0.0
        elif kv is HOST:  # a stateful model restores the snapshot of its state too
            states = 1 if reusable and t.layout.stateful else 0
            c_kv = view.profile.restore_s(req.model, reusable, states) * p_scale
        else:
            c_kv = mp.prefill.seconds(reusable) * p_scale
        ahead = view.snapshot.waiting + view.sent + self.leases.count(view.name) * self.config.lease_unit
        queue = ahead * t.per_call_s(mean_prompt)
        batch = view.snapshot.running + 1
        decode = req.max_tokens * mp.decode.seconds(batch, batch * req.prompt_tokens) * t.decode_scale
        prefill = mp.prefill.seconds(req.prompt_tokens - reusable, reusable) * p_scale
        if req.new_session and view.load is not None:
            # two estimates of what holds it back: the snapshot's queue, and the admitted sessions' (tool gaps
            # too). Not the rest of the open round: that is where the round happens to be as the call arrives,
            # and would hand a burst's new sessions to whichever model's slot is open
            queue = max(queue, view.load.ahead_s(view.load.admit_x(req.model, prefill + c_kv)))
        else:
            queue += t.slot_wait_s
        return Cost(view.name, queue, prefill, decode, c_kv, t.c_act_s, kv, req.model not in view.holds,
                    queue + prefill + decode + c_kv + t.c_act_s)

    def work_s(self, view: InstanceView, model: str, prompt_tokens: int, reusable: int, max_tokens: int,
               footprint_tokens: int = 0) -> float | None:
        """Seconds of `view`'s time one call of `prompt_tokens` takes, `reusable` of them a kept prefix,
        with `max_tokens` out: what an admitted session charges its instance (talaria/routing/session_load.py).

        Its prefill past the prefix (as far as the resume rule lets it resume), and its share of
        `max_tokens` decode steps: the per-sequence and per-context terms only, as a step's fixed cost
        is paid once whatever the batch. When the admitted sessions' prefixes (`footprint_tokens`)
        outgrow the model's KV pool, they cannot all stay resident: the call is charged a full prefill.
        None while the instance has no snapshot or profile, or no price for the model."""
        if view.snapshot is None or view.profile is None:
            return None
        t = self.terms(view, model)
        if t is None:
            return None
        pool = view.snapshot.kv_pages_total * view.snapshot.page_size
        if pool and footprint_tokens > pool:
            reusable = 0
        reusable = t.resumable(min(reusable, max(0, prompt_tokens - 1)), reusable)
        mp = t.model
        prefill = mp.prefill.seconds(prompt_tokens - reusable, reusable)
        decode = max_tokens * (mp.decode.seconds(1, prompt_tokens) - mp.decode.base_s)
        return prefill * t.prefill_scale + decode * t.decode_scale

    def admits(self, view: InstanceView, req: RouteRequest, cost: Cost) -> bool:
        """Round admission (the call starts within `admit_rounds` rounds, or `max_queue_s` on a hot
        instance; a new session's first call waits at most the TTFT target for the work ahead) and HBM (its KV fits what the
        model's pool has free; a new session's also beside every admitted session's prefix). A call
        with nothing ahead of it is not refused for its own length: it could start no sooner on a retry."""
        if self.excess_s(view, req, cost) > 0:
            return False
        page = max(1, view.snapshot.page_size)
        need = req.prompt_tokens + req.max_tokens
        t = view.terms[req.model]
        pool = view.snapshot.kv_pages_total * page  # a new session leaves the admitted sessions' prefixes room
        if req.new_session and pool and cost.queue_s > 0 and view.load is not None \
                and view.load.kv.get(req.model, 0) + need > pool:
            return False
        return -(-need // page) <= t.free_pages

    def excess_s(self, view: InstanceView, req: RouteRequest, cost: Cost, signed: bool = False) -> float:
        """How far past its admission bound the call's predicted start is (0: within it): about how
        long until this instance would admit it, what a held call's patience and a 429's Retry-After
        are sized from. `signed`: within the bound, minus the room left (the admission line's promises
        start from it: those behind an admitted head may fit in the same room)."""
        t = view.terms[req.model]
        if req.new_session:  # only the wait others cause counts, up to the TTFT target or the call's
            # own prefill, whichever is longer: a prompt whose prefill alone outlasts the target (an
            # agent's 18K-token first call on a slow machine) is admitted while others at most double it
            x = cost.prefill_s + cost.c_kv_s
            if view.load is not None:
                x = view.load.admit_x(req.model, x)
            over = cost.queue_s + cost.c_act_s - max(t.ttft_s, x)
        else:
            over = cost.start_s - t.admit_s
        if cost.queue_s <= 0:  # nothing ahead of it: never refused for its own length
            over = min(0.0, over)
        return over if signed else max(0.0, over)

    def replica_price(self, view: InstanceView, model: str, cost: Cost) -> float:
        """T_swap + mu_j * dW_m + nu_m (Eq. (2)): what opening `model` on this instance must beat.

        mu_j = hbm_price_s_per_gib * (1 + pressure), the pressure the larger of the KV pool's
        occupancy and the staging shortfall: the share of the staging target's weights that could
        not be staged D2D before its switch, with the staging slack the snapshot reports (coverage +
        slack / weight bytes is the best D2D fraction reachable; paper §3.5: when slack falls the
        instance becomes a worse target). A snapshot without slack (the simulator's) has no shortfall."""
        s = view.snapshot
        pressure = s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 1.0
        mu = self.config.hbm_price_s_per_gib * (1.0 + max(pressure, self.staging_shortfall(view)))
        return cost.c_act_s + mu * view.terms[model].model.weights_bytes / GIB + self.config.replica_penalty_s

    @staticmethod
    def staging_shortfall(view: InstanceView) -> float:
        """1 - (staging coverage + slack / the target's weight bytes), in [0, 1]; 0 without a staging
        target, a profile price for it, or a reported slack."""
        s, sub = view.snapshot, view.snapshot.substrate
        slack = sub.get("staging_slack_bytes")
        target = view.profile.models.get(s.staged_model) if s.staged_model and view.profile else None
        if slack is None or target is None or not target.weights_bytes:
            return 0.0
        return 1.0 - min(1.0, sub.get("staging_coverage", 0.0) + slack / target.weights_bytes)

    @staticmethod
    def location(view: InstanceView, req: RouteRequest, done_at: float) -> KVLocation:
        """Where the instance says the session's prefix is. A snapshot older than the session's last
        completion cannot know, and a snapshot lists only its most recent sessions, so an unlisted
        prefix counts as kept (device) until a snapshot lists it elsewhere."""
        entry = view.listed.get((req.session, req.model))
        if entry is None or not entry[0]:
            return DEVICE  # unknown, or not one full page: nothing to lose, nothing to recompute
        if view.received_at <= done_at:
            return DEVICE
        return entry[1]

    @classmethod
    def prefix_kept(cls, view: InstanceView, req: RouteRequest, lease: Lease) -> bool:
        """The lease's instance still holds the session's prefix, on the device or the host."""
        if view.snapshot is None or view.received_at <= lease.t_done:
            return True
        return cls.location(view, req, lease.t_done) is not MISSING
