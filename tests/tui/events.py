"""Event records for the dashboard's tests, shaped as docs/events.md describes them."""

from __future__ import annotations

from typing import Any


def event(kind: str, seq: int, t: float, instance: str = "cold-0", **data: Any) -> dict[str, Any]:
    """One record: the data keys, then the envelope."""
    return {**data, "seq": seq, "t": t, "instance": instance, "kind": kind}


def lease(seq: int, t: float, op: str, session: str, model: str = "tiny-llama", target: str = "cold-0",
          **data: Any) -> dict[str, Any]:
    return event("lease", seq, t, "router", op=op, session=session, model=model, target=target, **data)


def switch(seq: int, t: float, path: str, total_ms: float, from_model: str = "tiny-llama",
           to_model: str = "tiny-qwen3", instance: str = "cold-0") -> dict[str, Any]:
    """A two-rank switch whose rank 1 is the slowest (it sets total_ms)."""
    def rank(r: int, ms: float) -> dict[str, Any]:
        return {"rank": r, "from_model": from_model, "to_model": to_model, "path": path,
                "phase_ms": {"save_teardown": 0.1 * ms, "open_weights": 0.6 * ms, "kv_shell": 0.1 * ms,
                             "runtime": 0.1 * ms, "publish": 0.1 * ms},
                "total_ms": ms, "staged_bytes": 4096 * r, "dirty_bytes": 0, "total_bytes": 8192,
                "rebuilt_runtime": False}
    return event("switch", seq, t, instance, from_model=from_model, to_model=to_model, path=path,
                 total_ms=total_ms, rebuilt_runtime=False, ranks=[rank(0, total_ms / 2), rank(1, total_ms)])


# The example of docs/events.md: one round of model `a` on the scheduler harness's toy profile,
# with a 1 s budget: P, D1, an SP admission, SP, D, then the round record.
DOC_ROUND = [
    event("slot_phase", 1, 0.1875, "inst0", model="a", phase="P", round=1, start=0.0, duration_s=0.1875, steps=1,
          tokens=12),
    event("slot_phase", 2, 0.3125, "inst0", model="a", phase="D1", round=1, start=0.1875, duration_s=0.125,
          steps=2, tokens=2),
    event("sp_admit", 3, 0.3125, "inst0", model="a", session="s1", request="t2", tokens=12, cached_tokens=8,
          restored_tokens=0, round=1, opportunity=1),
    event("slot_phase", 4, 0.375, "inst0", model="a", phase="SP", round=1, start=0.3125, duration_s=0.0625,
          steps=1, tokens=4),
    event("slot_phase", 5, 1.0, "inst0", model="a", phase="D", round=1, start=0.375, duration_s=0.625, steps=10,
          tokens=10),
    event("round", 6, 1.0, "inst0", round=1, start=0.0, wall_s=1.0, active_s=1.0, switch_s=0.0, p_s=0.1875,
          d_s=0.75, sp_s=0.0625, sp_admitted=1, sp_parked=0,
          slots=[{"model": "a", "budget_s": 1.0, "used_s": 1.0, "protected": 4, "decode_steps": 12,
                  "sp_opportunities": 1}]),
]
