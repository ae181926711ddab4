"""Least-squares fits of the profile's cost curves to timed probes (calibration's arithmetic).

Calibration (start-up or `talaria profile`) times a few prefill and decode shapes through the engine
group and fits `PrefillCurve` / `DecodeCurve` here: non-negative least squares, so no cost comes out
negative. numpy only; it lives beside the calibration that is its only caller.
"""

from __future__ import annotations

import numpy as np

from talaria.contracts.profile import DecodeCurve, PrefillCurve


def fit_linear(xs: list[tuple[float, ...]], ys: list[float]) -> tuple[float, ...]:
    """Least-squares coefficients c >= 0 for ys ~ xs @ c (costs are never negative).

    Ordinary least squares, then the most negative coefficient is fixed at 0 and the rest refit,
    until none is negative (a simple active-set loop: at most one solve per column). Columns are
    scaled to unit maximum first, so a constant and a token-squared column fit equally well.
    """
    a, b = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if a.ndim != 2 or a.shape[0] == 0 or b.shape != (a.shape[0],):
        raise ValueError(f"fit_linear needs one row per sample and as many ys as rows; "
                         f"got xs of shape {a.shape} and {b.size} ys")
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    coef = np.zeros(a.shape[1])
    free = list(range(a.shape[1]))
    while free:
        sol = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        if (sol >= 0).all():
            coef[free] = sol
            break
        del free[int(np.argmin(sol))]
    return tuple(float(c) + 0.0 for c in coef / scale)  # + 0.0 turns -0.0 into 0.0


def fit_prefill(samples: list[tuple[int, int, float]]) -> PrefillCurve:
    """Fit a `PrefillCurve` to timed prefills given as (new tokens, cached tokens, seconds)."""
    if any(n < 1 or c < 0 for n, c, _ in samples):
        raise ValueError("prefill samples need tokens >= 1 and cached >= 0")
    xs = [(1.0, n, n * (c + n / 2)) for n, c, _ in samples]
    return PrefillCurve(*fit_linear(xs, [s for _, _, s in samples]))


def fit_decode(samples: list[tuple[int, int, float]]) -> DecodeCurve:
    """Fit a `DecodeCurve` to timed decode steps given as (batch, context tokens, seconds)."""
    if any(b < 1 or c < 0 for b, c, _ in samples):
        raise ValueError("decode samples need batch >= 1 and context >= 0")
    xs = [(1.0, b, c) for b, c, _ in samples]
    return DecodeCurve(*fit_linear(xs, [s for _, _, s in samples]))
