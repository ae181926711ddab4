"""Judging one cell of the simulator's grid (bench/sim_grid.py): Talaria against every other variant.

A cell runs one trace on one node under every variant (talaria and its ablations, `report.ABLATIONS`)
and compares Talaria's SCT p50 and p95 with each other variant's. Per comparison the ratio is
Talaria / other, and its outcome is

- a **tie** when the two are within a factor of `tolerance` either way (1/1.02 <= ratio <= 1.02 at
  the default, issue 20's 2 %): the grid cannot tell them apart, and a tie is never counted a win.
  The 2.1 s-intercept cells, where the TPOT gate turns SP off and Talaria *is* its no-SP ablation,
  are ties (and marked identical besides);
- a **win** when Talaria is faster by more than that (ratio < 1/tolerance);
- a **loss** when it is slower by more than that (ratio > tolerance).

A cell is a loss if any comparison loses, else a tie if any ties, else a win: a win means Talaria
beat every other variant by more than the tolerance at both percentiles. A cell *passes* issue 20's
criterion (Talaria at most `tolerance` x every other variant) when it is not a loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

TOLERANCE = 1.02  # equal within 2 % either way is a tie (issue 20's pass bound, made symmetric)
PERCENTILES = ("p50", "p95")


class Outcome(Enum):
    WIN = "win"
    TIE = "tie"
    LOSS = "loss"


def outcome(ratio: float, tolerance: float = TOLERANCE) -> Outcome:
    """Talaria / other at one percentile: a tie within a factor of `tolerance` either way."""
    if not ratio > 0 or math.isinf(ratio):
        raise ValueError(f"an SCT ratio must be a positive number, got {ratio!r}")
    if ratio > tolerance:
        return Outcome.LOSS
    if ratio < 1 / tolerance:
        return Outcome.WIN
    return Outcome.TIE


@dataclass(frozen=True, slots=True)
class Comparison:
    """Talaria against one other variant at one percentile."""

    variant: str
    percentile: str  # "p50" or "p95"
    ratio: float  # Talaria's SCT / the variant's
    outcome: Outcome
    identical: bool  # the two runs' SCT p50, p95 and sum are equal exactly (e.g. no SP step taken: talaria is no-sp)


@dataclass(frozen=True, slots=True)
class CellVerdict:
    """Every comparison of one cell, and what they add up to."""

    comparisons: tuple[Comparison, ...]
    tolerance: float

    @property
    def outcome(self) -> Outcome:
        return _worst(c.outcome for c in self.comparisons)

    def at(self, percentile: str) -> Outcome:
        """The cell's outcome at one percentile (the worst over the other variants)."""
        return _worst(c.outcome for c in self.comparisons if c.percentile == percentile)

    def closest(self, percentile: str) -> Comparison:
        """The comparison with the highest ratio at `percentile`: the variant nearest to (or past) Talaria."""
        return max((c for c in self.comparisons if c.percentile == percentile), key=lambda c: c.ratio)

    @property
    def ties(self) -> tuple[str, ...]:
        """The variants Talaria ties at either percentile, in the order compared."""
        return tuple(dict.fromkeys(c.variant for c in self.comparisons if c.outcome is Outcome.TIE))

    @property
    def losses(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.variant for c in self.comparisons if c.outcome is Outcome.LOSS))

    @property
    def identical_to(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.variant for c in self.comparisons if c.identical))

    @property
    def passed(self) -> bool:
        """Issue 20's criterion: Talaria's p50 and p95 each at most `tolerance` x every other variant's."""
        return self.outcome is not Outcome.LOSS

    def to_json(self) -> dict:
        return {"outcome": self.outcome.value, "outcomes": {q: self.at(q).value for q in PERCENTILES},
                "worst_ratio": {q: self.closest(q).ratio for q in PERCENTILES},
                "closest": {q: self.closest(q).variant for q in PERCENTILES},
                "ties": list(self.ties), "losses": list(self.losses), "identical_to": list(self.identical_to),
                "passed": self.passed, "tolerance": self.tolerance}


def _worst(outcomes) -> Outcome:
    seen = set(outcomes)
    if not seen:
        raise ValueError("a cell needs at least one variant besides talaria to compare with")
    return Outcome.LOSS if Outcome.LOSS in seen else Outcome.TIE if Outcome.TIE in seen else Outcome.WIN


def judge(results: dict[str, dict], tolerance: float = TOLERANCE) -> CellVerdict:
    """Talaria against every other variant of one cell. `results` maps a variant to its summary
    (`talaria.sim.report.summary`: `sct_p50_s`, `sct_p95_s`, `sct_sum_s`); "talaria" must be among them."""
    if "talaria" not in results:
        raise ValueError(f"a cell's results must include talaria; got {', '.join(results) or 'none'}")
    t = results["talaria"]
    keys = ("sct_p50_s", "sct_p95_s", "sct_sum_s")
    comparisons = []
    for name, r in results.items():
        if name == "talaria":
            continue
        identical = all(t[k] == r[k] for k in keys if k in t and k in r)
        for q in PERCENTILES:
            ratio = t[f"sct_{q}_s"] / r[f"sct_{q}_s"]
            comparisons.append(Comparison(name, q, ratio, outcome(ratio, tolerance), identical))
    return CellVerdict(tuple(comparisons), tolerance)
