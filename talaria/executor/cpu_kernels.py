"""Talaria's own CPU kernels, in AVX-512 C++: the products of a few rows that the libraries stream
slowly, the decode step's attention over the paged KV cache, and a decode step's MoE experts.

- `small_rows(x, w, bias)`: a float32 product of 1 to 8 rows (tokens) with a weight, the matmul
  dispatch's fourth backend (talaria/executor/matmul.py measures it beside the libraries). On the
  2-core Intel Xeon the project runs on, every library reads a float32 weight at 24-28 GB/s for one
  row but 9-15 GB/s from 4 rows up: at 8 rows the arithmetic takes as long as the memory stream, and
  they do not overlap the two. This kernel does, with one software prefetch of the weight
  PREFETCH_ROWS rows ahead beside each load (docs/engine-cpu.md, "On the Intel Xeon"). Two weight
  rows at a time, one accumulator per weight row and token, dot products along the input, the
  input's tail past a multiple of 16 through masked loads, the weight's rows split between threads.
- `paged_decode(q, k_cache, v_cache, pages, lengths, scale)`: one query per decoding sequence
  against its K/V where they lie in the cache's pages (talaria/executor/attention.py's decode
  batches without a shared prefix). The torch path copies every sequence's pages into a padded batch
  (two gathers a layer), masks it, and runs SDPA; this reads the pages in place, only up to each
  context's length, so nothing is copied, padded or masked. One task per (sequence, KV head): the
  scores of its query heads (GQA), their softmax (a vectorised exp), the values weighted by it.
- `moe_experts(x, gate_up, down, counts)`: one MoE layer's routed experts in one call when no expert
  has more than 8 assignments (a decode step; talaria/executor/moe.py), where the torch loop makes
  five or six calls an expert: each expert a task, its gate+up and down products by the small-row
  inner loop, silu(gate) * up between them. The expert products are small (0.5-1 MiB) and each call
  of the loop costs more than its bytes.

All are plain C++ (no torch headers: they compile in about a second) called through ctypes, built
once per machine with the system compiler (`$CXX`, g++ or c++) into `$TALARIA_CACHE_DIR/kernels/`,
under a file lock, so ranks starting together build them once. The library links torch's libgomp
by its rpath, so its OpenMP threads are torch's. A CPU without AVX-512 (as torch's own kernels see
it), no compiler, a failed build, or `TALARIA_CPU_KERNELS=0` leaves them out: `small_rows` raises
`NotImplementedError` (the dispatch's "this backend cannot run the product"), `paged_decode_runs`
and `moe_experts_runs` say no, and torch runs everything. A failed build is remembered beside the
library (`.failed`, with the compiler's message) so later processes do not retry it; deleting the
folder tries again.
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
ENV_VAR = "TALARIA_CPU_KERNELS"  # "0": leave them out, torch runs everything
# where they run, decode attention through `paged_decode` and a decode step's experts through `moe_experts`
# (bench/small_rows.py --decode turns them off to compare)
PAGED_DECODE = MOE_EXPERTS = True
FLAGS = ("-O3", "-mavx512f", "-fopenmp", "-shared", "-fPIC", "-std=c++17")

SOURCE = r"""
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <vector>

// The lanes of a 16-float vector that hold elements when `left` of them remain.
static inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

// y (M, N) = x (M, K) w (N, K)^T (+ bias), float32, M <= 8, rows n0..n1 of w: R weight rows at a
// time, one accumulator per weight row and token; the input's tail past a multiple of 16 through
// masked loads. `pf`: prefetch the weight `pf` rows ahead (0: none).
template <int M, int R>
static void block(const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t n1,
                  int64_t N, int64_t K, int64_t pf) {
  const int64_t K16 = K / 16 * 16;
  const __mmask16 tail = lanes(K - K16);
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

// e^x for x <= 0 (scores less their maximum): 2^n e^r with |r| <= ln2 / 2, e^r by its Taylor series
// to r^7 (truncation under 6e-9, below float32's rounding), 2^n by scalef; under -87 it is 0 to float32.
static inline __m512 exp_le0(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln2, ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  const float c[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  for (float ci : c) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ci));
  return _mm512_scalef_ps(p, n);
}

// One decode query per sequence against its paged K/V: q (B, nh, hd) -> out (B, nh, hd), float32.
// Sequence b's token t lies in page pages[b * width + t / ps], row t % ps; a cache's element (page,
// row, kv head, d) at page * page_stride + row * token_stride + head * hd + d. Query head j reads KV
// head j / (nh / nkv) (GQA). Each (sequence, KV head) is one task: its scores for the group's query
// heads over the context, their softmax, then the values weighted by it.
extern "C" int talaria_paged_decode(const float* q, const float* kc, const float* vc, int64_t k_page,
                                    int64_t k_token, int64_t v_page, int64_t v_token, const int64_t* pages,
                                    const int64_t* ctx, float* out, int64_t B, int64_t nh, int64_t nkv,
                                    int64_t hd, int64_t ps, int64_t width, float scale, int threads) {
  if (hd % 16 || hd > 256 || nh % nkv) return -1;
  const int64_t g = nh / nkv, V = hd / 16;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> s;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * nkv; ++task) {
      const int64_t b = task / nkv, h = task % nkv, n = ctx[b], n16 = (n + 15) / 16 * 16;
      const int64_t* pg = pages + b * width;
      s.resize(g * n16);
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = q + (b * nh + h * g + j) * hd;
        __m512 qv[16];
        for (int64_t v = 0; v < V; ++v) qv[v] = _mm512_loadu_ps(qj + 16 * v);
        float* sj = s.data() + j * n16;
        for (int64_t t = 0; t < n; ++t) {
          const float* kr = kc + pg[t / ps] * k_page + (t % ps) * k_token + h * hd;
          __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
          for (int64_t v = 1; v < V; ++v) acc = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(kr + 16 * v), acc);
          sj[t] = _mm512_reduce_add_ps(acc) * scale;
        }
        float m = sj[0];
        for (int64_t t = 1; t < n; ++t) m = std::max(m, sj[t]);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 16) {
          const __mmask16 live = lanes(n - t);
          const __m512 e = exp_le0(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sj + t), _mm512_set1_ps(m)));
          sum = _mm512_mask_add_ps(sum, live, sum, e);
          _mm512_mask_storeu_ps(sj + t, live, e);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
        __m512 acc[16];
        for (int64_t v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; ++t) {
          const float* vr = vc + pg[t / ps] * v_page + (t % ps) * v_token + h * hd;
          const __m512 p = _mm512_set1_ps(sj[t]);
          for (int64_t v = 0; v < V; ++v) acc[v] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * v), acc[v]);
        }
        float* o = out + (b * nh + h * g + j) * hd;
        for (int64_t v = 0; v < V; ++v) _mm512_storeu_ps(o + 16 * v, _mm512_mul_ps(acc[v], inv));
      }
    }
  }
  return 0;
}

// The rows n0..n1 of y (M, N) = x (M, K) w (N, K)^T for any M <= 8, on the calling thread.
static void block_any(int64_t M, const float* x, const float* w, float* y, int64_t n0, int64_t n1, int64_t N,
                      int64_t K, int64_t pf) {
  switch (M) {
    case 1: block<1, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
    case 2: block<2, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
    case 3: block<3, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
    case 4: block<4, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
    case 5: block<5, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
    case 6: block<6, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
    case 7: block<7, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
    default: block<8, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
  }
}

// One MoE layer's routed experts, each over its assignments: x (A, H) grouped by expert, counts[e]
// of them for expert e in order; gate_up (E, 2I, H) (gate rows, then up rows), down (E, H, I) ->
// y (A, H) = (silu(x Wg^T) * x Wu^T) Wd^T per expert. One expert a task, eight rows at a time.
extern "C" int talaria_moe_experts(const float* x, const float* gate_up, const float* down, const int64_t* counts,
                                   float* y, int64_t E, int64_t H, int64_t I, int64_t pf, int threads) {
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> gu(8 * 2 * I), act(8 * I);
#pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r = start[e]; r < start[e + 1]; r += 8) {
        const int64_t m = std::min<int64_t>(8, start[e + 1] - r);
        block_any(m, x + r * H, gate_up + e * 2 * I * H, gu.data(), 0, 2 * I, 2 * I, H, pf);
        for (int64_t i = 0; i < m; ++i) {  // silu(gate) * up, sigmoid from e^-|g| (exp_le0's domain)
          const float* g = gu.data() + i * 2 * I;
          for (int64_t j = 0; j < I; j += 16) {
            const __mmask16 live = lanes(I - j);
            const __m512 gv = _mm512_maskz_loadu_ps(live, g + j), uv = _mm512_maskz_loadu_ps(live, g + I + j);
            const __m512 t = exp_le0(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
            const __m512 one = _mm512_set1_ps(1.0f);
            const __mmask16 pos = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_GE_OQ);
            const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(pos, t, one), _mm512_add_ps(one, t));
            _mm512_mask_storeu_ps(act.data() + i * I + j, live, _mm512_mul_ps(_mm512_mul_ps(gv, sig), uv));
          }
        }
        block_any(m, act.data(), down + e * H * I, y + r * H, 0, H, H, I, pf);
      }
    }
  }
  return 0;
}
"""

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_library: ctypes.CDLL | None = None
_missing: str | None = None  # why the kernels are not here, once that is known


def build(folder: Path | None = None) -> Path:
    """The kernels' shared library, compiled once per source, flags and machine (under a lock: one
    process builds, the others wait and load it). Raises OSError with the reason when it cannot be."""
    folder = folder or default_cache_dir() / "kernels"
    torch_lib = Path(torch.__file__).parent / "lib"  # its libgomp: torch's OpenMP threads, not a second pool
    key = hashlib.blake2b(f"{SOURCE}{FLAGS}{platform.machine()}{torch_lib}".encode(), digest_size=8).hexdigest()
    out = folder / f"cpu_kernels-{key}.so"
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
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        log.info("building Talaria's CPU kernels (%s, once per machine)", cxx)
        done = subprocess.run([cxx, *FLAGS, str(src), f"-Wl,-rpath,{torch_lib}", "-o", str(tmp)],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            failed.write_text(f"{cxx}: exit {done.returncode}\n{done.stderr}")
            raise OSError(f"{cxx} could not build it:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    return out


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built first where needed; None (with one warning a process where the build
    failed) where they cannot run here or are turned off."""
    global _library, _missing
    if _library is not None or _missing is not None:
        return _library
    if os.environ.get(ENV_VAR, "1") == "0":
        _missing = f"turned off ({ENV_VAR}=0)"
        return None
    if torch.backends.cpu.get_cpu_capability() != "AVX512":  # what torch's own kernels dispatch on
        _missing = f"the CPU runs torch's {torch.backends.cpu.get_cpu_capability()} kernels, not AVX-512"
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except OSError as e:
        _missing = str(e)
        warnings.warn(f"Talaria's CPU kernels are left out ({e}); torch runs every product and attention",
                      stacklevel=2)
        return None
    lib.talaria_small_rows.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_int]
    lib.talaria_paged_decode.argtypes = [_P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I64,
                                         _I64, _I64, ctypes.c_float, ctypes.c_int]
    lib.talaria_moe_experts.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_int]
    lib.talaria_small_rows.restype = lib.talaria_paged_decode.restype = lib.talaria_moe_experts.restype = ctypes.c_int
    _library = lib
    return lib


def small_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
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
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)  # whatever torch's default dtype
    lib.talaria_small_rows(x.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                           x.shape[0], w.shape[0], x.shape[1], prefetch, torch.get_num_threads())
    return y


def paged_decode_runs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `paged_decode` runs this attention: float32 on the CPU, a head width that is a multiple
    of 16 up to 256, each cache a (pages, page_size, kv heads, head width) view whose heads are
    contiguous, and the kernels here."""
    hd = q.shape[-1]
    return (PAGED_DECODE and q.device.type == "cpu" and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and hd % 16 == 0 and hd <= 256 and q.shape[1] % k_cache.shape[2] == 0
            and k_cache.stride()[2:] == v_cache.stride()[2:] == (hd, 1) and library() is not None)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                 lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, nh, hd), one query per sequence; caches (pages, page_size, nkv, hd); pages (B, width)
    int64, sequence b's context in pages[b] (padding past it is never read); lengths (B,) int64, each
    context's tokens, at least one -> (B, nh, hd): softmax(q K^T scale) V over each context."""
    if pages.dtype != torch.int64 or lengths.dtype != torch.int64:  # the kernel reads them as int64
        raise TypeError(f"paged_decode: pages and lengths are int64, not {pages.dtype} and {lengths.dtype}")
    B, nh, hd = q.shape
    q = q.contiguous()
    pages, lengths = pages.contiguous(), lengths.contiguous()
    out = torch.empty_like(q)
    refused = library().talaria_paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                                   k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), pages.data_ptr(),
                                   lengths.data_ptr(), out.data_ptr(), B, nh, k_cache.shape[2], hd,
                                   k_cache.shape[1], pages.shape[1], scale, torch.get_num_threads())
    if refused:  # a head width or head grouping `paged_decode_runs` would have declined
        raise ValueError(f"paged_decode: q {tuple(q.shape)} against {k_cache.shape[2]} KV heads: not a shape it runs")
    return out


def moe_experts_runs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor) -> bool:
    """Whether `moe_experts` runs this layer's experts: float32 on the CPU, stacked dense weights, and
    at most MAX_ROWS assignments to any expert (`counts`, per expert: a decode step's; a prompt's many
    go to the GEMMs)."""
    return (MOE_EXPERTS and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)  # not packed
            and x.device.type == "cpu" and x.dtype == gate_up.dtype == down.dtype == torch.float32
            and gate_up.dim() == down.dim() == 3 and gate_up.is_contiguous() and down.is_contiguous()
            and int(counts.max()) <= MAX_ROWS and library() is not None)


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (A, H), the assignments grouped by expert, counts (E,) int64 of them per expert in order;
    gate_up (E, 2I, H), down (E, H, I) -> (A, H): each expert's silu(x Wg^T) * (x Wu^T), times Wd^T.
    One call for the layer's experts, where the torch loop makes five or six calls an expert."""
    E, two_i, H = gate_up.shape
    if counts.dtype != torch.int64 or x.shape != (int(counts.sum()), H) or down.shape != (E, H, two_i // 2):
        raise ValueError(f"moe_experts: x {tuple(x.shape)}, counts {counts.dtype} summing to {int(counts.sum())}, "
                         f"gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)} do not make the experts")
    x, counts = x.contiguous(), counts.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32)
    library().talaria_moe_experts(x.data_ptr(), gate_up.data_ptr(), down.data_ptr(), counts.data_ptr(), y.data_ptr(),
                                  E, H, two_i // 2, PREFETCH_ROWS, torch.get_num_threads())
    return y
