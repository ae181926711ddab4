"""Every bar of the paper's TP=8 evaluation beside the simulator's, seed by seed (issue 35).

    python bench/paper_figures.py [--seeds 0,1,2] [--ttft 20] [--json PATH] [--procs 2]

The workload is fixed by issue 35, not chosen here: `talaria trace gen --preset paper-tp8 --seed S`
(960 calls, 30 model-sessions) on profiles/paper-tp8.toml's own topology at T_ttft 20 s with the
profile's prefill intercept, every variant of Figure 7 (talaria, no-sp, no-hkvr, h2d-only,
round-only). The paper's values are read from ../shared/data/paper-figures.toml, never typed here.

Each row prints the paper's value, ours per seed and ours / paper. A row with a band (the five
p50s within +-25 % of the paper's, the SP admission rate within 35-60 %) says whether every seed
lands in it; a row that cannot get there without a fitted knob has its reason in
docs/simulator.md ("Every bar against the paper"). Every run is reported, not the best seed.

Progress goes to stderr, the table to stdout, everything to the JSON (default
bench/results/paper_figures.json). Exits 1 when a banded row misses on any seed.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tomllib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: this tree's talaria first

from report import ProgressLog, environment, render, write_json  # bench/report.py, beside this script

from talaria.contracts.profile_file import load_profile
from talaria.sim.report import summary, variant
from talaria.sim.simulation import Simulation, profile_topology
from talaria.trace.generate import generate, preset

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT.parent / "shared" / "data" / "paper-figures.toml"
VARIANTS = ("talaria", "no-sp", "no-hkvr", "h2d-only", "round-only")

# (label, paper key as "table.key", how ours is read from {variant: summary}, band on ours/paper or on ours)
# The band is issue 35's must-show: ("ratio", lo, hi) on ours / paper, ("value", lo, hi) on ours.
ROWS = (
    ("Talaria p50 SCT (s)", "sct_tp8.talaria_p50", lambda r: r["talaria"]["sct_p50_s"], ("ratio", 0.75, 1.25)),
    ("Talaria p95 SCT (s)", "sct_tp8.talaria_p95", lambda r: r["talaria"]["sct_p95_s"], None),
    ("no-SP p50 SCT (s)", "sct_tp8.no_sp_p50", lambda r: r["no-sp"]["sct_p50_s"], ("ratio", 0.75, 1.25)),
    ("no-HKVR p50 SCT (s)", "sct_tp8.no_hkvr_p50", lambda r: r["no-hkvr"]["sct_p50_s"], ("ratio", 0.75, 1.25)),
    ("H2D-only p50 SCT (s)", "sct_tp8.h2d_only_p50", lambda r: r["h2d-only"]["sct_p50_s"], ("ratio", 0.75, 1.25)),
    ("H2D-only p95 SCT (s)", "sct_tp8.h2d_only_p95", lambda r: r["h2d-only"]["sct_p95_s"], None),
    ("Round-only p50 SCT (s)", "sct_tp8.round_only_p50", lambda r: r["round-only"]["sct_p50_s"],
     ("ratio", 0.75, 1.25)),
    ("Round-only p95 SCT (s)", "sct_tp8.round_only_p95", lambda r: r["round-only"]["sct_p95_s"], None),
    ("Round-only / Talaria p50", None, lambda r: r["round-only"]["sct_p50_s"] / r["talaria"]["sct_p50_s"], None),
    ("Talaria TTFT p50 (s)", "ttft_tp8.talaria_p50", lambda r: r["talaria"]["ttft_p50_s"], None),
    ("no-SP TTFT p50 (s)", "ttft_tp8.no_sp_p50", lambda r: r["no-sp"]["ttft_p50_s"], None),
    ("Round-only TTFT p50 (s)", "ttft_tp8.round_only_p50", lambda r: r["round-only"]["ttft_p50_s"], None),
    ("SP admission rate (Fig. 10)", "sp_tp8.sp_admission_rate", lambda r: r["talaria"]["sp_admission_rate"],
     ("value", 0.35, 0.60)),
    ("Talaria rounds", "sp_tp8.rounds_talaria", lambda r: r["talaria"]["rounds"], None),
    ("Round-only rounds", "sp_tp8.rounds_round_only", lambda r: r["round-only"]["rounds"], None),
    ("Talaria switch p50 (ms)", "switch_tp8.talaria_p50_ms", lambda r: r["talaria"]["switch_p50_ms"], None),
    ("H2D-only switch p50 (ms)", "switch_tp8.h2d_only_p50_ms", lambda r: r["h2d-only"]["switch_p50_ms"], None),
    ("peak HBM per GPU (GiB, Fig. 15)", "testbed_tp8.hbm_peak_gib",
     lambda r: max(s["hbm_peak_gib"] for s in r.values()), None),
)


def missing_figures(path: Path = FIGURES) -> str | None:
    """Why the paper's figures cannot be read from `path`, or None when they can."""
    if path.is_file():
        return None
    return (f"no paper figures at {path} (the project's shared data, beside this repository: "
            "shared/data/paper-figures.toml); pass --figures PATH")


def paper_values(path: Path = FIGURES) -> dict[str, float]:
    """The paper's value of each row, from its figures file; a missing file is a clear error, not a traceback."""
    if (why := missing_figures(path)) is not None:
        raise SystemExit(f"paper_figures: {why}")
    figures = tomllib.loads(path.read_text())
    out = {}
    for label, key, _, _ in ROWS:
        if key is not None:
            table, name = key.split(".")
            out[label] = figures[table][name]
    sct = figures["sct_tp8"]
    out["Round-only / Talaria p50"] = sct["round_only_p50"] / sct["talaria_p50"]
    return out


def run_one(seed: int, ttft_s: float, name: str) -> tuple[int, str, dict]:
    profile = load_profile(ROOT / "profiles" / "paper-tp8.toml")
    trace = list(generate(preset("paper-tp8"), random.Random(seed)).calls)
    config = profile_topology(profile, ttft_s)
    return seed, name, summary(Simulation(variant(config, name), profile, trace).run())


def rows_of(runs: dict[int, dict[str, dict]], paper: dict[str, float]) -> list[dict]:
    """One dict per row: the paper's value (`paper_values`), ours and the ratio per seed, and whether
    its band holds."""
    out = []
    for label, _, read, band in ROWS:
        p = paper[label]
        ours = {seed: read(r) for seed, r in runs.items()}
        ratio = {seed: v / p for seed, v in ours.items()}
        held = None
        if band is not None:
            kind, lo, hi = band
            held = all(lo <= (ratio[s] if kind == "ratio" else ours[s]) <= hi for s in ours)
        out.append({"row": label, "paper": p, "ours": ours, "ratio": ratio, "band": band, "held": held})
    return out


def table(rows: list[dict]) -> str:
    seeds = list(rows[0]["ours"])
    head = ("row", "paper", *(f"seed {s}" for s in seeds), *(f"ratio {s}" for s in seeds), "band")
    lines = [head]
    for r in rows:
        band = "" if r["held"] is None else ("yes" if r["held"] else "NO")
        fmt = _pct if "rate" in r["row"] else _fmt
        lines.append((r["row"], fmt(r["paper"]), *(fmt(r["ours"][s]) for s in seeds),
                      *(f"{r['ratio'][s]:.2f}" for s in seeds), band))
    return render(lines)


def _fmt(v: float) -> str:
    return f"{v:,.2f}" if v < 20 else f"{v:,.0f}"


def _pct(v: float) -> str:
    return f"{v:.1%}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2", help="trace seeds, comma-separated (default: 0,1,2)")
    ap.add_argument("--ttft", type=float, default=20.0, help="T_ttft in seconds (default: 20, issue 35's)")
    ap.add_argument("--procs", type=int, default=2, help="simulations run at once (default: 2)")
    ap.add_argument("--figures", type=Path, default=FIGURES, help=f"the paper's figures (default: {FIGURES})")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "paper_figures.json",
                    help="where to write every run (default: bench/results/paper_figures.json)")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    paper = paper_values(args.figures)  # before minutes of simulation, not after
    log = ProgressLog()
    load = os.getloadavg()[0]
    runs: dict[int, dict[str, dict]] = {s: {} for s in seeds}
    with ProcessPoolExecutor(args.procs) as pool:
        futures = [pool.submit(run_one, s, args.ttft, v) for s in seeds for v in VARIANTS]
        for f in futures:
            seed, name, s = f.result()
            runs[seed][name] = s
            log(f"seed {seed} {name}: SCT p50 {s['sct_p50_s']:.1f} p95 {s['sct_p95_s']:.1f}, "
                f"SP rate {s['sp_admission_rate']:.1%}, HBM peak {s['hbm_peak_gib']:.1f} GiB ({s['wall_s']:.0f} s)")
    rows = rows_of(runs, paper)
    print(table(rows))
    write_json(args.json, {"ttft_s": args.ttft, "seeds": seeds, "rows": rows, "runs": runs,
                           **environment(log, load)}, log)
    return 0 if all(r["held"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
