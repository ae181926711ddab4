"""Session-prefill (SP) on a live cold instance, in paired runs with SP on and off, beside the simulator.

    python bench/sp.py [--json PATH] [--pairs N] [--fit-runs N] [--profile PATH] [--workdir DIR] [--no-gate]

The workload and the instance are fixed in bench/sp_workload.py, which derives them from the paper
(its docstring): three float64 tiny models on one cold instance with 1.6 s rounds, ten sessions per
model, eleven calls each, tool gaps of the paper's distribution scaled by 1.6 s / 8 s. Nothing about
them is an option, so nothing can be tuned to a result.

1. **Profile.** `talaria profile` measures the instance on this machine (about 20 s) unless
   `--profile` names one. The live runs budget their rounds with this file (`profile = ...` in
   their config) and the simulator charges it, so both start from the same costs.
2. **Calibration runs** (issue 38). `--fit-runs` (2) step-recording runs of the same trace, SP on
   and off in turn, before any pair. The live-corrected and live-fitted predictions (3, 4) are made
   from these runs alone and logged before the first pair starts: the pairs they are judged
   against never enter them. (Runs 1-8 fitted on the pairs' own steps.)
3. **Simulated.** `talaria.sim`'s `Simulation` runs the same trace on the same config, SP on and
   off: on the profile as measured, and on the profile with each model's prefill and decode
   curves scaled by the corrections the calibration runs measured (every cold instance keeps an EWMA of
   measured / profile-priced step time per model and kind of work; each run samples it from
   `/talaria/telemetry` every 0.5 s, and the scale is the mean over samples and runs). The live
   instance ran its steps about twice as slowly as `talaria profile`'s fastest-of-runs probes on this
   shared machine, which moves the workload from a round that fills two thirds of its bound to a
   saturated one; a prediction for the machine the runs actually had is the live-corrected one.
   These are mechanism costs (step times), never outcomes (profiles/README.md).
4. **Fitted** (from run 4, registered 2026-12-02 before it ran). The live instances record every
   step (`record_steps`: what it measured and what the profile alone priced its prompt chunks, host
   KV restores and decode chunks at), and per model a non-negative least-squares fit over the
   calibration runs' steps gives measured - priced restores = a_p x priced prefill + a_d x priced decode + b for each
   part the step has (from run 6: runs 4 and 5 fitted restores inside the prefill part). The
   simulator runs once more on the profile whose curves are scaled by a_p and a_d with b added to
   both fixed costs ("live-fitted"). Why: run 3's live-corrected prediction scaled whole curves by
   a mean ratio, which the frequent small steps dominate; a per-step cost of the serving loop
   (scheduling, sampling, the pipe) spread that way overprices the large SP steps and saturates the
   simulated rounds. The fit has a place for that cost.
5. **Live pairs.** `talaria up` with SP on, the trace replayed closed-loop (`talaria replay`'s
   synthesized bodies: fixed prompts, ignore_eos, greedy), stopped; then the same with
   `ablations = ["sp"]`. A pair's order alternates (on-off, off-on, ...) so drift in the machine's
   load falls on both sides equally; the default 4 pairs balance the two orders. The pairs record
   steps too, so they run as the calibration runs did; their steps are not used.

The statistic is the SCT sum over the 30 sessions (SCT: a session's first intended enqueue to its
last response), chosen before measuring: SP saves time per admitted continuation, and the sum adds
up every such saving, while the median of 30 sessions rests on the one or two in the middle, whose
SCT moves with where their returns fell in the rounds. A pair's ratio is SP-off sum / SP-on sum.

Must show (issue 20, item 5): the median ratio over pairs > 1, every pair's ratio > 1, and the
median within +-25% of the simulator's live-fitted ratio (runs 1-3 compared with the live-corrected
one; it and the as-measured one stay beside it).
Exit 1 when it does not hold (`--no-gate`: exit 0 for that, to explore), and whatever `--no-gate`
says when any call failed, when any call's text differs between runs
(SP may change when a call runs, never what it returns), or when the talaria sources changed
between runs (others edit this checkout; each run records a fingerprint of them). Progress on
stderr, the table on stdout, everything to the JSON (default bench/results/sp.json), with the load
average at the start and end of every run and each run's mean cost corrections.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import sp_workload as wl  # bench/sp_workload.py, beside this script
from report import ProgressLog, add_gate_flag, environment, gate, render, write_json  # bench/report.py
from server import start_server, stop_server, wait_healthy  # bench/server.py

from talaria.cli.replay_cmd import replay_sessions
from talaria.config.loader import load_config
from talaria.contracts.profile import ModelProfile, Profile
from talaria.contracts.profile_file import load_profile
from talaria.contracts.trace import TraceCall
from talaria.replay import ReplayResult, percentile, replay
from talaria.sim.simulation import SimOptions, Simulation

TOLERANCE = 0.25  # the median live ratio within +-25% of the simulator's
POLL_S = 0.5  # how often a live run samples the instance's cost corrections


def measure_profile(workdir: Path, log: ProgressLog) -> Path:
    config, out = workdir / "talaria-profile.toml", workdir / "profile.toml"
    config.write_text(wl.config_text([], None, None))
    log("profile: talaria profile --instance cold-0")
    subprocess.run([sys.executable, "-m", "talaria.cli.main", "profile", "--config", str(config),
                    "--instance", "cold-0", "--out", str(out)], check=True)
    return out


def code_fingerprint() -> str:
    """A hash of the talaria package's sources as a server started now would import them: in a
    shared checkout others edit, runs that saw different code are not a pair."""
    root = Path(__file__).resolve().parent.parent / "talaria"
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def config_file(workdir: Path, label: str, sp: bool, profile: Path, record_steps: bool = False) -> tuple[Path, Path]:
    events, config = workdir / f"events-{label}.jsonl", workdir / f"talaria-{label}.toml"
    config.write_text(wl.config_text([] if sp else ["sp"], events, profile.resolve(), record_steps))
    return config, events


# ---- live --------------------------------------------------------------------------------------

def live_run(label: str, sp: bool, trace: list[TraceCall], profile: Path, workdir: Path,
             log: ProgressLog) -> tuple[ReplayResult, dict, list[Step]]:
    """Start a server, warm every model up, replay the trace, stop; the result, its summary and
    its engine steps (the warm-up's included: they are steps of the same engine)."""
    config, events_path = config_file(workdir, label, sp, profile, record_steps=True)
    log_path = workdir / f"talaria-{label}.log"
    load_start, code = os.getloadavg()[0], code_fingerprint()
    proc, base_url = start_server(config, log_path)
    try:
        wait_healthy(proc, base_url, log_path)
        for model, *_ in wl.MODELS:  # first opens and runtime state, outside the measurement
            httpx.post(base_url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": "warm up", "max_tokens": 2, "temperature": 0}).raise_for_status()
        log(f"{label}: replaying {len(trace)} calls on {base_url} (load average {load_start:.2f})")
        result, scales = asyncio.run(replay_sampling(base_url, trace))
    finally:
        stop_server(proc)
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
    summary = {"label": label, "sp": sp, "code": code, **run_summary(result, events), "cost_scale_mean": scales,
               "load_average": {"start": load_start, "end": os.getloadavg()[0]}}
    steps = [Step(e["model"], e["priced_prefill_s"], e["priced_decode_s"], e["seconds"], e["priced_restore_s"])
             for e in events if e["kind"] == "step" and not e.get("switch")]
    summary["steps"] = len(steps)
    log(f"{label}: SCT sum {summary['sct_sum_s']:.1f} s, {summary['sp_admissions']} SP admissions, "
        f"{summary['rounds']} rounds, {summary['errors']} failed calls, {len(steps)} steps")
    return result, summary, steps


async def replay_sampling(base_url: str, trace: list[TraceCall]) -> tuple[ReplayResult, dict[str, float]]:
    """The closed-loop replay, and beside it the instance's cost corrections (measured / profile-priced
    step time, the EWMA every cold instance keeps per model and kind of work) sampled every POLL_S:
    their mean per "model/kind" is how far this run's steps were from the profile."""
    samples: dict[str, list[float]] = {}
    done = asyncio.Event()

    async def poll() -> None:
        async with httpx.AsyncClient(timeout=5) as http:
            while not done.is_set():
                try:
                    body = (await http.get(base_url + "/talaria/telemetry")).json()
                    stats = body["instances"]["cold-0"]["stats"] or {}
                    for key, scale in (stats.get("cost_scale") or {}).items():
                        samples.setdefault(key, []).append(scale)
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    pass  # a missed sample; the next one will do
                try:
                    await asyncio.wait_for(done.wait(), POLL_S)
                except TimeoutError:
                    pass

    poller = asyncio.create_task(poll())
    try:
        result = await replay(base_url, replay_sessions(trace, "completions"), gap_cap_s=wl.GAP_CAP_S)
    finally:
        done.set()
        await poller
    return result, {k: statistics.fmean(v) for k, v in sorted(samples.items())}


def run_summary(result: ReplayResult, events: list[dict]) -> dict:
    kinds = Counter(e["kind"] for e in events)
    rounds = [e["wall_s"] for e in events if e["kind"] == "round"]
    return {**result.summary(), "sp_admissions": kinds.get("sp_admit", 0), "sp_parks": kinds.get("sp_park", 0),
            "rounds": len(rounds), "switches": kinds.get("switch", 0),
            "round_wall_p50_s": percentile(rounds, 50) if rounds else None,
            "sct_s": {s.session_id: s.sct_s for s in result.sessions}}


# ---- simulated ---------------------------------------------------------------------------------

def simulate(trace: list[TraceCall], profile: Profile, profile_path: Path, workdir: Path, log: ProgressLog,
             name: str) -> dict:
    """The simulator's SCT sums with SP on and off for the same trace and config, on `profile`."""
    out = {}
    for label, sp in (("sim-on", True), ("sim-off", False)):
        config, _ = config_file(workdir, f"{name}-{label}", sp, profile_path)
        r = Simulation(load_config(config), profile, trace, SimOptions(gap_cap_s=wl.GAP_CAP_S)).run()
        sct, sessions = list(r.sct_s.values()), len({c.session for c in trace})
        if len(sct) != sessions:
            raise SystemExit(f"{name} {label}: the simulation finished {len(sct)} sessions of {sessions}")
        walls = [x["wall_s"] for x in r.rounds]
        out[label] = {"sct_sum_s": sum(sct), "sct_p50_s": percentile(sct, 50), "virtual_s": r.virtual_s,
                      "sp_admissions": r.counts.get("sp_admit", 0), "sp_parks": r.counts.get("sp_park", 0),
                      "rounds": len(r.rounds), "switches": len(r.switches),
                      "round_wall_p50_s": percentile(walls, 50) if walls else None,
                      "errors": sum(c.error is not None for c in r.calls), "sct_s": r.sct_s}
        log(f"{name} {label}: SCT sum {out[label]['sct_sum_s']:.1f} s in {r.virtual_s:.1f} virtual s "
            f"({r.wall_s:.1f} s wall), {out[label]['sp_admissions']} SP admissions")
    out["ratio"] = out["sim-off"]["sct_sum_s"] / out["sim-on"]["sct_sum_s"]
    return out


def rescaled(mp: ModelProfile, prefill: float, decode: float, per_part_s: float = 0.0) -> ModelProfile:
    """`mp` with its prefill curve scaled by `prefill`, its decode curve by `decode`, and `per_part_s`
    added to each curve's fixed cost."""
    p, d = mp.prefill, mp.decode
    return dataclasses.replace(
        mp,
        prefill=dataclasses.replace(p, base_s=p.base_s * prefill + per_part_s, per_token_s=p.per_token_s * prefill,
                                    per_token_context_s=p.per_token_context_s * prefill),
        decode=dataclasses.replace(d, base_s=d.base_s * decode + per_part_s, per_seq_s=d.per_seq_s * decode,
                                   per_context_token_s=d.per_context_token_s * decode))


def corrected(profile: Profile, runs: list[dict]) -> tuple[Profile, dict[str, float]]:
    """The profile with each model's prefill and decode curves scaled by the mean correction the
    live runs measured (over all runs, SP on and off alike: one machine, one set of costs)."""
    keys = {k for r in runs for k in r["cost_scale_mean"]}
    scale = {k: statistics.fmean(r["cost_scale_mean"][k] for r in runs if k in r["cost_scale_mean"])
             for k in sorted(keys)}
    models = {name: rescaled(mp, scale.get(f"{name}/prefill", 1.0), scale.get(f"{name}/decode", 1.0))
              for name, mp in profile.models.items()}
    return dataclasses.replace(profile, models=models, method=profile.method + ", scaled by live corrections"), scale


@dataclass(frozen=True, slots=True)
class Step:
    """One live engine step: what the profile alone priced its parts at, and what it took."""

    model: str
    priced_prefill_s: float  # prompt chunks (`Profile.step_parts`' prefill part)
    priced_decode_s: float
    seconds: float
    priced_restore_s: float = 0.0  # host KV restores: kept at the profile's price, not fitted


@dataclass(frozen=True, slots=True)
class StepFit:
    """measured = prefill x priced prefill + decode x priced decode + per_part_s for each part the
    step has (one for a prefill or a decode step, two for a mixed one)."""

    prefill: float
    decode: float
    per_part_s: float
    steps: int
    r2: float  # share of the measured variance the fit explains


def fit_steps(steps: list[Step]) -> StepFit:
    """Non-negative least squares over one model's steps, of their time less their restores' price
    (three coefficients: every subset solved unconstrained, the best one with none negative kept).
    A coefficient whose part too few steps have (fewer than the coefficients) is not fitted: a scale
    stays 1, the per-part cost 0."""
    x = np.array([[s.priced_prefill_s, s.priced_decode_s, (s.priced_prefill_s > 0) + (s.priced_decode_s > 0)]
                  for s in steps], dtype=float).reshape(-1, 3)
    y = np.array([s.seconds - s.priced_restore_s for s in steps], dtype=float)
    fixed = np.array([1.0, 1.0, 0.0])
    free = [j for j in range(3) if np.count_nonzero(x[:, j]) >= 3]
    for j in range(3):
        if j not in free:
            y = y - fixed[j] * x[:, j]
    best, best_sse = np.where(np.isin(np.arange(3), free), 0.0, fixed), float(y @ y)
    for cols in itertools.chain.from_iterable(itertools.combinations(free, k) for k in range(1, len(free) + 1)):
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (coef < 0).any():
            continue
        sse = float(((x[:, cols] @ coef - y) ** 2).sum())
        if sse < best_sse:
            best_sse = sse
            best = np.where(np.isin(np.arange(3), free), 0.0, fixed)
            best[list(cols)] = coef
    sst = float(((y - y.mean()) ** 2).sum()) if len(y) else 0.0
    return StepFit(float(best[0]), float(best[1]), float(best[2]), len(steps), 1 - best_sse / sst if sst else 1.0)


def fitted(profile: Profile, steps: list[Step]) -> tuple[Profile, dict[str, StepFit]]:
    """The profile whose prefill and decode curves are the live steps' fit per model (`fit_steps`, over
    every live run, SP on and off): each curve scaled by its coefficient, and the per-part cost added
    to both fixed costs (`base_s`), which a step pays once per part, as the fit does. What a
    multiplicative correction cannot express: a per-step cost of the serving loop (scheduling,
    sampling, the pipe), which a ratio would spread over every token and so overprice large steps.
    Host KV restores stay priced from the profile's bandwidth, as the fit takes them."""
    fits = {name: fit_steps([s for s in steps if s.model == name]) for name in profile.models
            if any(s.model == name for s in steps)}
    models = {**profile.models, **{name: rescaled(profile.models[name], f.prefill, f.decode, f.per_part_s)
                                   for name, f in fits.items()}}
    return dataclasses.replace(profile, models=models, method=profile.method + ", fitted to live steps"), fits


# ---- report ------------------------------------------------------------------------------------

def verdict(ratios: list[float], sim_ratio: float) -> dict:
    median = statistics.median(ratios)
    checks = {"median_above_1": median > 1, "every_pair_above_1": all(r > 1 for r in ratios),
              "within_tolerance_of_sim": abs(median / sim_ratio - 1) <= TOLERANCE}
    return {"ratios": ratios, "median": median, "min": min(ratios), "max": max(ratios), "sim_ratio": sim_ratio,
            "median_over_sim": median / sim_ratio, "tolerance": TOLERANCE, **checks, "holds": all(checks.values())}


def table(pairs: list[dict], sims: dict[str, dict], v: dict, calibration: list[dict] = ()) -> str:
    def ms(run: dict) -> str:
        return "-" if run["round_wall_p50_s"] is None else f"{run['round_wall_p50_s'] * 1e3:.0f}"

    def row(name: str, on: dict, off: dict, ratio: float, load: str) -> tuple[str, ...]:
        return (name, f"{on['sct_sum_s']:.1f}", f"{off['sct_sum_s']:.1f}", f"{ratio:.3f}", str(on["sp_admissions"]),
                f"{on['sp_parks']}/{off['sp_parks']}", f"{on['rounds']}/{off['rounds']}", f"{ms(on)}/{ms(off)}", load)

    rows = [("pair (order)", "SCT sum on s", "SCT sum off s", "off/on", "SP admits on", "parks on/off",
             "rounds on/off", "round p50 on/off ms", "load on/off")]
    for i, p in enumerate(pairs, 1):
        load = f"{p['on']['load_average']['start']:.1f}/{p['off']['load_average']['start']:.1f}"
        rows.append(row(f"{i} ({p['order']})", p["on"], p["off"], p["ratio"], load))
    for i in range(0, len(calibration) - 1, 2):  # fit runs alternate on, off: shown in twos, not judged
        on, off = calibration[i], calibration[i + 1]
        load = f"{on['load_average']['start']:.1f}/{off['load_average']['start']:.1f}"
        rows.append(row(f"calibration {i // 2 + 1} (on-off, fitted, not judged)", on, off,
                        off["sct_sum_s"] / on["sct_sum_s"], load))
    for name, sim in sims.items():
        rows.append(row(f"simulator, {name}", sim["sim-on"], sim["sim-off"], sim["ratio"], "-"))
    summary = (f"median off/on {v['median']:.3f} (min {v['min']:.3f}, max {v['max']:.3f}); simulator "
               f"{v['sim_ratio']:.3f}; median/simulator {v['median_over_sim']:.3f} (within +-{TOLERANCE:.0%}: "
               f"{'yes' if v['within_tolerance_of_sim'] else 'no'}); every pair > 1: "
               f"{'yes' if v['every_pair_above_1'] else 'no'}; must-show {'holds' if v['holds'] else 'does NOT hold'}")
    return render(rows) + "\n" + summary


def same_text(result: ReplayResult, texts: dict[tuple[str, int], str], differing: set[tuple[str, int]]) -> None:
    """Note in `differing` every call whose text differs from the first run's (kept in `texts`)."""
    for c in result.calls:
        if texts.setdefault((c.session_id, c.index), c.text) != c.text:
            differing.add((c.session_id, c.index))


def calibration_runs(n: int, trace: list[TraceCall], profile: Path, workdir: Path, log: ProgressLog,
                     texts: dict, differing: set) -> tuple[list[dict], list[Step]]:
    """`n` step-recording runs, SP on and off in turn, made before the pairs and apart from them: the
    live-corrected and live-fitted predictions come from these runs alone, never from the pairs they
    are judged against (issue 38)."""
    runs, steps = [], []
    for i in range(n):
        sp = i % 2 == 0
        result, summary, run_steps = live_run(f"fit{i + 1}-{'on' if sp else 'off'}", sp, trace, profile, workdir, log)
        same_text(result, texts, differing)
        runs.append(summary)
        steps += run_steps
    return runs, steps


def live_pairs(n: int, trace: list[TraceCall], profile: Path, workdir: Path, log: ProgressLog,
               texts: dict, differing: set) -> tuple[list[dict], list[dict]]:
    """`n` pairs in alternating order: the pairs and every run's summary. Their steps are recorded (so
    the pairs run as the calibration runs did) but go into no prediction."""
    runs, pairs = [], []
    for i in range(n):
        pair: dict = {"order": "on-off" if i % 2 == 0 else "off-on"}
        for sp in ((True, False) if i % 2 == 0 else (False, True)):
            result, summary, _ = live_run(f"pair{i + 1}-{'on' if sp else 'off'}", sp, trace, profile, workdir, log)
            same_text(result, texts, differing)
            runs.append(summary)
            pair["on" if sp else "off"] = summary
        pair["ratio"] = pair["off"]["sct_sum_s"] / pair["on"]["sct_sum_s"]
        log(f"pair {i + 1}: off/on {pair['ratio']:.3f}")
        pairs.append(pair)
    return pairs, runs


def predictions(trace: list[TraceCall], profile: Profile, path: Path, calibration: list[dict],
                steps: list[Step], workdir: Path, log: ProgressLog) -> tuple[dict[str, dict], dict, dict]:
    """The simulator's SP off/on predictions: on the profile as measured, live-corrected and
    live-fitted, the last two from the calibration runs' corrections and steps only."""
    sims = {"profile": simulate(trace, profile, path, workdir, log, "profile")}
    live_profile, scales = corrected(profile, calibration)
    log("corrections: " + ", ".join(f"{k} {s:.2f}" for k, s in sorted(scales.items())))
    sims["live-corrected"] = simulate(trace, live_profile, path, workdir, log, "live-corrected")
    fit_profile, fits = fitted(profile, steps)
    log("fits: " + "; ".join(f"{m} prefill x{f.prefill:.2f}, decode x{f.decode:.2f}, "
                              f"+{f.per_part_s * 1e3:.2f} ms a part (R2 {f.r2:.2f}, {f.steps} steps)"
                              for m, f in fits.items()))
    sims["live-fitted"] = simulate(trace, fit_profile, path, workdir, log, "live-fitted")
    return sims, scales, fits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=Path("bench/results/sp.json"), help="where to write results")
    ap.add_argument("--pairs", type=int, default=4, help="SP on/off pairs, alternating order (at least 3)")
    ap.add_argument("--profile", type=Path, help="a profile of this instance instead of measuring one")
    ap.add_argument("--workdir", type=Path, help="keep configs, server logs and event logs here")
    ap.add_argument("--fit-runs", type=int, default=2,
                    help="step-recording runs before the pairs, SP on and off in turn, that the predictions "
                         "are fitted on (at least 2: the fit needs both modes' steps)")
    add_gate_flag(ap)
    args = ap.parse_args(argv)
    if args.pairs < 3:
        ap.error("--pairs must be at least 3: one pair cannot tell an effect from noise")
    if args.fit_runs < 2:
        ap.error("--fit-runs must be at least 2: one SP-on and one SP-off run to fit the steps of both modes")

    log = ProgressLog()
    load_start = os.getloadavg()[0]
    trace = wl.workload()
    with tempfile.TemporaryDirectory(prefix="talaria-sp-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        log(f"workdir {workdir}, {len(trace)} calls, load average {load_start:.2f}")
        path = args.profile or measure_profile(workdir, log)
        profile = load_profile(path)
        texts: dict[tuple[str, int], str] = {}
        differing: set[tuple[str, int]] = set()
        calibration, steps = calibration_runs(args.fit_runs, trace, path, workdir, log, texts, differing)
        # the prediction is made and logged before a single pair runs
        sims, scales, fits = predictions(trace, profile, path, calibration, steps, workdir, log)
        log(f"prediction (live-fitted, from {len(calibration)} calibration runs): off/on "
            f"{sims['live-fitted']['ratio']:.3f}")
        pairs, runs = live_pairs(args.pairs, trace, path, workdir, log, texts, differing)
        profile_text = path.read_text()
    v = verdict([p["ratio"] for p in pairs], sims["live-fitted"]["ratio"])
    print(f"workload: {len(trace)} calls, 3 models x {wl.SESSIONS_PER_MODEL} sessions x {wl.DEPTH} calls, "
          f"round {wl.ROUND_S} s, gaps median {wl.GAP.median * 1e3:.0f} ms; statistic: SCT sum over sessions")
    print(table(pairs, sims, v, calibration))
    errors = sum(r["errors"] for r in runs + calibration)
    result = {"must_show": v, "pairs": [{"order": p["order"], "ratio": p["ratio"]} for p in pairs],
              "runs": runs, "calibration_runs": calibration, "simulator": {**sims, "corrections": scales,
                            "fits": {m: dataclasses.asdict(f) for m, f in fits.items()}}, "workload": wl.describe(),
              "calls": len(trace), "outputs_identical": not differing,
              "differing_calls": sorted(map(list, differing)), "failed_calls": errors,
              "profile": str(args.profile or "measured by talaria profile"), "profile_toml": profile_text,
              **environment(log, load_start)}
    write_json(args.json, result, log)

    failures, missed = [], []
    if errors:
        failures.append(f"{errors} calls failed over {len(runs) + len(calibration)} runs (see {args.json}: "
                        "runs[*].errors, calibration_runs[*].errors)")
    if differing:
        failures.append(f"{len(differing)} calls returned different text across runs, first {min(differing)}: "
                        "SP must change when a call runs, never what it returns")
    codes = sorted({r["code"] for r in calibration + runs})
    if len(codes) > 1:
        failures.append(f"the talaria sources changed between runs ({', '.join(codes)}; runs[*].code): "
                        "the pairs compare different code; run again on a quiet checkout")
    if not v["holds"]:
        missed.append(f"the must-show does not hold: median {v['median']:.3f}, pairs "
                      f"{', '.join(f'{r:.3f}' for r in v['ratios'])}, simulator {v['sim_ratio']:.3f}")
    return gate(missed, failures, args.no_gate)


if __name__ == "__main__":
    sys.exit(main())
