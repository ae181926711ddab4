"""bench/sp.py's live-fitted prediction: the fit of live steps against their profile prices, and the
profile built from it, which must price every step as the fit does."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from talaria.contracts.profile import DecodeCurve, PrefillCurve
from talaria.contracts.profile_file import load_profile

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def sp():
    sys.path.insert(0, str(BENCH))  # sp.py imports its siblings (sp_workload, report, server)
    try:
        spec = importlib.util.spec_from_file_location("bench_sp", BENCH / "sp.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_sp"] = module  # dataclasses resolve their module by name
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("bench_sp", None)


def measured(p: float, d: float, a_p: float, a_d: float, b: float) -> float:
    return a_p * p + a_d * d + b * ((p > 0) + (d > 0))


def steps_of(sp, model: str, a_p: float, a_d: float, b: float) -> list:
    """Prefill-only, decode-only and mixed steps of several sizes, measured exactly by the rule."""
    shapes = [(p, 0.0) for p in (0.002, 0.01, 0.04)] + [(0.0, d) for d in (0.001, 0.003, 0.008)]
    shapes += [(p, d) for p in (0.003, 0.02) for d in (0.002, 0.006)]
    return [sp.Step(model, p, d, measured(p, d, a_p, a_d, b)) for p, d in shapes]


def test_the_fit_recovers_a_per_part_cost_and_each_parts_scale(sp) -> None:
    f = sp.fit_steps(steps_of(sp, "m", 1.3, 2.1, 0.0007))
    assert (f.prefill, f.decode, f.per_part_s) == pytest.approx((1.3, 2.1, 0.0007), rel=1e-9)
    assert f.r2 == pytest.approx(1.0) and f.steps == 10


def test_the_fit_keeps_every_coefficient_non_negative(sp) -> None:
    # steps that take the same time whatever their price: a constant, no scale
    steps = [sp.Step("m", p, d, 0.005) for p, d in ((0.001, 0.0), (0.01, 0.0), (0.02, 0.0), (0.0, 0.002),
                                                     (0.0, 0.02), (0.0, 0.03))]
    f = sp.fit_steps(steps)
    assert min(f.prefill, f.decode, f.per_part_s) >= 0
    assert f.per_part_s == pytest.approx(0.005) and f.prefill == pytest.approx(0, abs=1e-12)


def test_the_fitted_profile_prices_steps_as_the_fit_does(sp) -> None:
    profile = load_profile(Path(__file__).resolve().parents[1] / "profiles" / "paper-tp8.toml")
    name = next(iter(profile.models))
    mp = dataclasses.replace(profile.models[name], prefill=PrefillCurve(0.004, 2e-5, 1e-9),  # every term in play
                             decode=DecodeCurve(0.002, 1e-4, 3e-8))
    profile = dataclasses.replace(profile, models={**profile.models, name: mp})
    fitted, fits = sp.fitted(profile, steps_of(sp, name, 1.3, 2.1, 0.0007))
    assert set(fits) == {name}
    for tokens, cached in ((16, 0), (300, 1200)):
        assert fitted.prefill_s(name, tokens, cached) == pytest.approx(
            measured(profile.prefill_s(name, tokens, cached), 0, 1.3, 2.1, 0.0007))
    for batch, context in ((1, 40), (12, 9000)):
        assert fitted.decode_s(name, batch, context) == pytest.approx(
            measured(0, profile.decode_s(name, batch, context), 1.3, 2.1, 0.0007))
    # a mixed step pays both fixed costs, the per-part cost twice, as the fit's design counts it
    p, d = profile.prefill_s(name, 64, 500), profile.decode_s(name, 6, 3000)
    assert fitted.prefill_s(name, 64, 500) + fitted.decode_s(name, 6, 3000) == pytest.approx(
        measured(p, d, 1.3, 2.1, 0.0007))
    other = next(m for m in profile.models if m != name)
    assert fitted.models[other] == profile.models[other]  # a model without live steps keeps its curves


def test_restores_are_taken_at_the_profiles_price_and_thin_parts_are_not_fitted(sp) -> None:
    steps = [sp.Step(s.model, s.priced_prefill_s, s.priced_decode_s, s.seconds + r, r)
             for s, r in zip(steps_of(sp, "m", 1.3, 2.1, 0.0007), [0.0, 0.004, 0.0, 0.0, 0.0, 0.0, 0.01, 0.0, 0.0, 0.002])]
    f = sp.fit_steps(steps)  # the restores' time is what the profile priced: the fit is exact again
    assert (f.prefill, f.decode, f.per_part_s) == pytest.approx((1.3, 2.1, 0.0007), rel=1e-9)
    # decode in only two steps: its scale is not fitted and stays 1
    thin = [sp.Step("m", p, d, measured(p, d, 1.3, 1.0, 0.0007))
            for p, d in ((0.002, 0.0), (0.01, 0.0), (0.04, 0.0), (0.003, 0.002), (0.0, 0.004))]
    f = sp.fit_steps(thin)
    assert (f.prefill, f.decode, f.per_part_s) == pytest.approx((1.3, 1.0, 0.0007), rel=1e-9)
