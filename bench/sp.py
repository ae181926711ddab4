"""Session-prefill (SP) on a live cold instance: one agent workload, replayed with SP on and off.

    python bench/sp.py [--json PATH] [--sessions N] [--turns K] [--max-tokens MIN MAX] [--seed S] [--tp T]

Starts `talaria up` with ONE cold instance serving two synthetic models (the shapes of `tiny-llama`
and `tiny-qwen3` in talaria/talaria.toml, in float64 so greedy outputs cannot flip on a near-tie
when batches differ), replays `agent_sessions` closed-loop against it (paper App. A: bodies, call
order and gaps fixed), and stops it; then the same with `ablations = ["sp"]`. Tool gaps are far
shorter than a slot and completion lengths vary per call, so many returns arrive while another
session of their model still decodes and its slot is open: SP admits them mid-slot, while without
SP they wait for the model's next slot. The round budget (gamma * ttft_s, 1.6 s by default) is
long enough that this wait, about a round, stands out from the noise of a shared 2-core machine;
with rounds of ~300 ms the saving per admission is of the order of run-to-run variation there.

Reports SCT (session completion time: first intended enqueue -> last response) sum, p50 and p95,
schedule-aware TTFT, and from the event log the SP admissions, rounds and switches of each run.
Fails (exit 1) unless every call succeeded, every call's text is identical in both runs (SP may
change when a call runs, never what it returns) and the SCT sum is lower with SP. Progress goes to
stderr, the table to stdout, everything to the JSON file (default bench/results/sp.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import httpx
from report import (  # bench/report.py, beside this script
    ProgressLog,
    environment,
    render,
    write_json,
)
from server import start_server, stop_server, wait_healthy  # bench/server.py

from talaria.replay import ReplayResult, agent_sessions, percentile, replay_sync

MODELS = ("tiny-llama", "tiny-qwen3")
SHAPE = """hidden_size = 128
intermediate_size = 256
num_layers = 4
num_heads = 4
num_kv_heads = 2
vocab_size = 512
max_position = 2048
"""


def config_text(tp: int, ttft_s: float, tpot_s: float, gamma: float, ablations: list[str], events: Path) -> str:
    """One cold instance, two synthetic models, the event log on."""
    models = "".join(
        f'[[models]]\nname = "{name}"\nsource = "synthetic:"\ndtype = "float64"\nseed = {seed}\n\n'
        f'[models.shape]\nfamily = "{family}"\n{SHAPE}tie_word_embeddings = {tie}\n\n'
        for name, seed, family, tie in ((MODELS[0], 1, "llama", "false"), (MODELS[1], 2, "qwen3", "true")))
    return (f'[server]\nhost = "127.0.0.1"\n\n{models}'
            f'[[instances]]\nname = "cold-0"\npool = "cold"\nmodels = {json.dumps(list(MODELS))}\ntp = {tp}\n'
            f'arena_bytes = "256MiB"\nhost_kv_bytes = "64MiB"\nstaging_chunk_bytes = "64KiB"\n'
            f"ttft_s = {ttft_s}\ntpot_s = {tpot_s}\ngamma = {gamma}\nablations = {json.dumps(ablations)}\n\n"
            '[router]\npolicy = "session-sticky"\n\n'  # one instance: routing is not what is measured
            f'[telemetry]\nevents_path = "{events}"\n')


# ---- one run ---------------------------------------------------------------------------------

def run(label: str, ablations: list[str], sessions, args, workdir: Path, log) -> tuple[ReplayResult, list[dict]]:
    """Start a server with these ablations, warm both models up, replay, stop; the result and events."""
    events_path = workdir / f"events-{label}.jsonl"
    config = workdir / f"talaria-{label}.toml"
    config.write_text(config_text(args.tp, args.ttft_s, args.tpot_s, args.gamma, ablations, events_path))
    log_path = workdir / f"talaria-{label}.log"
    proc, base_url = start_server(config, log_path)
    try:
        wait_healthy(proc, base_url, log_path)
        log(f"{label}: serving on {base_url}; warming up both models")
        for model in MODELS:  # first opens and runtime state, outside the measurement
            httpx.post(base_url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": "warm up", "max_tokens": 2, "temperature": 0}).raise_for_status()
        done = Counter()

        def progress(call) -> None:
            done[call.session_id] += 1
            if done[call.session_id] == args.turns:
                log(f"{label}: session {call.session_id} done ({sum(done.values())} calls)")

        log(f"{label}: replaying {len(sessions)} sessions x {args.turns} calls")
        result = replay_sync(base_url, sessions, on_call=progress)
    finally:
        stop_server(proc)
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
    return result, events


def run_summary(result: ReplayResult, events: list[dict]) -> dict:
    kinds = Counter(e["kind"] for e in events)
    rounds = [e["wall_s"] for e in events if e["kind"] == "round"]
    return {**result.summary(), "events_by_kind": dict(kinds), "sp_admissions": kinds.get("sp_admit", 0),
            "sp_parks": kinds.get("sp_park", 0), "rounds": len(rounds), "switches": kinds.get("switch", 0),
            "round_wall_p50_s": percentile(rounds, 50) if rounds else None}


def table(on: dict, off: dict) -> str:
    def s(v):
        return "-" if v is None else f"{v:.2f}"

    def ms(v):
        return "-" if v is None else f"{v * 1e3:.0f}"

    def ratio(a, b):
        return "-" if not a or b is None else f"{b / a:.2f}"

    rows = [("metric", "SP on", "SP off", "off/on")]
    for key, name in (("sct_sum_s", "SCT sum, s"), ("sct_p50_s", "SCT p50, s"), ("sct_p95_s", "SCT p95, s"),
                      ("wall_s", "replay wall, s")):
        rows.append((name, s(on[key]), s(off[key]), ratio(on[key], off[key])))
    for key, name in (("ttft_p50_s", "TTFT p50 (schedule-aware), ms"), ("ttft_p95_s", "TTFT p95, ms"),
                      ("round_wall_p50_s", "round wall p50, ms")):
        rows.append((name, ms(on[key]), ms(off[key]), ratio(on[key], off[key])))
    for key, name in (("sp_admissions", "SP admissions"), ("sp_parks", "SP parks"), ("rounds", "rounds"),
                      ("switches", "switches"), ("errors", "failed calls")):
        rows.append((name, str(on[key]), str(off[key]), "-"))
    return render(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=Path("bench/results/sp.json"), help="where to write results")
    ap.add_argument("--sessions", type=int, default=3, help="sessions per model")
    ap.add_argument("--turns", type=int, default=6, help="calls per session")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(8, 48), metavar=("MIN", "MAX"),
                    help="tokens generated per call, drawn uniformly per call (fixed across both runs)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the agent workload")
    ap.add_argument("--system-chars", type=int, default=600, help="system prompt (= tokens: byte tokenizer)")
    ap.add_argument("--tool-chars", type=int, default=120, help="tool result appended per call")
    ap.add_argument("--gap", type=float, nargs=2, default=(0.01, 0.1), metavar=("MIN", "MAX"),
                    help="tool gaps, uniform in [MIN, MAX] seconds")
    ap.add_argument("--tp", type=int, default=1, help="ranks of the cold instance")
    ap.add_argument("--ttft-s", type=float, default=2.0, help="TTFT target; rounds last at most gamma * ttft_s")
    ap.add_argument("--tpot-s", type=float, default=0.2, help="time-per-output-token target")
    ap.add_argument("--gamma", type=float, default=0.8, help="admission margin, < 1")
    ap.add_argument("--workdir", type=Path, help="keep configs, server logs and event logs here")
    args = ap.parse_args(argv)
    if min(args.sessions, args.turns, *args.max_tokens) < 1 or args.max_tokens[0] > args.max_tokens[1]:
        ap.error("--sessions, --turns and --max-tokens must be at least 1, and --max-tokens MIN <= MAX")

    log = ProgressLog()
    load_start = os.getloadavg()[0]
    workload = {"models": list(MODELS), "sessions_per_model": args.sessions, "turns": args.turns,
                "seed": args.seed, "system_chars": args.system_chars, "tool_chars": args.tool_chars,
                "max_tokens": list(args.max_tokens), "gap_s": list(args.gap)}
    sessions = agent_sessions(list(MODELS), args.sessions, args.turns, seed=args.seed,
                              system_chars=args.system_chars, tool_chars=args.tool_chars,
                              max_tokens=tuple(args.max_tokens), gap_s=tuple(args.gap))
    longest = max(len(c.body["prompt"]) + c.body["max_tokens"] for s in sessions for c in s.calls)
    if longest > 2048:
        ap.error(f"the longest call needs {longest} tokens, over the models' 2048; use fewer --turns or chars")
    with tempfile.TemporaryDirectory(prefix="talaria-sp-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        log(f"workdir {workdir}, load average {load_start:.2f}")
        on_result, on_events = run("sp-on", [], sessions, args, workdir, log)
        off_result, off_events = run("sp-off", ["sp"], sessions, args, workdir, log)
    on, off = run_summary(on_result, on_events), run_summary(off_result, off_events)
    texts_on = {(c.session_id, c.index): c.text for c in on_result.calls}
    texts_off = {(c.session_id, c.index): c.text for c in off_result.calls}
    differing = sorted(k for k in texts_on if texts_on[k] != texts_off.get(k))
    result = {
        "sct_sum_sp_on_s": on["sct_sum_s"], "sct_sum_sp_off_s": off["sct_sum_s"],
        "sct_p50_sp_on_s": on["sct_p50_s"], "sct_p50_sp_off_s": off["sct_p50_s"],
        "sct_p95_sp_on_s": on["sct_p95_s"], "sct_p95_sp_off_s": off["sct_p95_s"],
        "ttft_p50_sp_on_s": on["ttft_p50_s"], "ttft_p50_sp_off_s": off["ttft_p50_s"],
        "ttft_p95_sp_on_s": on["ttft_p95_s"], "ttft_p95_sp_off_s": off["ttft_p95_s"],
        "sp_admissions_on": on["sp_admissions"], "sp_admissions_off": off["sp_admissions"],
        "outputs_identical": not differing, "differing_calls": [list(k) for k in differing],
        "speedup_sct_sum": off["sct_sum_s"] / on["sct_sum_s"] if on["sct_sum_s"] else None,
        "workload": workload,
        "instance": {"tp": args.tp, "ttft_s": args.ttft_s, "tpot_s": args.tpot_s, "gamma": args.gamma,
                     "arena_bytes": 256 << 20, "host_kv_bytes": 64 << 20, "dtype": "float64"},
        "runs": {"sp_on": {"summary": on, "replay": on_result.to_dict()},
                 "sp_off": {"summary": off, "replay": off_result.to_dict()}},
        **environment(log, load_start),
    }
    print(table(on, off))
    write_json(args.json, result, log)

    failures = []
    if on["errors"] or off["errors"]:
        failures.append(f"{on['errors']} calls failed with SP on and {off['errors']} with SP off "
                        f"(see {args.json}: runs.*.replay)")
    if differing:
        failures.append(f"{len(differing)} calls returned different text with SP on and off, first {differing[0]}: "
                        "SP must change when a call runs, never what it returns")
    if not on["sct_sum_s"] < off["sct_sum_s"]:
        failures.append(f"SCT sum with SP on ({on['sct_sum_s']:.2f} s) is not lower than with SP off "
                        f"({off['sct_sum_s']:.2f} s); SP admitted {on['sp_admissions']} calls")
    for f in failures:
        print(f"bench/sp.py: FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
