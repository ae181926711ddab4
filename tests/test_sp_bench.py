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


def test_the_predictions_are_fitted_on_calibration_runs_made_before_and_apart_from_the_judged_pairs(
        sp, monkeypatch, tmp_path) -> None:
    """Issue 38: the live-fitted and live-corrected predictions see the calibration runs' steps and
    corrections only, and are made before the first pair; a pair's steps never reach them."""
    from types import SimpleNamespace

    order: list[str] = []

    def live_run(label, is_sp, trace, profile, workdir, log):
        order.append(label)
        run = {"label": label, "sp": is_sp, "code": "same", "sct_sum_s": 100.0 if is_sp else 120.0, "errors": 0,
               "sp_admissions": 5, "sp_parks": 0, "rounds": 3, "round_wall_p50_s": 1.0,
               "load_average": {"start": 0.5, "end": 0.5}, "cost_scale_mean": {f"m/{label}": 1.0}}
        result = SimpleNamespace(calls=[SimpleNamespace(session_id="s", index=0, text="same")])
        return result, run, [sp.Step(label, 0.001, 0.002, 0.004)]  # each step names the run it came from

    def simulate(trace, profile, path, workdir, log, name):
        order.append(f"simulate {name}")
        side = {"sct_sum_s": 1.0, "sp_admissions": 1, "sp_parks": 0, "rounds": 1, "round_wall_p50_s": 1.0}
        return {"sim-on": side, "sim-off": side, "ratio": 1.2}

    seen: dict[str, list] = {}

    def fitted(profile, steps):
        seen["fit"] = [s.model for s in steps]
        return profile, {}

    def corrected(profile, runs):
        seen["corrected"] = [r["label"] for r in runs]
        return profile, {}

    for name, fake in (("live_run", live_run), ("simulate", simulate), ("fitted", fitted),
                       ("corrected", corrected), ("environment", lambda log, load: {})):
        monkeypatch.setattr(sp, name, fake)
    profile = Path(__file__).resolve().parents[1] / "profiles" / "paper-tp8.toml"
    code = sp.main(["--json", str(tmp_path / "sp.json"), "--profile", str(profile), "--pairs", "3",
                    "--workdir", str(tmp_path)])
    assert code == 0  # every fake pair is 1.2 against a prediction of 1.2
    assert seen["fit"] == ["fit1-on", "fit2-off"] and seen["corrected"] == ["fit1-on", "fit2-off"]
    first_pair = order.index("pair1-on")
    assert order.index("simulate live-fitted") < first_pair and order.index("fit2-off") < first_pair
    assert [x for x in order if x.startswith("pair")] == ["pair1-on", "pair1-off", "pair2-off", "pair2-on",
                                                          "pair3-on", "pair3-off"]
    with pytest.raises(SystemExit):  # one calibration run cannot fit both modes' steps
        sp.main(["--profile", str(profile), "--fit-runs", "1"])
