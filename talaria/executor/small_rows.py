"""A float32 product of a few rows (1 to 8 tokens) with a weight, by an AVX-512 kernel of our own:
the CPU decode's fourth matmul backend (talaria/executor/matmul.py measures it beside the libraries).

Why: on the 2-core Intel Xeon the project runs on, every library reads a float32 weight at 24-28
GB/s for one row but 9-15 GB/s from 4 rows up. At 8 rows the arithmetic takes as long as the memory
stream, and the libraries do not overlap the two. This kernel does: one software prefetch of the
weight PREFETCH_ROWS rows ahead beside each load (docs/engine-cpu.md, "On the Intel Xeon"). It
takes two weight rows at a time, one accumulator per weight row and token, dot products along the
input, the input's tail past a multiple of 16 through masked loads, OpenMP over the weight's rows
on torch's own thread pool.

It is plain C++ (no torch headers: it compiles in about a second) called through ctypes. It is
built once per machine with the system compiler (`$CXX`, g++ or c++) into
`$TALARIA_CACHE_DIR/kernels/`, under a file lock, so ranks starting together build it once. It
links torch's libgomp by its rpath, so its threads are torch's. A CPU without AVX-512 (as torch's
own kernels see it), no compiler, or a failed build leaves it out: `linear` raises
`NotImplementedError`, which the dispatch reads as "this backend cannot run the product", and every
product runs on the libraries. A failed build is remembered beside the library (`.failed`, with
the compiler's message) so later processes do not retry it; deleting the folder tries again.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

from talaria.models.conversion_cache import default_cache_dir

log = logging.getLogger(__name__)

MAX_ROWS = 8  # the accumulators of 8 tokens by 2 weight rows are 16 of the 32 vector registers
PREFETCH_ROWS = 8  # the weight row prefetched beside each load: this many rows ahead (0: none)
FLAGS = ("-O3", "-mavx512f", "-fopenmp", "-shared", "-fPIC", "-std=c++17")

SOURCE = r"""
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

// y (M, N) = x (M, K) w (N, K)^T (+ bias), float32, M <= 8, rows n0..n1 of w: R weight rows at a
// time, one accumulator per weight row and token; the input's tail past a multiple of 16 through
// masked loads. `pf`: prefetch the weight `pf` rows ahead (0: none).
template <int M, int R>
static void block(const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t n1,
                  int64_t N, int64_t K, int64_t pf) {
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
      for (int m = 0; m < M; ++m)
        y[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]) + (bias ? bias[n + r] : 0.0f);
  }
}

// The weight's rows split evenly over at most `threads` threads, none with fewer than 256 rows.
template <int M>
static void run(const float* x, const float* w, const float* bias, float* y, int64_t N, int64_t K, int64_t pf,
                int threads) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, (N + 255) / 256));
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
  for (int64_t p = 0; p < parts; ++p) block<M, 2>(x, w, bias, y, N * p / parts, N * (p + 1) / parts, N, K, pf);
}

extern "C" int talaria_small_rows(const float* x, const float* w, const float* bias, float* y, int64_t M,
                                  int64_t N, int64_t K, int64_t pf, int threads) {
  switch (M) {
    case 1: run<1>(x, w, bias, y, N, K, pf, threads); return 0;
    case 2: run<2>(x, w, bias, y, N, K, pf, threads); return 0;
    case 3: run<3>(x, w, bias, y, N, K, pf, threads); return 0;
    case 4: run<4>(x, w, bias, y, N, K, pf, threads); return 0;
    case 5: run<5>(x, w, bias, y, N, K, pf, threads); return 0;
    case 6: run<6>(x, w, bias, y, N, K, pf, threads); return 0;
    case 7: run<7>(x, w, bias, y, N, K, pf, threads); return 0;
    case 8: run<8>(x, w, bias, y, N, K, pf, threads); return 0;
    default: return -1;
  }
}
"""

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_library: ctypes.CDLL | None = None
_missing: str | None = None  # why the kernel is not here, once that is known


def build(folder: Path | None = None) -> Path:
    """The kernel's shared library, compiled once per source, flags and machine (under a lock: one
    process builds, the others wait and load it). Raises OSError with the reason when it cannot be."""
    folder = folder or default_cache_dir() / "kernels"
    key = hashlib.blake2b(f"{SOURCE}{FLAGS}{platform.machine()}".encode(), digest_size=8).hexdigest()
    out = folder / f"small_rows-{key}.so"
    failed = out.with_suffix(".failed")
    if out.exists():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return out  # built by another process while this one waited
        if failed.exists():
            raise OSError(f"its build failed before ({failed}):\n{failed.read_text()[-2000:]}")
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            raise OSError("no C++ compiler ($CXX, g++ or c++) to build it")
        src = out.with_suffix(".cpp")
        src.write_text(SOURCE)
        torch_lib = Path(torch.__file__).parent / "lib"  # its libgomp: torch's OpenMP threads, not a second pool
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        log.info("building the small-row matmul kernel (%s, once per machine)", cxx)
        done = subprocess.run([cxx, *FLAGS, str(src), f"-Wl,-rpath,{torch_lib}", "-o", str(tmp)],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            failed.write_text(f"{cxx}: exit {done.returncode}\n{done.stderr}")
            raise OSError(f"{cxx} could not build it:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    return out


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built first where needed; None (with one warning a process) where it
    cannot run here."""
    global _library, _missing
    if _library is not None or _missing is not None:
        return _library
    if torch.backends.cpu.get_cpu_capability() != "AVX512":  # what torch's own kernels dispatch on
        _missing = f"the CPU runs torch's {torch.backends.cpu.get_cpu_capability()} kernels, not AVX-512"
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except OSError as e:
        _missing = str(e)
        warnings.warn(f"the small-row matmul kernel is left out ({e}); products run on torch's libraries",
                      stacklevel=2)
        return None
    lib.talaria_small_rows.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_int]
    lib.talaria_small_rows.restype = ctypes.c_int
    _library = lib
    return lib


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           prefetch: int = PREFETCH_ROWS) -> torch.Tensor:
    """x (M, K) @ w (N, K)^T + bias -> (M, N), float32 on the CPU, 1 <= M <= MAX_ROWS, w contiguous.
    NotImplementedError for anything else, or where the kernel cannot run."""
    if not (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype == w.dtype == torch.float32
            and x.device.type == w.device.type == "cpu" and w.is_contiguous()
            and (bias is None or bias.dtype == torch.float32)):
        raise NotImplementedError("small_rows: float32 on the CPU, 1 to 8 rows, a contiguous weight")
    if w.dim() != 2 or x.shape[1] != w.shape[1] or (bias is not None and bias.shape != (w.shape[0],)):
        raise RuntimeError(f"small_rows: x {tuple(x.shape)}, w {tuple(w.shape)}, bias "
                           f"{None if bias is None else tuple(bias.shape)} do not make a product")
    lib = library()
    if lib is None:
        raise NotImplementedError(f"small_rows: {_missing}")
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(x.shape[0], w.shape[0])
    lib.talaria_small_rows(x.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                           x.shape[0], w.shape[0], x.shape[1], prefetch, torch.get_num_threads())
    return y
