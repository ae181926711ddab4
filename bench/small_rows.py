"""Talaria's CPU kernels (issue 34) against torch: the small-row product alone, or the decode (--decode).

    python bench/small_rows.py [--rows 1,2,4,8] [--threads 2] [--json PATH]
    python bench/small_rows.py --decode [--rounds 6] [--threads 2] [--json PATH]

On the 2-core Intel Xeon of 2026-12-06 every library backend of talaria/executor/matmul.py reads a
float32 weight at 24-28 GB/s for one row (token) but 9-15 GB/s from 4 rows up (docs/engine-cpu.md,
"On the Intel Xeon"). This measures talaria/executor/cpu_kernels.py's AVX-512 small-row kernel on SmolLM2-135M's
weight shapes beside them, in one run: once without its software prefetch and once with it (the
weight 8 rows ahead, `_mm_prefetch` to L1 beside each load, as the engine runs it), which overlaps
the memory stream with the arithmetic. The engine's dispatch makes the same comparison per shape
and row bucket when a model first runs; this shows it whole, in GB/s.

The kernel is built as the engine builds it (the system C++ compiler, about 5 s, once, into
`$TALARIA_CACHE_DIR/kernels/`). A CPU without AVX-512, or no compiler, is a clear message, exit 2.

`--decode` asks the engine whole: decode at 1 and 8 requests of SmolLM2-135M and of bench/engine.py's
synthetic MoE model, and SmolLM2's at 1 request with a 2,112-token context (bench/engine.py's prompts
and window, 32 tokens), through Talaria's Driver on four engines, alternating in one process for
`--rounds` rounds: torch only (a matmul dispatch of the library backends, with its own measured
choices from its own file, the torch decode attention and expert loop), with the small-row kernel,
with the op kernels too (the paged decode attention and the MoE experts' call), and with all kernels
(a layer's attention and dense MLP blocks in one call each too, talaria/executor/decode_layer.py, as
the engine runs); each round's tokens/s and the median of the per-round ratios to torch only.

Each product runs over copies of its weight filling 400 MiB, one after another (the weight streams
from memory as in a forward), fastest of 7; the table is GB/s of weight read. A result further from
the float64 product than float32 rounding allows (sqrt(K) eps sum |x w|, K the input width) is a wrong
result: exit 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: this tree's talaria first

import torch  # noqa: E402
from report import ProgressLog, environment, render, write_json  # noqa: E402  (bench/report.py)

from talaria.executor import cpu_kernels  # noqa: E402
from talaria.executor.matmul import BACKENDS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((3072, 576, "gate+up"), (576, 1536, "down"), (960, 576, "q+k+v"), (49152, 576, "LM head"))
STREAM_BYTES = 400 << 20
PREFETCH_ROWS = cpu_kernels.PREFETCH_ROWS
MAX_ROWS = cpu_kernels.MAX_ROWS

def stream_s(fn, x: torch.Tensor, weights: list[torch.Tensor], rounds: int = 7) -> float:
    """The fastest of `rounds` passes of fn(x, w) over every copy of the weight, in seconds."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for w in weights:
            fn(x, w, None)
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(rows_list: list[int], log: ProgressLog) -> tuple[list[dict], list[str]]:
    candidates = {name: fn for name, fn in BACKENDS.items() if name != "small_rows"} | {
        "kernel": lambda x, w, b: cpu_kernels.small_rows(x, w, b, prefetch=0),
        f"kernel + prefetch {PREFETCH_ROWS}": lambda x, w, b: cpu_kernels.small_rows(x, w, b, prefetch=PREFETCH_ROWS)}
    results, wrong = [], []
    for out_f, in_f, role in SHAPES:
        weights = [torch.randn(out_f, in_f) for _ in range(max(2, STREAM_BYTES // (out_f * in_f * 4)))]
        nbytes = sum(w.numel() * 4 for w in weights)
        for m in rows_list:
            x = torch.randn(m, in_f)
            exact = torch.nn.functional.linear(x.double(), weights[0].double())
            # float32 rounding of a length-K dot product, as it accumulates in practice: sqrt(K) eps sum|x w|
            bound = in_f ** 0.5 * 2.0 ** -24 * (x.abs().double() @ weights[0].abs().double().T).max().item()
            row = {"weight": f"{out_f}x{in_f}", "role": role, "rows": m, "gb_s": {}, "max_abs_err": {}}
            for name, fn in candidates.items():
                err = (fn(x, weights[0], None).double() - exact).abs().max().item()
                row["max_abs_err"][name] = err
                if err > bound:
                    wrong.append(f"{name} on {out_f}x{in_f} at {m} rows: error {err:.2e} past float32's {bound:.2e}")
                row["gb_s"][name] = nbytes / stream_s(fn, x, weights) / 1e9
            log(f"{out_f}x{in_f} ({role}) at {m} rows: " +
                ", ".join(f"{k} {v:.1f}" for k, v in row["gb_s"].items()) + " GB/s")
            results.append(row)
    return results, wrong


# --decode's engines: (the matmul dispatch with the small-row kernel?, the decode attention and MoE experts kernels?,
# a decode step's layer blocks in one call each?)
ENGINES = {"torch": (False, False, False), "small rows": (True, False, False), "op kernels": (True, True, False),
           "all kernels": (True, True, True)}


def decode(rounds: int, log: ProgressLog) -> dict:
    """Decode tok/s (SmolLM2 at 1 and 8 requests and at a long context, the MoE row's model at 1 and 8)
    on each of ENGINES, alternating."""
    import engine  # bench/engine.py: its model, requests and timing

    from talaria.executor import matmul

    files = engine.prepare_model(engine.MODEL, None)
    tok = engine.AutoTokenizer.from_pretrained(files.directory)
    prompt, prefix, tails = engine.build_inputs(tok)
    moe = engine.prepare_model(engine.MOE_MODEL, None)
    moe_prompt = engine.AutoTokenizer.from_pretrained(moe.directory)(engine.QUESTION).input_ids
    moe_vocab = engine.MOE_MODEL.shape.vocab_size
    # name -> (model files, instance, prompts)
    cases = {"1": (files, engine.INSTANCE, engine.distinct(prompt, 1, len(tok))),
             "8": (files, engine.INSTANCE, engine.distinct(prompt, 8, len(tok))),
             f"1 at {len(prefix + tails[0])}": (files, engine.INSTANCE, [prefix + tails[0]]),  # attention's share grows
             "MoE 1": (moe, engine.MOE_INSTANCE, engine.distinct(moe_prompt, 1, moe_vocab)),
             "MoE 8": (moe, engine.MOE_INSTANCE, engine.distinct(moe_prompt, 8, moe_vocab))}
    dispatches = {True: matmul.DISPATCH, False: matmul.MatmulDispatch(  # its own measured choices, in its own file
        {n: fn for n, fn in BACKENDS.items() if n != "small_rows"}, folder=matmul.DISPATCH.folder)}
    tok_s: dict[str, dict[str, list[float]]] = {name: {c: [] for c in cases} for name in ENGINES}
    try:
        for r in range(rounds + 1):  # round 0 is untimed: each dispatch measures its products
            for name in ENGINES if r % 2 else reversed(ENGINES):
                small, ops, layers = ENGINES[name]
                matmul.DISPATCH, cpu_kernels.PAGED_DECODE, cpu_kernels.MOE_EXPERTS = dispatches[small], ops, ops
                cpu_kernels.DECODE_LAYERS = layers
                for c, (model, instance, prompts) in cases.items():
                    served = engine.serve(engine.fresh_core(model, instance), prompts, 32 if r else 4,
                                          instance.models[0])
                    if r:
                        tok_s[name][c].append(served.decode_tok_s)
            if r:
                log(f"round {r}: " + ", ".join(f"{n} {c}: {v[c][-1]:.1f}" for n, v in tok_s.items() for c in cases))
    finally:
        matmul.DISPATCH, cpu_kernels.PAGED_DECODE, cpu_kernels.MOE_EXPERTS = dispatches[True], True, True
        cpu_kernels.DECODE_LAYERS = True
    ratio = {name: {c: statistics.median(k / t for k, t in zip(tok_s[name][c], tok_s["torch"][c], strict=True))
                    for c in cases} for name in ENGINES}
    return {"tok_s": tok_s, "ratio_to_torch": ratio,
            "small_rows_runs": sorted(k for (_, k), v in dispatches[True].chosen.items() if v == "small_rows")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8",
                    help=f"rows (tokens) per product, at most {MAX_ROWS} (default: 1,2,4,8)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: torch's)")
    ap.add_argument("--decode", action="store_true",
                    help="decode through the engine (SmolLM2, the MoE model): torch only, the small-row kernel, "
                         "the op kernels too, all kernels (the fused layer blocks too)")
    ap.add_argument("--rounds", type=int, default=6, help="--decode: alternating rounds (default 6)")
    ap.add_argument("--json", type=Path, default=None,
                    help="where to write the results (default: bench/results/small_rows.json, or "
                         "small_rows_decode.json with --decode)")
    args = ap.parse_args(argv)
    args.json = args.json or ROOT / "bench" / "results" / f"small_rows{'_decode' * args.decode}.json"
    rows_list = [int(r) for r in args.rows.split(",")]
    if not all(1 <= r <= MAX_ROWS for r in rows_list):
        ap.error(f"--rows: each between 1 and {MAX_ROWS}")
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    log = ProgressLog()
    load = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    if cpu_kernels.library() is None:
        print(f"small_rows: the kernel cannot run here: {cpu_kernels._missing}", file=sys.stderr)
        return 2
    if args.decode:
        found = decode(args.rounds, log)
        t, names = found["tok_s"], list(ENGINES)
        print(render([("requests", "round", *(f"{n} tok/s" for n in names))] +
                     [(str(c), str(i + 1), *(f"{t[n][c][i]:.1f}" for n in names))
                      for c in t["torch"] for i in range(args.rounds)] +
                     [(str(c), "median ratio to torch", *(f"{found['ratio_to_torch'][n][c]:.2f}" for n in names))
                      for c in t["torch"]]))
        print(f"the small-row kernel runs {', '.join(found['small_rows_runs']) or 'nothing'}")
        write_json(args.json, {"threads": args.threads, **found, **environment(log, load)}, log)
        return 0
    results, wrong = measure(rows_list, log)
    names = list(results[0]["gb_s"])
    print(render([("weight (role)", "rows", *names)] +
                 [(f"{r['weight']} ({r['role']})", str(r["rows"]), *(f"{r['gb_s'][n]:.1f}" for n in names))
                  for r in results]))
    print("GB/s of weight read; each product over copies of its weight filling 400 MiB, fastest of 7")
    write_json(args.json, {"threads": args.threads, "results": results, "wrong": wrong,
                           **environment(log, load)}, log)
    for w in wrong:
        print(f"FAILED: {w}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
