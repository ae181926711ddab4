"""A whole node in virtual time: the router, the instances and the agent sessions of a trace.

The trace is replayed as the paper's fixed closed loop (App. A): each session's calls go out in
order, each released its recorded gap (capped) after the previous response. Prompts are token
streams built from the trace's counts — a continuation reuses `reused_tokens` of the previous
prompt and output, then new tokens — so prefix hits, host restores and recomputes follow from the
same page hashes the live node computes. The router places every call from instance snapshots
refreshed on a heartbeat, exactly as the gateway does; instances run the live scheduler objects
(`SimInstance`). Output: per-session completion times, schedule-aware TTFTs, and the event log.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from talaria.config.schema import InstanceConfig, TalariaConfig
from talaria.contracts.call import (
    CallOutput,
    FinishReason,
    InstanceCall,
    SamplingParams,
)
from talaria.contracts.events import Event, EventKind
from talaria.contracts.profile import Profile, ProfileError
from talaria.contracts.trace import TraceCall, sessions
from talaria.routing.decision import RouteRequest
from talaria.routing.instance_view import InstanceView
from talaria.routing.router import Router
from talaria.sim import TOPOLOGY_GAMMA, TOPOLOGY_TPOT_S, TOPOLOGY_TTFT_S
from talaria.sim.instance import SimInstance
from talaria.sim.loop import EventLoop, VirtualClock

RETRY_S = 0.05  # a call the overload policy turned away asks again this much later


@dataclass(frozen=True, slots=True)
class SimOptions:
    gap_cap_s: float = 10.0  # the replay caps every tool gap (paper App. A: 20 of 960 gaps)
    heartbeat_s: float = 0.5  # instance snapshots reach the router this often
    seed: int = 0  # token streams
    keep_events: bool = False  # keep every event (for --events); counts are kept either way
    # a machine that drifts from its profile: instance -> (from this virtual time, steps take x factor).
    # A slowed instance's cost model learns from its step times, as a live one does (the others'
    # steps cost exactly what their profile says, so there is nothing for them to learn)
    slowdown: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(slots=True)
class CallRecord:
    session: str
    index: int
    intended: float  # when the replay meant to send it (previous response + capped gap)
    first_token: float | None = None
    done: float | None = None
    instance: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from device KV or restored from host
    switched_out: bool = False  # a continuation whose model its instance switched away from during its tool gap

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.intended


@dataclass
class SimResult:
    calls: list[CallRecord]
    sct_s: dict[str, float]  # session -> completion time (first intended enqueue -> last response)
    events: list[Event]
    counts: dict[str, int]  # events by kind
    switches: list[dict]  # path, total_ms
    rounds: list[dict]
    hbm_peak_bytes: int
    virtual_s: float
    wall_s: float
    router: dict = field(default_factory=dict)
    ttft_targets: dict[str, float] = field(default_factory=dict)  # instance -> its ttft_s


class Simulation:
    def __init__(self, config: TalariaConfig, profile: Profile, trace: list[TraceCall],
                 options: SimOptions = SimOptions()) -> None:
        self.config = config
        self.profile = profile
        self.options = options
        self.clock = VirtualClock()
        self.loop = EventLoop(self.clock)
        self.sessions = sessions(trace)
        self.router = Router(config.router, self.clock, self._router_event)
        self.instances: dict[str, SimInstance] = {}
        for inst in config.instances:
            slow = options.slowdown.get(inst.name)
            sim = SimInstance(inst, profile, self.loop, self._outputs, self._events, learn=slow is not None, slowdown=slow)
            self.instances[inst.name] = sim
            self.router.views[inst.name] = InstanceView(inst.name, inst.models, healthy=True, profile=profile)
        self.events: list[Event] = []
        self.counts: dict[str, int] = {}
        self.switches: list[dict] = []
        self.placements = 0  # calls placed on an instance
        self.residency_hits = 0  # ... where their model was active or staged
        self.rounds: list[dict] = []
        self.records: dict[str, CallRecord] = {}
        self._pending: dict[str, tuple[TraceCall, list[int], RouteRequest]] = {}  # request -> (call, prompt, req)
        self._context: dict[str, list[int]] = {}  # session -> its last prompt + output tokens
        self._outputs_of: dict[str, list[int]] = {}
        self._rng: dict[str, random.Random] = {}
        self._left_at: dict[tuple[str, str], float] = {}  # (instance, model) -> when a switch last took it off
        self._left = len(self.sessions)

    # ---- running ----------------------------------------------------------------------------

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        for name, calls in self.sessions.items():
            self.loop.at(calls[0].gap_s, lambda name=name: self._send(name, 0, self.clock()))
        self.loop.at(0.0, self._heartbeat)
        self.loop.run()
        sct = {}
        for name, calls in self.sessions.items():
            recs = [self.records[f"{name}#{c.index}"] for c in calls]
            if recs[-1].done is not None:
                sct[name] = recs[-1].done - recs[0].intended
        hbm = max((i.hbm_peak_bytes for i in self.instances.values()), default=0)
        return SimResult(list(self.records.values()), sct, self.events, self.counts, self.switches, self.rounds,
                         hbm, self.clock(), time.perf_counter() - t0,
                         {**_router_summary(self.router),
                          "model_residency_hit_rate": self.residency_hits / max(1, self.placements)},
                         {i.name: i.ttft_s for i in self.config.instances})

    def _heartbeat(self) -> None:
        for name, inst in self.instances.items():
            self.router.observe(name, inst.scheduler.stats(exact=False), taken_at=self.clock())
        if self._left:
            self.loop.after(self.options.heartbeat_s, self._heartbeat)

    def _send(self, session: str, index: int, intended: float) -> None:
        call = self.sessions[session][index]
        prompt = self._prompt(session, call)
        rid = f"{session}#{index}"
        self.records.setdefault(rid, CallRecord(session, index, intended))
        req = RouteRequest(call.model, session, len(prompt), max(1, call.completion_tokens), rid)
        self._route(call, prompt, req, self.clock())

    def _route(self, call: TraceCall, prompt: list[int], req: RouteRequest, since: float) -> None:
        decision = self.router.route(req)
        if decision.instance is None:
            if self.clock() - since < self.config.router.queue_timeout_s:
                self.loop.after(RETRY_S, lambda: self._route(call, prompt, req, since))
                return
            # the gateway would answer 429 now; the replay records the error and the session goes on
            rec = self.records[req.request_id]
            rec.done, rec.error = self.clock(), "rejected: no instance admitted the call"
            self._next(call, self.clock())
            return
        self.router.sent(decision.instance)
        record = self.records[req.request_id]
        record.instance = decision.instance
        if call.index:  # warm across a switch? its model left the instance after the previous call ended
            previous = self.records[f"{call.session}#{call.index - 1}"]
            left = self._left_at.get((decision.instance, call.model))
            record.switched_out = left is not None and previous.done is not None and left > previous.done
        self._pending[req.request_id] = (call, prompt, req)
        sampling = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        self.instances[decision.instance].add(InstanceCall(req.request_id, call.model, tuple(prompt), sampling,
                                                           call.session, enqueue_time=record.intended))

    def _prompt(self, session: str, call: TraceCall) -> list[int]:
        """The call's tokens: `reused_tokens` of the session's last prompt + output, then new ones."""
        rng = self._rng.setdefault(session, random.Random(f"{self.options.seed}:{session}"))
        context = self._context.get(session, [])
        reused = min(call.reused_tokens, len(context)) if call.index else 0
        return context[:reused] + list(rng.randbytes(max(1, call.prompt_tokens - reused)))

    # ---- instance callbacks -----------------------------------------------------------------

    def _outputs(self, inst: SimInstance, outputs: list[CallOutput]) -> None:
        now = self.clock()
        for out in outputs:
            rec = self.records.get(out.request_id)
            if rec is None:
                continue
            if out.token_ids and rec.first_token is None:
                rec.first_token = now
            self._outputs_of.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finish is None:
                continue
            call, prompt, req = self._pending.pop(out.request_id)
            generated = self._outputs_of.pop(out.request_id, [])
            rec.done = now
            if out.usage is not None:
                rec.prompt_tokens, rec.cached_tokens = out.usage.prompt_tokens, out.usage.cached_tokens
            if out.finish is FinishReason.ERROR:
                rec.error = out.error
            self.router.finished(inst.name)
            self.router.complete(req, inst.name, len(prompt) + len(generated) - 1)
            self._context[call.session] = prompt + generated
            self._next(call, now)

    def _next(self, call: TraceCall, now: float) -> None:
        """Release the session's next call after its (capped) gap, or count the session done."""
        calls = self.sessions[call.session]
        if call.index + 1 < len(calls):
            nxt = calls[call.index + 1]
            gap = min(nxt.gap_s, self.options.gap_cap_s)
            self.loop.after(gap, lambda s=call.session, i=nxt.index, t=now + gap: self._send(s, i, t))
        else:
            self._left -= 1

    def _events(self, events: list[Event]) -> None:
        for e in events:
            kind = e.kind
            self.counts[kind.value] = self.counts.get(kind.value, 0) + 1
            if kind is EventKind.SWITCH:
                self.switches.append({"path": e.data["path"], "total_ms": e.data["total_ms"], "t": e.t})
                if e.data.get("from_model") is not None:
                    self._left_at[(e.instance, e.data["from_model"])] = e.t
            elif kind is EventKind.ROUND:
                self.rounds.append(e.data)
            elif kind is EventKind.ROUTE and e.data.get("target") is not None:
                # model residency: the call landed where its model was active or staged (no open needed)
                self.placements += 1
                cost = e.data.get("cost")
                view = self.router.views.get(e.data["target"])
                snap = view.snapshot if view is not None else None
                held = cost["opens"] is False if cost else (snap is not None and e.data["model"] in
                                                            (snap.active_model, snap.staged_model))
                self.residency_hits += held
        if self.options.keep_events:
            self.events.extend(events)

    def _router_event(self, kind: EventKind, **data) -> None:
        self._events([Event(self.clock(), "router", kind, data)])


def _router_summary(router: Router) -> dict:
    st = router.stats
    return {"decisions": st.by_reason(), "lease_hits": st.lease_hits, "lease_misses": st.lease_misses,
            "lease_expiries": st.lease_expiries, "returns": st.returns,
            "same_instance_returns": st.same_instance_returns, "avoidable_opens": st.avoidable_opens}


FALLBACK_HOST_KV_BYTES = 200 << 30  # per rank, when the profile does not give the host's memory


def host_kv_per_rank(profile: Profile) -> int:
    """What the host holds for KV per rank once every model's weight image is pinned there (a cold
    instance keeps one per rank for each of its models): the host's memory less those images, split
    over the ranks. paper-tp8: (2 TB - 8 x 141.6 GB) / 8 = 108 GB."""
    if profile.host_bytes is None:
        return FALLBACK_HOST_KV_BYTES
    images = profile.tp * sum(m.weights_bytes for m in profile.models.values())
    if images >= profile.host_bytes:
        raise ProfileError(f"profile ({profile.hardware}): the weight images of its models ({images / 1e9:.0f} GB "
                           f"over {profile.tp} ranks) do not fit its host_bytes ({profile.host_bytes / 1e9:.0f} GB)")
    return (profile.host_bytes - images) // profile.tp


def profile_topology(profile: Profile, ttft_s: float = TOPOLOGY_TTFT_S, tpot_s: float = TOPOLOGY_TPOT_S,
                     gamma: float = TOPOLOGY_GAMMA, instances: int = 1) -> TalariaConfig:
    """The profile's own node: `instances` cold instances over every model, sized from the profile
    (80% of device memory for the managed arena, paper App. E; host KV per rank: `host_kv_per_rank`)."""
    from talaria.config.schema import Device, ModelConfig, Overload, Pool, RouterConfig
    insts = tuple(InstanceConfig(f"cold-{i}", Pool.COLD, tuple(profile.models), tp=profile.tp,
                                 device=Device(profile.device), arena_bytes=int(profile.device_bytes * 0.8),
                                 page_size=64, max_batch_tokens=8192, max_running=256,
                                 host_kv_bytes=host_kv_per_rank(profile),
                                 staging_chunk_bytes=512 << 20, ttft_s=ttft_s, tpot_s=tpot_s, gamma=gamma)
                  for i in range(instances))
    # the paper's node queues what it cannot admit yet: spill (to the least loaded instance) never rejects
    router = RouterConfig(overload=Overload.SPILL)
    return TalariaConfig(None, models=tuple(ModelConfig(m, "synthetic:") for m in profile.models), instances=insts,
                         router=router)
