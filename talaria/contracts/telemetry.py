"""The per-instance telemetry snapshot: what the router, the dashboard and /talaria/telemetry see.

Rank 0 of each engine group builds an `InstanceStats` from its scheduler and sends it to the
supervisor beside its outputs; `version` increases with every snapshot so a consumer can tell a
fresh one from a stale one. Serialised form: `dataclasses.asdict` as JSON, one object per instance
under `GET /talaria/telemetry` (docs/telemetry.md). Owned by the round-scheduler issue; others add
fields with defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    cost_scale: dict[str, float] = field(default_factory=dict)  # "model/kind" -> measured / profile EWMA
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
    models: tuple[str, ...] = field(default=())
    active_model: str | None = None  # the model whose weights are in the arena
    host_restored_tokens: int = 0  # prompt tokens restored from the host KV registry (HKVR)
    switches: int = 0  # model switches since start
    last_switch: dict | None = None  # the last SwitchRecord, as JSON (per-rank phases, path, bytes)
    substrate: dict = field(default_factory=dict)  # staging target, coverage, slack; HKVR use
    # recent sessions: {session, model, kv_tokens, location: device | host | missing, device_tokens, host_tokens}
    sessions: tuple[dict, ...] = ()
    version: int = 0  # increases with every snapshot, across restarts too: a router can spot a stale one
    pool: str = "hot"  # hot | cold
    staged_model: str | None = None  # whose weights are being staged in the KV tail (cold pools)
    queues: tuple[ModelQueue, ...] = ()  # per served model
    rounds: RoundState | None = None  # cold pools only
    last_switches: tuple[dict, ...] = ()  # the last SwitchRecords as JSON, oldest first
    time: float = 0.0  # node monotonic clock when the snapshot was taken
    page_size: int = 16  # tokens per KV page (kv_pages_* count these)


def stats_from_dict(data: dict) -> InstanceStats:
    """The inverse of `dataclasses.asdict` for a snapshot read back from JSON (a peer's telemetry)."""
    known = {f for f in InstanceStats.__dataclass_fields__}
    d = {k: v for k, v in data.items() if k in known}  # a newer peer may send fields we do not know
    d["models"] = tuple(d.get("models", ()))
    d["sessions"] = tuple(d.get("sessions", ()))
    d["last_switches"] = tuple(d.get("last_switches", ()))
    d["queues"] = tuple(ModelQueue(**q) for q in d.get("queues", ()))
    if d.get("rounds") is not None:
        r = dict(d["rounds"])
        r["last_rounds"] = tuple(r.get("last_rounds", ()))
        d["rounds"] = RoundState(**{k: v for k, v in r.items() if k in RoundState.__dataclass_fields__})
    return InstanceStats(**d)
