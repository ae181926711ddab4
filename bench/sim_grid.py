"""The paper-tp8 grid: does Talaria beat round-only and every ablation at every TTFT target?

    python bench/sim_grid.py [--seeds 0,1] [--ttft 5,10,20,30] [--intercepts profile,2.1]
                             [--variants talaria,no-sp,no-hkvr,h2d-only,round-only] [--json PATH]
                             [--sp-batch paper|pays]

The workload is fixed by issue 20, not chosen here: `talaria trace gen --preset paper-tp8 --seed S`
(960 calls, 30 model-sessions) on profiles/paper-tp8.toml's own topology (one TP=8 cold instance,
`tpot_s` 0.2, `gamma` 0.8), for T_ttft in {5, 10, 20, 30} s and both prefill intercepts: the
profile's (one forward's fixed cost, the decode base) and 2.1 s (the smallest exact fit of the
paper's recompute TTFTs, profiles/README.md). Each cell runs every variant; a cell passes when
Talaria's SCT p50 and p95 are each at most 1.02 x every other variant's. Every cell is reported,
passing or not. `--sp-batch` sets every variant's SP admission rule (talaria/instance/sp_batch.py;
default: the config's default).

After the grid, the cells at T_ttft 20 s and the profile's intercept are printed against the
paper's figures as bench/paper_figures.py prints them (issue 35). Progress goes to stderr, one table
row per cell to stdout, everything to the JSON (default
bench/results/sim_grid.json). Exits 1 when a cell fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: this tree's talaria first

from paper_figures import VARIANTS, rows_of  # bench/paper_figures.py, beside this script
from paper_figures import table as paper_table
from report import (  # bench/report.py, beside this script
    ProgressLog,
    environment,
    render,
    write_json,
)

from talaria.config.schema import SpBatch
from talaria.contracts.profile_file import load_profile
from talaria.sim.report import summary, variant
from talaria.sim.simulation import Simulation, profile_topology
from talaria.trace.generate import generate, preset

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1.02  # Talaria may be at most 2 % worse than a comparison (issue 20)


def run_cell(seed: int, ttft_s: float, intercept: str, variants: list[str], sp_batch: SpBatch | None = None) -> dict:
    profile = load_profile(ROOT / "profiles" / "paper-tp8.toml")
    if intercept != "profile":
        profile = profile.with_prefill_base(float(intercept))
    trace = list(generate(preset("paper-tp8"), random.Random(seed)).calls)
    config = profile_topology(profile, ttft_s)
    if sp_batch is not None:
        config = dataclasses.replace(config, instances=tuple(dataclasses.replace(i, sp_batch=sp_batch)
                                                             for i in config.instances))
    results = {v: summary(Simulation(variant(config, v), profile, trace).run()) for v in variants}
    talaria = results["talaria"]
    worst = {q: max(talaria[f"sct_{q}_s"] / r[f"sct_{q}_s"] for v, r in results.items() if v != "talaria")
             for q in ("p50", "p95")}
    return {"seed": seed, "ttft_s": ttft_s, "intercept": intercept, "sp_batch": config.instances[0].sp_batch.value,
            "variants": results,
            "worst_ratio": worst, "passed": all(x <= TOLERANCE for x in worst.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--ttft", default="5,10,20,30")
    ap.add_argument("--intercepts", default="profile,2.1")
    ap.add_argument("--variants", default="talaria,no-sp,no-hkvr,h2d-only,round-only")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "sim_grid.json")
    ap.add_argument("--sp-batch", choices=[b.value for b in SpBatch], default=None)
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",")]
    if variants[0] != "talaria" or len(variants) < 2:
        ap.error("--variants must start with talaria and name at least one variant to compare it with")
    log = ProgressLog()
    load = os.getloadavg()[0]
    cells = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for intercept in args.intercepts.split(","):
            for ttft in (float(t) for t in args.ttft.split(",")):
                cell = run_cell(seed, ttft, intercept, variants, args.sp_batch and SpBatch(args.sp_batch))
                cells.append(cell)
                t = cell["variants"]["talaria"]
                log(f"seed {seed}, intercept {intercept}, T_ttft {ttft:g} s: talaria SCT p50 {t['sct_p50_s']:.1f} "
                    f"p95 {t['sct_p95_s']:.1f}; worst ratio p50 {cell['worst_ratio']['p50']:.3f} "
                    f"p95 {cell['worst_ratio']['p95']:.3f} {'ok' if cell['passed'] else 'FAIL'}")
                # every cell is kept as it lands: a grid is an hour or more on a small machine
                write_json(args.json, {"tolerance": TOLERANCE, "cells": cells, "complete": False}, log)
    rows = [("seed", "intercept", "T_ttft s", *(f"{v} p50/p95 s" for v in variants), "TTFT met (talaria)",
             "worst ratio p50/p95", "pass")]
    for c in cells:
        rows.append((str(c["seed"]), c["intercept"], f"{c['ttft_s']:g}",
                     *(f"{c['variants'][v]['sct_p50_s']:.0f} / {c['variants'][v]['sct_p95_s']:.0f}" for v in variants),
                     f"{c['variants']['talaria']['ttft_attainment']:.1%}",
                     f"{c['worst_ratio']['p50']:.3f} / {c['worst_ratio']['p95']:.3f}", "yes" if c["passed"] else "NO"))
    print(render(rows))
    # issue 35: the paper's table for the cells at its operating point (T_ttft 20 s, the profile's intercept)
    paper = {c["seed"]: c["variants"] for c in cells if c["ttft_s"] == 20 and c["intercept"] == "profile"}
    if paper and all(set(VARIANTS) <= set(v) for v in paper.values()):
        print("\nAgainst the paper (bench/paper_figures.py's rows):")
        print(paper_table(rows_of(paper)))
    write_json(args.json, {"tolerance": TOLERANCE, "cells": cells, "complete": True,
                           "passed": all(c["passed"] for c in cells),
                           **environment(log, load)}, log)
    return 0 if all(c["passed"] for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
