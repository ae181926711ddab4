"""Comparison variants and the summary a simulation run reports (`talaria sim`'s table and JSON)."""

from __future__ import annotations

import dataclasses
import math

from talaria.config.schema import Ablation, RouterPolicy, TalariaConfig
from talaria.sim.simulation import SimResult

# `--compare` names: the paper's ablations (§5.2) and router policies (§5.3)
ABLATIONS = {"talaria": (), "no-sp": (Ablation.SP,), "no-hkvr": (Ablation.HKVR,), "h2d-only": (Ablation.STAGING,),
             "round-only": (Ablation.ROUND_ONLY,)}
POLICIES = {p.value: p for p in RouterPolicy}


def variant(config: TalariaConfig, name: str) -> TalariaConfig:
    """`config` with one comparison applied: an ablation on every instance, or a router policy."""
    if name in ABLATIONS:
        instances = tuple(dataclasses.replace(i, ablations=ABLATIONS[name]) for i in config.instances)
        return dataclasses.replace(config, instances=instances)
    if name in POLICIES:
        return dataclasses.replace(config, router=dataclasses.replace(config.router, policy=POLICIES[name]))
    raise ValueError(f"unknown comparison {name!r}; use any of: {', '.join([*ABLATIONS, *POLICIES])}")


def nearest_rank(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by the nearest-rank method; NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def summary(r: SimResult) -> dict:
    """The numbers `--json` writes per policy (keys as the issue names them)."""
    sct = list(r.sct_s.values())
    ttft = [c.ttft_s for c in r.calls if c.ttft_s is not None]
    answered = [c for c in r.calls if c.ttft_s is not None and c.instance in r.ttft_targets]
    attained = sum(1 for c in answered if c.ttft_s <= r.ttft_targets[c.instance])
    paths: dict[str, int] = {}
    for s in r.switches:
        paths[s["path"]] = paths.get(s["path"], 0) + 1
    admitted, parked = r.counts.get("sp_admit", 0), r.counts.get("sp_park", 0)
    rounds = r.rounds
    mean = (lambda key: sum(x[key] for x in rounds) / len(rounds)) if rounds else (lambda key: 0.0)
    return {
        "sessions": len(r.sct_s), "calls": len(r.calls), "errors": sum(1 for c in r.calls if c.error),
        "sct_p50_s": nearest_rank(sct, 50), "sct_p95_s": nearest_rank(sct, 95), "sct_sum_s": sum(sct),
        "ttft_p50_s": nearest_rank(ttft, 50), "ttft_p95_s": nearest_rank(ttft, 95),
        "ttft_attainment": attained / len(answered) if answered else math.nan,  # share within its instance's ttft_s
        "switches": len(r.switches), "switch_paths": paths,
        "switch_p50_ms": nearest_rank([s["total_ms"] for s in r.switches], 50),
        "switch_p95_ms": nearest_rank([s["total_ms"] for s in r.switches], 95),
        "sp_admitted": admitted, "sp_parked": parked,
        "sp_admission_rate": admitted / (admitted + parked) if admitted + parked else 0.0,
        "rounds": len(rounds),
        "round_mean": {k: mean(k) for k in ("wall_s", "active_s", "switch_s", "p_s", "d_s", "sp_s")},
        "warm_across_switch": warm_across_switch(r),
        "hbm_peak_gib": r.hbm_peak_bytes / (1 << 30),
        "router": r.router,
        "virtual_s": r.virtual_s, "wall_s": r.wall_s,
    }


def warm_across_switch(r: SimResult) -> dict:
    """Continuations whose model was switched out during their tool gap, beside those whose model
    stayed resident: how many, their TTFT p50/p95 and the share of their prompts served from KV."""
    out = {}
    for name, switched in (("switched_out", True), ("resident", False)):
        calls = [c for c in r.calls if c.index and c.ttft_s is not None and c.switched_out is switched]
        prompt = sum(c.prompt_tokens for c in calls)
        out[name] = {"calls": len(calls), "ttft_p50_s": nearest_rank([c.ttft_s for c in calls], 50),
                     "ttft_p95_s": nearest_rank([c.ttft_s for c in calls], 95),
                     "prefix_hit_share": sum(c.cached_tokens for c in calls) / prompt if prompt else math.nan}
    return out


def table(results: dict[str, dict]) -> str:
    rows = [("policy", "SCT p50 s", "SCT p95 s", "TTFT p50 s", "TTFT p95 s", "TTFT met", "switches", "SP rate",
             "rounds", "avoidable opens", "sim wall s")]
    for name, s in results.items():
        rows.append((name, f"{s['sct_p50_s']:.1f}", f"{s['sct_p95_s']:.1f}", f"{s['ttft_p50_s']:.2f}",
                     f"{s['ttft_p95_s']:.2f}", f"{s['ttft_attainment']:.1%}", str(s["switches"]), f"{s['sp_admission_rate']:.1%}", str(s["rounds"]),
                     str(s["router"].get("avoidable_opens", 0)), f"{s['wall_s']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)
