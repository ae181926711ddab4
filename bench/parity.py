"""Predictive parity: the simulator, given only a measured CPU profile, against a live CPU run.

    python bench/parity.py [--config PATH] [--instance NAME] [--profile PATH] [--sessions N]
                           [--max-prompt-tokens N] [--seed S] [--json PATH] [--no-gate]

1. **Profile.** `talaria profile --config C --instance I` measures the instance on this machine by
   microbenchmarks (prefill, decode, switch paths, copy bandwidth), unless `--profile` names one.
2. **Trace.** `talaria.trace.generate` writes `--sessions` agent sessions (the paper's §2.1
   depths, gaps and reuse) over the instance's models, scaled so the longest prompt fits
   `--max-prompt-tokens` (the synthetic models' context is 2,048).
3. **Live.** `talaria up --config C` (the embedded default config unless `--config`), and the
   trace replayed closed-loop against it as `talaria replay` does (fixed bodies, ignore_eos,
   recorded gaps): each session's completion time (SCT).
4. **Simulated.** `talaria sim`'s `Simulation` on the same config's instances serving the trace's
   models, charging the profile alone (no live step times): each session's SCT.

`sct_error` is the mean over sessions of |SCT_sim - SCT_live| / SCT_live; the table also gives the
relative error of the SCT sum, p50 and p95. The target is `sct_error <= 0.25`. The live instance
measures its own start-up profile (or loads the cached one) and corrects it with measured step
times; the simulator has only the profile file. Exits 1 when the target is missed (`--no-gate`: exit
0, to explore) and, whatever `--no-gate` says, when a live call failed or the simulation did not
finish every session. Progress goes to stderr, the table to stdout, everything to the JSON file
(default bench/results/parity.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from report import (  # bench/report.py, beside this script
    ProgressLog,
    add_gate_flag,
    environment,
    gate,
    render,
    write_json,
)
from server import start_server, stop_server, wait_healthy  # bench/server.py

from talaria.cli.replay_cmd import replay_sessions
from talaria.config.loader import default_config_path, load_config
from talaria.contracts.profile_file import load_profile
from talaria.contracts.trace import TraceCall
from talaria.replay import percentile, replay_sync
from talaria.sim.simulation import Simulation
from talaria.trace.generate import TraceSpec, generate

TARGET = 0.25


def measure_profile(config: Path, instance: str, out: Path, log: ProgressLog) -> Path:
    log(f"profile: talaria profile --instance {instance} (progress below)")
    subprocess.run([sys.executable, "-m", "talaria.cli.main", "profile", "--config", str(config),
                    "--instance", instance, "--out", str(out)], check=True)
    return out


def make_trace(models: tuple[str, ...], sessions: int, max_prompt_tokens: int, seed: int) -> list[TraceCall]:
    spec = TraceSpec(sessions, models, max_prompt_tokens=max_prompt_tokens)
    return list(generate(spec, random.Random(seed)).calls)


def run_live(config: Path, trace: list[TraceCall], log: ProgressLog, workdir: Path) -> dict[str, float]:
    log_path = workdir / "talaria.log"
    proc, base_url = start_server(config, log_path)
    try:
        wait_healthy(proc, base_url, log_path)
        log(f"live: serving on {base_url}; replaying {len(trace)} calls")
        result = replay_sync(base_url, replay_sessions(trace, "completions"))
    finally:
        stop_server(proc)
    failed = [c for c in result.calls if not c.ok]
    if failed:
        raise SystemExit(f"{len(failed)} live call(s) failed; first: {failed[0].error} (log: {log_path})")
    return {s.session_id: s.sct_s for s in result.sessions}


def run_sim(config: Path, profile: Path, trace: list[TraceCall], log: ProgressLog) -> tuple[dict[str, float], dict]:
    cfg = load_config(config)
    models = {c.model for c in trace}
    instances = tuple(i for i in cfg.instances if models & set(i.models))
    result = Simulation(dataclasses.replace(cfg, instances=instances), load_profile(profile), trace).run()
    log(f"sim: {result.virtual_s:.1f} virtual s in {result.wall_s:.1f} s")
    return result.sct_s, {"switches": len(result.switches), "rounds": len(result.rounds),
                          "sp_admits": result.counts.get("sp_admit", 0), "virtual_s": result.virtual_s}


AGGREGATES = {"sum": sum, "p50": lambda v: percentile(v, 50), "p95": lambda v: percentile(v, 95)}


def compare(live: dict[str, float], sim: dict[str, float]) -> dict:
    names = sorted(live)
    missing = [n for n in names if n not in sim]
    if missing:
        raise SystemExit(f"the simulation did not finish sessions {', '.join(missing)}")
    per = {n: {"live_s": live[n], "sim_s": sim[n], "error": abs(sim[n] - live[n]) / live[n]} for n in names}
    lv, sv = [live[n] for n in names], [sim[n] for n in names]
    out = {"sct_error": sum(p["error"] for p in per.values()) / len(per), "live": {}, "sim": {}, "sessions": per}
    for stat, f in AGGREGATES.items():
        out["live"][f"sct_{stat}_s"], out["sim"][f"sct_{stat}_s"] = f(lv), f(sv)
        out[f"sct_{stat}_error"] = abs(f(sv) - f(lv)) / f(lv)
    return out


def table(m: dict) -> str:
    rows = [("session", "live SCT s", "sim SCT s", "error")]
    for name, p in m["sessions"].items():
        rows.append((name, f"{p['live_s']:.2f}", f"{p['sim_s']:.2f}", f"{p['error']:.1%}"))
    for stat in AGGREGATES:
        key = f"sct_{stat}_s"
        rows.append((stat, f"{m['live'][key]:.2f}", f"{m['sim'][key]:.2f}", f"{m[f'sct_{stat}_error']:.1%}"))
    rows.append(("sct_error (mean per session)", "", "", f"{m['sct_error']:.1%}"))
    return render(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=default_config_path(), help="talaria.toml (default: embedded)")
    ap.add_argument("--instance", default="cold-0", help="the instance to profile and serve the trace")
    ap.add_argument("--profile", type=Path, help="use this profile instead of measuring one")
    ap.add_argument("--sessions", type=int, default=6, help="agent sessions in the trace")
    ap.add_argument("--max-prompt-tokens", type=int, default=1536, help="scale the trace to this context")
    ap.add_argument("--seed", type=int, default=0, help="trace seed")
    ap.add_argument("--json", type=Path, default=Path("bench/results/parity.json"), help="where to write results")
    add_gate_flag(ap)
    args = ap.parse_args(argv)
    log = ProgressLog()
    load_start = os.getloadavg()[0]
    cfg = load_config(args.config)
    inst = next((i for i in cfg.instances if i.name == args.instance), None)
    if inst is None:
        ap.error(f"{args.config} has no instance {args.instance!r}")
    with tempfile.TemporaryDirectory(prefix="talaria-bench-parity-") as tmp:
        workdir = Path(tmp)
        profile = args.profile or measure_profile(args.config, inst.name, workdir / "profile.toml", log)
        trace = make_trace(inst.models, args.sessions, args.max_prompt_tokens, args.seed)
        log(f"trace: {args.sessions} sessions, {len(trace)} calls on {', '.join(inst.models)}")
        live = run_live(args.config, trace, log, workdir)
        sim, sim_info = run_sim(args.config, profile, trace, log)
        profile_text = profile.read_text()
    m = compare(live, sim)
    print(table(m))
    met = m["sct_error"] <= TARGET
    result = {**m, "target": TARGET, "met": met, "sim_run": sim_info,
              "config": {"config": str(args.config), "instance": args.instance, "sessions": args.sessions,
                         "calls": len(trace), "max_prompt_tokens": args.max_prompt_tokens, "seed": args.seed,
                         "profile": str(args.profile) if args.profile else "measured by talaria profile"},
              "profile_toml": profile_text, **environment(log, load_start)}
    write_json(args.json, result, log)
    return gate([] if met else [f"sct_error {m['sct_error']:.1%} > {TARGET:.0%}"], [], args.no_gate)


if __name__ == "__main__":
    sys.exit(main())
