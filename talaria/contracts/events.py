"""The event log contract: what happened on a node, one record per event, in order.

Instances emit switches (with their phases), KV checkpoints to host and restores from host; the
round scheduler adds rounds, slot phases and SP admissions, the router its routes and leases, the
simulator the same records in virtual time. Serialised form: one JSON object per line (JSONL) and
per server-sent event, `{"seq", "t", "instance", "kind", ...data}`; docs/contracts.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class EventKind(str, Enum):
    SWITCH = "switch"  # data: the SwitchRecord (path, per-rank phases, bytes)
    KV_CHECKPOINT = "kv_checkpoint"  # data: model, seq_id, pages_saved, pages_published (TP-agreed)
    KV_RESTORE = "kv_restore"  # data: model, session, request, tokens restored from host into device pages
    ROUND = "round"  # data: round, start, wall_s = active_s + switch_s, p_s, d_s, sp_s, sp_admitted, sp_parked, slots
    SLOT_PHASE = "slot_phase"  # data: model, phase (P | D1 | SP | D | Dfin), round, start, duration_s, steps, tokens
    SP_ADMIT = "sp_admit"  # data: model, session, request, tokens, cached_tokens, restored_tokens, round, opportunity
    SP_PARK = "sp_park"  # data: model, session, request, reason (budget | kv | tpot | slot-closed | sp-off), round
    ROUTE = "route"  # instance "router"; data: request, session, model, instance, reason, candidates, cost, ...
    LEASE = "lease"  # instance "router"; data: op (install | consume | discard | expire), session, model, instance
    PEER = "peer"  # instance "router"; data: op (up | down | left), peer (its URL), source (static | dns), why
    # with an instance's record_steps on (simulator parity, docs/events.md): what it was given and did
    CALL = "call"  # data: request, session, model, prompt_tokens, max_tokens
    STEP = "step"  # data: model, planned_at, seconds, tokens, seqs; switch: true for a switch


@dataclass(frozen=True, slots=True)
class Event:
    t: float  # node monotonic clock, seconds
    instance: str
    kind: EventKind
    data: dict[str, Any] = field(default_factory=dict)
    seq: int = 0  # node-wide order, assigned by the supervisor's event log

    def to_json(self) -> str:
        """One line; the envelope fields come last so no data key can shadow them."""
        return json.dumps({**self.data, "seq": self.seq, "t": self.t, "instance": self.instance,
                           "kind": self.kind.value}, separators=(",", ":"))
