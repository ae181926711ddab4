"""The engine's small-row kernel (issue 34) against the library backends, each product alone.

    python bench/small_rows.py [--rows 1,2,4,8] [--threads 2] [--json PATH]

On the 2-core Intel Xeon of 2026-12-06 every library backend of talaria/executor/matmul.py reads a
float32 weight at 24-28 GB/s for one row (token) but 9-15 GB/s from 4 rows up (docs/engine-cpu.md,
"On the Intel Xeon"). This measures talaria/executor/small_rows.py's AVX-512 kernel on SmolLM2-135M's
weight shapes beside them, in one run: once without its software prefetch and once with it (the
weight 8 rows ahead, `_mm_prefetch` to L1 beside each load, as the engine runs it), which overlaps
the memory stream with the arithmetic. The engine's dispatch makes the same comparison per shape
and row bucket when a model first runs; this shows it whole, in GB/s.

The kernel is built as the engine builds it (the system C++ compiler, about a second, once, into
`$TALARIA_CACHE_DIR/kernels/`). A CPU without AVX-512, or no compiler, is a clear message, exit 2.

Each product runs over copies of its weight filling 400 MiB, one after another (the weight streams
from memory as in a forward), fastest of 7; the table is GB/s of weight read. A result further from
the float64 product than float32 rounding allows (sqrt(K) eps sum |x w|, K the input width) is a wrong
result: exit 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: this tree's talaria first

import torch  # noqa: E402
from report import ProgressLog, environment, render, write_json  # noqa: E402  (bench/report.py)

from talaria.executor import small_rows  # noqa: E402
from talaria.executor.matmul import BACKENDS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((3072, 576, "gate+up"), (576, 1536, "down"), (960, 576, "q+k+v"), (49152, 576, "LM head"))
STREAM_BYTES = 400 << 20
PREFETCH_ROWS = small_rows.PREFETCH_ROWS
MAX_ROWS = small_rows.MAX_ROWS

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
        "kernel": lambda x, w, b: small_rows.linear(x, w, b, prefetch=0),
        f"kernel + prefetch {PREFETCH_ROWS}": lambda x, w, b: small_rows.linear(x, w, b, prefetch=PREFETCH_ROWS)}
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8",
                    help=f"rows (tokens) per product, at most {MAX_ROWS} (default: 1,2,4,8)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: torch's)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "small_rows.json",
                    help="where to write the results (default: bench/results/small_rows.json)")
    args = ap.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    if not all(1 <= r <= MAX_ROWS for r in rows_list):
        ap.error(f"--rows: each between 1 and {MAX_ROWS}")
    log = ProgressLog()
    load = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    if small_rows.library() is None:
        print(f"small_rows: the kernel cannot run here: {small_rows._missing}", file=sys.stderr)
        return 2
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
