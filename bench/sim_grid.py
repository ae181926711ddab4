"""The policy grid: does Talaria beat round-only and every ablation at every TTFT target, or only tie one?

    python bench/sim_grid.py [--presets paper-tp8,paper-tp4] [--seeds 0,1] [--ttft 5,10,20,30]
                             [--intercepts profile,2.1] [--variants talaria,no-sp,no-hkvr,h2d-only,round-only]
                             [--json PATH] [--sp-batch paper|pays] [--format text|markdown]
    python bench/sim_grid.py --from-json PATH [--format markdown]      # the table of a saved grid

The workloads are fixed by issues 20 and 38, not chosen here. `paper-tp8`: `talaria trace gen
--preset paper-tp8 --seed S` (960 calls, 30 model-sessions) on profiles/paper-tp8.toml's own
topology (one TP=8 cold instance, `tpot_s` 0.2, `gamma` 0.8). `paper-tp4`: the router testbed,
`--preset paper-tp4 --load high` (120 calls) on two paper-tp4 instances, as bench/policies.py's
paper-tp4-high shape. Each runs for T_ttft in {5, 10, 20, 30} s and both prefill intercepts: the
profile's (one forward's fixed cost, the decode base) and 2.1 s (the smallest exact fit of the
paper's recompute TTFTs, profiles/README.md). Each cell runs every variant.

Each cell is judged by talaria/sim/grid.py: per variant and percentile (SCT p50, p95) the ratio
Talaria / variant is a **tie** within a factor of 1.02 either way, a win below, a loss above; a
cell is a loss if any comparison loses, a tie if any ties, a win only if Talaria beats every
variant at both percentiles by more than 2 %. A cell passes (issue 20) unless it is a loss. The
policy rules (thrash guard, TPOT gate, SP selection) were developed on paper-tp8 seeds 0 and 1
(`DEVELOPMENT`); every other cell is **held out** (issue 38: seeds 3, 4 and 5 of both presets),
and the JSON records the commit and a fingerprint of the rules' sources. Every cell is reported,
whatever it shows. `--sp-batch` sets every variant's SP admission rule (talaria/instance/sp_batch.py;
default: the config's default).

After the grid, the paper-tp8 cells at T_ttft 20 s and the profile's intercept are printed against
the paper's figures as bench/paper_figures.py prints them (issue 35). Progress goes to stderr, one
table row per cell to stdout, everything to the JSON (default bench/results/sim_grid.json), each
cell as it lands. Exits 1 when a cell is a loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: this tree's talaria first

from paper_figures import VARIANTS, missing_figures, paper_values, rows_of  # bench/paper_figures.py, beside it
from paper_figures import table as paper_table
from report import (  # bench/report.py, beside this script
    ProgressLog,
    environment,
    render,
    write_json,
)

from talaria.config.schema import SpBatch
from talaria.contracts.profile_file import load_profile
from talaria.sim.grid import PERCENTILES, TOLERANCE, judge
from talaria.sim.report import summary, variant
from talaria.sim.simulation import Simulation, profile_topology
from talaria.trace.generate import generate, preset

ROOT = Path(__file__).resolve().parents[1]
# preset -> (profile in profiles/, the trace preset's load, cold instances): the paper's two testbeds
PRESETS = {"paper-tp8": ("paper-tp8", "medium", 1), "paper-tp4": ("paper-tp4", "high", 2)}
# the cells the policy rules (thrash guard, TPOT gate, SP selection) were developed on (issue 20)
DEVELOPMENT = {("paper-tp8", 0), ("paper-tp8", 1)}
# the sources of those rules, fingerprinted into the JSON: a held-out grid is judged on frozen rules
RULES = ("talaria/instance/slot_policy.py", "talaria/instance/round_scheduler.py",
         "talaria/instance/sp_batch.py", "talaria/instance/prompt_costs.py", "talaria/config/schema.py")


def rules_fingerprint() -> dict:
    h = hashlib.sha256()
    for rel in RULES:
        h.update(rel.encode() + b"\0" + (ROOT / rel).read_bytes())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", *RULES], cwd=ROOT, capture_output=True,
                                    text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", None
    return {"commit": commit, "rules_dirty": dirty, "fingerprint": h.hexdigest()[:12], "files": list(RULES)}


def run_cell(preset_name: str, seed: int, ttft_s: float, intercept: str, variants: list[str],
             sp_batch: SpBatch | None = None) -> dict:
    profile_name, load, instances = PRESETS[preset_name]
    profile = load_profile(ROOT / "profiles" / f"{profile_name}.toml")
    if intercept != "profile":
        profile = profile.with_prefill_base(float(intercept))
    trace = list(generate(preset(preset_name, load), random.Random(seed)).calls)
    config = profile_topology(profile, ttft_s, instances=instances)
    if sp_batch is not None:
        config = dataclasses.replace(config, instances=tuple(dataclasses.replace(i, sp_batch=sp_batch)
                                                             for i in config.instances))
    results = {v: summary(Simulation(variant(config, v), profile, trace).run()) for v in variants}
    verdict = judge(results, TOLERANCE)
    return {"preset": preset_name, "seed": seed, "held_out": (preset_name, seed) not in DEVELOPMENT,
            "calls": len(trace), "instances": instances, "ttft_s": ttft_s, "intercept": intercept,
            "sp_batch": config.instances[0].sp_batch.value, "variants": results, **verdict.to_json()}


def outcome_cell(c: dict) -> str:
    """The cell's outcome as the table shows it: a tie names whom Talaria ties, a loss whom it loses to."""
    if c["outcome"] == "loss":
        return "**LOSS** to " + ", ".join(c["losses"])
    if c["outcome"] == "tie":
        same = [v for v in c["ties"] if v in c["identical_to"]]
        return "**tie** with " + ", ".join(f"{v} (identical)" if v in same else v for v in c["ties"])
    return "win"


def grid_rows(cells: list[dict], variants: list[str]) -> list[tuple[str, ...]]:
    rows = [("preset", "seed", "intercept", "T_ttft s", *(f"{v} p50 / p95 s" for v in variants),
             "worst ratio p50 / p95 (vs)", "p50 / p95", "cell", "SP admitted", "TTFT met")]
    for c in cells:
        t = c["variants"]["talaria"]
        seed = f"{c['seed']}" + ("" if c.get("held_out", True) else " (dev)")
        rows.append((c.get("preset", "paper-tp8"), seed, c["intercept"], f"{c['ttft_s']:g}",
                     *(f"{c['variants'][v]['sct_p50_s']:,.1f} / {c['variants'][v]['sct_p95_s']:,.1f}"
                       for v in variants),
                     " / ".join(f"{c['worst_ratio'][q]:.3f} ({c['closest'][q]})" for q in PERCENTILES),
                     " / ".join(c["outcomes"][q] for q in PERCENTILES), outcome_cell(c),
                     str(t["sp_admitted"]), f"{t['ttft_attainment']:.1%}"))
    return rows


def markdown(rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + " --- |" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def tally(cells: list[dict]) -> str:
    """One line per preset: wins, ties and losses, held-out cells apart from development ones."""
    out = []
    for name in dict.fromkeys(c.get("preset", "paper-tp8") for c in cells):
        for held in (True, False):
            mine = [c for c in cells if c.get("preset", "paper-tp8") == name and c.get("held_out", True) is held]
            if mine:
                n = {o: sum(c["outcome"] == o for c in mine) for o in ("win", "tie", "loss")}
                out.append(f"{name}, {'held out' if held else 'development'}: {len(mine)} cells, {n['win']} wins, "
                           f"{n['tie']} ties, {n['loss']} losses")
    return "\n".join(out)


def report(cells: list[dict], variants: list[str], fmt: str) -> None:
    rows = grid_rows(cells, variants)
    print(markdown(rows) if fmt == "markdown" else render(rows))
    print(f"\ntie: Talaria / variant within a factor of {TOLERANCE} either way at that percentile; "
          "a cell is a win only if it beats every variant at both percentiles by more than that")
    print(tally(cells))
    # issue 35: the paper's table for the paper-tp8 cells at its operating point (T_ttft 20 s, the profile's intercept)
    paper = {c["seed"]: c["variants"] for c in cells
             if c.get("preset", "paper-tp8") == "paper-tp8" and c["ttft_s"] == 20 and c["intercept"] == "profile"}
    if paper and all(set(VARIANTS) <= set(v) for v in paper.values()):
        if (why := missing_figures()) is not None:
            print(f"\n(no paper table: {why})")
        else:
            print("\nAgainst the paper (bench/paper_figures.py's rows):")
            print(paper_table(rows_of(paper, paper_values())))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="paper-tp8", help=f"any of {', '.join(PRESETS)}")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--ttft", default="5,10,20,30")
    ap.add_argument("--intercepts", default="profile,2.1")
    ap.add_argument("--variants", default="talaria,no-sp,no-hkvr,h2d-only,round-only")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "sim_grid.json")
    ap.add_argument("--sp-batch", choices=[b.value for b in SpBatch], default=None)
    ap.add_argument("--format", choices=("text", "markdown"), default="text")
    ap.add_argument("--from-json", type=Path, help="print the table of a saved grid (its cells so far); run nothing")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",")]
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        cells = saved["cells"]
        report(cells, [v for v in variants if all(v in c["variants"] for c in cells)], args.format)
        if not saved.get("complete"):
            print(f"\n(incomplete: {len(cells)} cells so far)")
        return 0 if all(c["passed"] for c in cells) else 1
    if variants[0] != "talaria" or len(variants) < 2:
        ap.error("--variants must start with talaria and name at least one variant to compare it with")
    presets = [p.strip() for p in args.presets.split(",")]
    if unknown := [p for p in presets if p not in PRESETS]:
        ap.error(f"unknown preset {', '.join(unknown)}; choose from {', '.join(PRESETS)}")
    log = ProgressLog()
    load = os.getloadavg()[0]
    rules = rules_fingerprint()
    log(f"rules at {rules['commit']} (fingerprint {rules['fingerprint']}"
        f"{', uncommitted changes' if rules['rules_dirty'] else ''})")
    cells = []
    for name in presets:
        for seed in (int(s) for s in args.seeds.split(",")):
            for intercept in args.intercepts.split(","):
                for ttft in (float(t) for t in args.ttft.split(",")):
                    cell = run_cell(name, seed, ttft, intercept, variants, args.sp_batch and SpBatch(args.sp_batch))
                    cells.append(cell)
                    t = cell["variants"]["talaria"]
                    walls = ", ".join(f"{v} {r['wall_s']:.0f} s" for v, r in cell["variants"].items())
                    log(f"{name} seed {seed}, intercept {intercept}, T_ttft {ttft:g} s: talaria SCT p50 "
                        f"{t['sct_p50_s']:.1f} p95 {t['sct_p95_s']:.1f}; worst ratio p50 {cell['worst_ratio']['p50']:.3f} "
                        f"p95 {cell['worst_ratio']['p95']:.3f}: {outcome_cell(cell)} "
                        f"({walls})")
                    # every cell is kept as it lands: a grid is an hour or more on a small machine
                    write_json(args.json, {"tolerance": TOLERANCE, "rules": rules, "cells": cells,
                                           "complete": False}, log)
    write_json(args.json, {"tolerance": TOLERANCE, "rules": rules, "cells": cells, "complete": True,
                           "passed": all(c["passed"] for c in cells),
                           **environment(log, load)}, log)
    report(cells, variants, args.format)
    return 0 if all(c["passed"] for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
