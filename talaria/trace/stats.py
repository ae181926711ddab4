"""The §2.1 workload statistics of any trace, beside the paper's, so a trace can be checked at a glance.

Percentiles are nearest-rank, as in the paper (§5.1): for N sorted observations, p_q is the one at
rank ceil(q N / 100). Gaps are tool gaps only (calls with index > 0): a session's first gap_s is its
start offset, not a gap. A continuation "reuses more than half" when its reused_tokens exceed half
of the previous call's prompt_tokens (App. A: the prefix shared with the prior prompt).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise

from talaria.contracts.trace import TraceCall, sessions

# §2.1, Fig. 2, App. A (data/paper-figures.toml [workload_characterization]); None: not reported.
PAPER = {"sessions": 445, "calls": 7386, "multi_call_sessions": None, "depth_p50": 11, "depth_p95": 49,
         "depth_max": 187, "gap_p50_s": 0.39, "gap_p95_s": 1.32, "prompt_p50": 25_000,
         "prompt_p95": 105_000, "reuse_over_half": 0.968, "completion_p50": None, "completion_p95": None}


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of `values` (any order); None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered) / 100)) - 1]


@dataclass(frozen=True, slots=True)
class TraceStats:
    sessions: int
    calls: int
    multi_call_sessions: int  # sessions of two or more calls (chains, in a converted trace)
    depth_p50: int
    depth_p95: int
    depth_max: int
    gap_p50_s: float | None  # over continuations only
    gap_p95_s: float | None
    prompt_p50: int | None
    prompt_p95: int | None
    reuse_over_half: float | None  # share of continuations with reused_tokens > previous prompt / 2
    completion_p50: int | None
    completion_p95: int | None

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def trace_stats(calls: Sequence[TraceCall]) -> TraceStats:
    """The statistics of `calls` (a whole trace, as `read_trace` returns it)."""
    by_session = sessions(calls)
    depths = [len(seq) for seq in by_session.values()]
    gaps: list[float] = []
    over_half = 0
    for seq in by_session.values():
        for prev, call in pairwise(seq):
            gaps.append(call.gap_s)
            over_half += call.reused_tokens > prev.prompt_tokens / 2
    return TraceStats(
        sessions=len(by_session), calls=len(calls), multi_call_sessions=sum(d > 1 for d in depths),
        depth_p50=percentile(depths, 50) or 0, depth_p95=percentile(depths, 95) or 0,
        depth_max=max(depths, default=0),
        gap_p50_s=percentile(gaps, 50), gap_p95_s=percentile(gaps, 95),
        prompt_p50=percentile([c.prompt_tokens for c in calls], 50),
        prompt_p95=percentile([c.prompt_tokens for c in calls], 95),
        reuse_over_half=over_half / len(gaps) if gaps else None,
        completion_p50=percentile([c.completion_tokens for c in calls], 50),
        completion_p95=percentile([c.completion_tokens for c in calls], 95),
    )


def format_table(stats: TraceStats) -> str:
    """A two-column table: this trace and the paper's §2.1 figure ("-" where there is none)."""
    rows = [("statistic", "trace", "paper §2.1")]
    for key, value in stats.to_dict().items():
        rows.append((key, _fmt(key, value), _fmt(key, PAPER[key])))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{width[0]}}  {r[1]:>{width[1]}}  {r[2]:>{width[2]}}".rstrip() for r in rows)


def _fmt(key: str, value: float | None) -> str:
    if value is None:
        return "-"
    if key == "reuse_over_half":
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:.2f}"
    return f"{value:,}"
