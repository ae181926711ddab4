"""The per-instance telemetry snapshot: what the router, the dashboard and /talaria/telemetry see.

Rank 0 of each engine group builds an `InstanceStats` from its scheduler and sends it to the
supervisor beside its outputs; `version` increases with every snapshot so a consumer can tell a
fresh one from a stale one. `GET /talaria/telemetry` answers with a `NodeTelemetry` envelope: one
`InstanceTelemetry` per local instance (its snapshot as `dataclasses.asdict` JSON) and the router's
counters (docs/telemetry.md). Peers and the dashboard read it back with `NodeTelemetry.from_dict`.
Owned by the round-scheduler issue; others add fields with defaults.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from talaria.config.schema import Pool


@dataclass(frozen=True, slots=True)
class ModelQueue:
    """One served model's work on the instance."""

    model: str
    waiting: int  # calls queued (new, returning, or preempted and waiting to be readmitted)
    running: int  # calls holding KV: prefilling or decoding
    active: bool  # its weights are in the arena now


@dataclass(frozen=True, slots=True)
class RoundState:
    """A cold pool's round scheduler (paper §3.4): where the round is and what it reports."""

    round: int | None  # the open round's number; None between rounds (idle)
    round_remaining_s: float  # predicted budget left in the open round: the current slot's rest + later slots
    slot: dict | None  # {model, phase, budget_s, elapsed_s, protected, decode_steps, sp_opportunities}
    deadline_risk: dict[str, int]  # shortfall counters: tpot_infeasible, round_infeasible, decode_share,
    # prefill_shortfall, prefill_over_budget, round_over
    sp_admitted: int  # continuations admitted mid-slot since start
    sp_parked: int  # continuations that returned mid-slot and waited for a later slot
    last_rounds: tuple[dict, ...]  # summaries: wall_s = active_s + switch_s; p_s, d_s, sp_s; SP admitted/parked
    round_s: float = 0.0  # the round bound gamma * ttft_s


@dataclass(frozen=True, slots=True)
class InstanceStats:
    """One instance's snapshot, sent by rank 0 at most every 0.25 s (about every 0.5 s when idle)."""

    instance: str
    waiting: int
    running: int
    kv_pages_used: int
    kv_pages_total: int
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    lost_tokens: int = 0  # KV of whole pages computed, then lost on preemption (host full or evicted): recomputed
    models: tuple[str, ...] = field(default=())
    active_model: str | None = None  # the model whose weights are in the arena
    host_restored_tokens: int = 0  # prompt tokens restored from the host KV registry (HKVR)
    switches: int = 0  # model switches since start
    last_switch: dict | None = None  # the last SwitchRecord, as JSON (per-rank phases, path, bytes)
    substrate: dict = field(default_factory=dict)  # staging target, coverage, slack; HKVR use
    # recent sessions: {session, model, kv_tokens, location: device | host | missing, device_tokens, host_tokens}
    sessions: tuple[dict, ...] = ()
    version: int = 0  # increases with every snapshot, across restarts too: a router can spot a stale one
    pool: Pool = Pool.HOT
    staged_model: str | None = None  # whose weights are being staged in the KV tail (cold pools)
    queues: tuple[ModelQueue, ...] = ()  # per served model
    rounds: RoundState | None = None  # cold pools only
    last_switches: tuple[dict, ...] = ()  # the last SwitchRecords as JSON, oldest first
    time: float = 0.0  # node monotonic clock when the snapshot was taken
    page_size: int = 16  # tokens per KV page (kv_pages_* count these)
    cost_scale: dict[str, float] = field(default_factory=dict)  # "model/kind" -> EWMA of measured / profile-priced
    # per served model, from its cache layout on one rank (talaria/contracts/kv_layout.py); empty in
    # snapshots from before the layout descriptor
    page_bytes: dict[str, int] = field(default_factory=dict)  # one KV page: every per-token tensor, every layer
    state_bytes: dict[str, int] = field(default_factory=dict)  # one per-sequence state slot; 0 = no state
    state_slots: dict[str, int] = field(default_factory=dict)  # state slots its arena region holds; 0 = none


def stats_from_dict(data: dict) -> InstanceStats:
    """The inverse of `dataclasses.asdict` for a snapshot read back from JSON (a peer's telemetry)."""
    known = {f for f in InstanceStats.__dataclass_fields__}
    d = {k: v for k, v in data.items() if k in known}  # a newer peer may send fields we do not know
    d["models"] = tuple(d.get("models", ()))
    d["sessions"] = tuple(d.get("sessions", ()))
    d["last_switches"] = tuple(d.get("last_switches", ()))
    d["queues"] = tuple(ModelQueue(**q) for q in d.get("queues", ()))
    if "pool" in d:
        d["pool"] = Pool(d["pool"])
    if d.get("rounds") is not None:
        r = dict(d["rounds"])
        r["last_rounds"] = tuple(r.get("last_rounds", ()))
        d["rounds"] = RoundState(**{k: v for k, v in r.items() if k in RoundState.__dataclass_fields__})
    return InstanceStats(**d)


@dataclass(frozen=True, slots=True)
class InstanceTelemetry:
    """One local instance in the node's telemetry envelope."""

    healthy: bool  # ready and serving
    in_flight: int  # calls sent to it and not finished
    models: tuple[str, ...]  # the models it serves, in config order
    stats: InstanceStats | None  # its latest snapshot; None before the first
    profile: str | None  # its cost profile as TOML (talaria.contracts.profile_file); None until ready
    restarts: int = 0  # times its workers died (or stalled) and it was restarted
    state: str = "ready"  # starting | ready | restarting | stopped
    last_failure: str | None = None  # why it last failed

    def to_dict(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "in_flight": self.in_flight, "models": list(self.models),
                "stats": asdict(self.stats) if self.stats is not None else None, "profile": self.profile,
                "restarts": self.restarts, "state": self.state, "last_failure": self.last_failure}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InstanceTelemetry:
        """Raises (KeyError, TypeError, ValueError, AttributeError) on an entry it cannot read."""
        stats = data.get("stats")
        return cls(bool(data.get("healthy")), int(data.get("in_flight") or 0), tuple(data.get("models") or ()),
                   stats_from_dict(stats) if stats is not None else None, data.get("profile"),
                   int(data.get("restarts") or 0), str(data.get("state") or "ready"), data.get("last_failure"))


@dataclass(frozen=True, slots=True)
class NodeTelemetry:
    """The body of `GET /talaria/telemetry`: every local instance and the router."""

    time: float  # the node's monotonic clock when it answered (snapshots' `time` are on it too)
    instances: dict[str, InstanceTelemetry]  # by instance name, in config order
    router: dict[str, Any]  # decisions by reason, lease counters, live leases, views (docs/router.md)
    unreadable: tuple[str, ...] = ()  # read back only: instance entries this version could not read

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "instances": {n: i.to_dict() for n, i in self.instances.items()},
                "router": self.router}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeTelemetry:
        """Read a body back (a peer's, or the dashboard's node). An instance entry this version
        cannot read (a newer or foreign writer) is left out and named in `unreadable`: one bad
        entry costs only itself. Raises TypeError when `data` is not a telemetry body at all."""
        if not isinstance(data, dict) or not isinstance(data.get("instances", {}), dict):
            raise TypeError("not a Talaria telemetry body: expected an object with an \"instances\" object")
        instances, unreadable = {}, []
        for name, entry in (data.get("instances") or {}).items():
            try:
                instances[name] = InstanceTelemetry.from_dict(entry)
            except (AttributeError, KeyError, TypeError, ValueError):
                unreadable.append(name)
        router = data.get("router")
        t = data.get("time")
        return cls(float(t) if isinstance(t, (int, float)) else 0.0, instances,
                   router if isinstance(router, dict) else {}, tuple(unreadable))
