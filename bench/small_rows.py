"""A candidate CPU kernel for products of a few rows (issue 34), against the backends the engine uses.

    python bench/small_rows.py [--rows 1,2,4,8] [--threads 2] [--json PATH]

On the 2-core Intel Xeon of 2026-12-06 every backend of talaria/executor/matmul.py reads a float32
weight at 24-28 GB/s for one row (token) but 9-15 GB/s from 4 rows up (docs/engine-cpu.md, "On the
Intel Xeon"). This measures a kernel of our own on SmolLM2-135M's weight shapes beside them, in one
run: AVX-512, two weight rows at a time with one accumulator per weight row and token (at most 8
tokens), dot products along the input, `at::parallel_for` over the weight's rows; once as it is and
once with a software prefetch of the weight 8 rows ahead (`_mm_prefetch` to L1 beside each load),
which overlaps the memory stream with the arithmetic. The kernel is not in the engine: this is the
measurement that says whether to put it there.

It is compiled here with the system C++ compiler against torch's headers (no ninja), into
`$TALARIA_CACHE_DIR/bench-kernels/` (about 25 s the first time), and loaded as a torch op. A CPU
without AVX-512, or no compiler, is a clear message, exit 2.

Each product runs over copies of its weight filling 400 MiB, one after another (the weight streams
from memory as in a forward), fastest of 7; the table is GB/s of weight read. A result further from
the float64 product than float32 rounding allows (sqrt(K) eps sum |x w|, K the input width) is a wrong
result: exit 1.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: this tree's talaria first

import torch  # noqa: E402
from report import ProgressLog, environment, render, write_json  # noqa: E402  (bench/report.py)

from talaria.executor.matmul import BACKENDS  # noqa: E402
from talaria.models.conversion_cache import default_cache_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((3072, 576, "gate+up"), (576, 1536, "down"), (960, 576, "q+k+v"), (49152, 576, "LM head"))
STREAM_BYTES = 400 << 20
PREFETCH_ROWS = 8
MAX_ROWS = 8

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

// y (M, N) = x (M, K) w (N, K)^T, float32, M <= 8: R weight rows at a time, one accumulator per
// weight row and token; the input's tail past a multiple of 16 through masked loads. `pf`: prefetch
// the weight `pf` rows ahead (0: none).
template <int M, int R>
static void rows(const float* x, const float* w, float* y, int64_t n0, int64_t n1, int64_t N, int64_t K,
                 int64_t pf) {
  const int64_t K16 = K / 16 * 16;
  const __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1);
  for (int64_t n = n0; n < n1; n += R) {
    const int r_here = (int)std::min<int64_t>(R, n1 - n);
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    const float* wr[R];
    for (int r = 0; r < R; ++r) wr[r] = w + (n + std::min(r, r_here - 1)) * K;
    const bool fetch = pf > 0 && n + pf + R <= N;
    for (int64_t k = 0; k <= K16; k += 16) {
      if (k == K16 && !tail) break;
      __m512 wv[R];
      for (int r = 0; r < R; ++r) {
        wv[r] = k < K16 ? _mm512_loadu_ps(wr[r] + k) : _mm512_maskz_loadu_ps(tail, wr[r] + k);
        if (fetch) _mm_prefetch((const char*)(wr[r] + pf * K + k), _MM_HINT_T0);
      }
      for (int m = 0; m < M; ++m) {
        const __m512 xv = k < K16 ? _mm512_loadu_ps(x + m * K + k) : _mm512_maskz_loadu_ps(tail, x + m * K + k);
        for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
      }
    }
    for (int r = 0; r < r_here; ++r)
      for (int m = 0; m < M; ++m) y[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]);
  }
}

template <int M>
static void run(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t pf) {
  at::parallel_for(0, N, 256, [&](int64_t a, int64_t b) { rows<M, 2>(x, w, y, a, b, N, K, pf); });
}

static at::Tensor small_rows(const at::Tensor& x, const at::Tensor& w, int64_t pf) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_rows: x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "small_rows: float32 only");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "small_rows: 1 to 8 rows");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (M) {
    case 1: run<1>(xp, wp, yp, N, K, pf); break;
    case 2: run<2>(xp, wp, yp, N, K, pf); break;
    case 3: run<3>(xp, wp, yp, N, K, pf); break;
    case 4: run<4>(xp, wp, yp, N, K, pf); break;
    case 5: run<5>(xp, wp, yp, N, K, pf); break;
    case 6: run<6>(xp, wp, yp, N, K, pf); break;
    case 7: run<7>(xp, wp, yp, N, K, pf); break;
    default: run<8>(xp, wp, yp, N, K, pf); break;
  }
  return y;
}

TORCH_LIBRARY(talaria_bench, m) { m.def("small_rows(Tensor x, Tensor w, int pf) -> Tensor"); }
TORCH_LIBRARY_IMPL(talaria_bench, CPU, m) { m.impl("small_rows", small_rows); }
"""


def build(log: ProgressLog) -> Path:
    """The kernel as a shared library, compiled once per source and torch version."""
    key = hashlib.blake2b(f"{SOURCE}{torch.__version__}".encode(), digest_size=8).hexdigest()
    out = default_cache_dir() / "bench-kernels" / f"small_rows-{key}.so"
    if out.exists():
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise SystemExit("small_rows: no C++ compiler (g++ or $CXX) to build the kernel with")
    from torch.utils.cpp_extension import include_paths, library_paths

    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".cpp")
    src.write_text(SOURCE)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib = library_paths()[0]
    cmd = [cxx, "-O3", "-mavx512f", "-fopenmp", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           *(f"-I{p}" for p in include_paths()), str(src),
           f"-L{lib}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{lib}", "-o", str(out) + ".tmp"]
    log(f"compiling the kernel ({cxx}, about 25 s)")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"small_rows: the kernel did not compile:\n{done.stderr[-3000:]}")
    os.replace(str(out) + ".tmp", out)
    return out


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
    kernel = torch.ops.talaria_bench.small_rows
    candidates = {**BACKENDS, "kernel": lambda x, w, b: kernel(x, w, 0),
                  f"kernel + prefetch {PREFETCH_ROWS}": lambda x, w, b: kernel(x, w, PREFETCH_ROWS)}
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
    if torch.backends.cpu.get_cpu_capability() != "AVX512":  # what torch's own kernels dispatch on
        print("small_rows: this CPU has no AVX-512 (avx512f): the kernel cannot run here", file=sys.stderr)
        return 2
    log = ProgressLog()
    load = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    torch.ops.load_library(str(build(log)))
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
