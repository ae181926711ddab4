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
- `moe_routed(logits, h, gate_up, down, k, norm)`: the same for a decode step of at most 8 tokens,
  with the routing around it: each token's top-k experts by router logit and their softmax weights,
  the tokens' rows gathered per expert, and the weighted sum of their outputs. The torch path makes
  a dozen small calls for those (softmax, topk, argsort, bincount, gathers, a scatter, bmm).

- `talaria_decode_attention`, `talaria_decode_mlp` and `talaria_decode_moe` (decode_layer.cpp): a
  decode step's attention block and MLP block (dense, or routed experts) of a layer, each one call
  from the residual stream back into it, with the parts above inside; talaria/executor/decode_layer.py
  calls them.

All are plain C++ (no torch headers), a source a family (small_rows.cpp, paged_attention.cpp,
moe_kernels.cpp, decode_layer.cpp, sharing cpu_kernels.h), called through ctypes, built once per
machine with the system compiler (`$CXX`, g++ or c++; the sources side by side, a few seconds) into
`$TALARIA_CACHE_DIR/kernels/`, under a file lock, so ranks starting together build them
once. The library links torch's libgomp by its rpath, so its OpenMP threads are torch's. A CPU
without AVX-512 (as torch's own kernels see it), no compiler, a failed build, or
`TALARIA_CPU_KERNELS=0` leaves them out: `small_rows` raises `NotImplementedError` (the dispatch's
"this backend cannot run the product"), `paged_decode_runs`, `moe_experts_runs` and
`moe_routed_runs` say no, decode_layer.py fuses nothing, and torch runs everything. A failed build
is remembered beside the library (`.failed`, with the compiler's message) so later processes do not
retry it; deleting the folder tries again.
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
# where they run, decode attention through `paged_decode`, a decode step's MoE layers through `moe_routed`
# and `moe_experts`, and its decoder layers' blocks through talaria/executor/decode_layer.py
# (bench/small_rows.py --decode turns them off to compare)
PAGED_DECODE = MOE_EXPERTS = DECODE_LAYERS = True
# -ffp-contract=off: an a * b + c the source writes is two roundings, as torch computes it, never an FMA unasked
FLAGS = ("-O3", "-mavx512f", "-ffp-contract=off", "-fopenmp", "-fPIC", "-std=c++17")  # each source's; linked -shared

# the C++ (no torch headers), read once: the library is built from this text, whatever the files become
SOURCES = {name: (Path(__file__).parent / name).read_text() for name in (
    "cpu_kernels.h", "small_rows.cpp", "paged_attention.cpp", "moe_kernels.cpp", "decode_layer.cpp")}

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_library: ctypes.CDLL | None = None
_missing: str | None = None  # why the kernels are not here, once that is known


def build(folder: Path | None = None) -> Path:
    """The kernels' shared library, compiled once per source, flags and machine (under a lock: one
    process builds, the others wait and load it). Raises OSError with the reason when it cannot be."""
    folder = folder or default_cache_dir() / "kernels"
    torch_lib = Path(torch.__file__).parent / "lib"  # its libgomp: torch's OpenMP threads, not a second pool
    key = hashlib.blake2b(f"{SOURCES}{FLAGS}{platform.machine()}{torch_lib}".encode(), digest_size=8).hexdigest()
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
        src = out.with_suffix("")  # the sources it is built from, beside it
        src.mkdir(exist_ok=True)
        for name, text in SOURCES.items():
            (src / name).write_text(text)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        log.info("building Talaria's CPU kernels (%s, once per machine)", cxx)
        objects = {src / name: src / f"{name}.o" for name in SOURCES if name.endswith(".cpp")}
        code, errors = _run_all([[cxx, *FLAGS, "-c", str(unit), "-o", str(obj)] for unit, obj in objects.items()])
        if not code:
            code, errors = _run_all([[cxx, *FLAGS, "-shared", *map(str, objects.values()), f"-Wl,-rpath,{torch_lib}",
                                      "-o", str(tmp)]])
        if code:
            failed.write_text(f"{cxx}: exit {code}\n{errors}")
            raise OSError(f"{cxx} could not build it:\n{errors[-2000:]}")
        os.replace(tmp, out)
    return out


def _run_all(commands: list[list[str]]) -> tuple[int, str]:
    """Run the commands side by side (a compiler a source, on as many cores); the first failure's
    exit code (0: none) and their error output."""
    runs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in commands]
    errors = "".join(r.communicate()[1] for r in runs)
    return next((r.returncode for r in runs if r.returncode), 0), errors


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
    lib.talaria_moe_routed.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int, _I64, _I64, _I64,
                                       ctypes.c_int]
    lib.talaria_decode_attention.argtypes = [_P, _I64, _I64, _P, ctypes.c_float, _P, _P, _P, _P, _P, _P, _P,  # x .. wo
                                             _P, _P, _I64, _I64, _I64, _I64, _I64,  # the caches
                                             _P, _P, _P, _I64, _P, _P, _I64,  # where new keys go, what each attends
                                             _I64, _I64, _I64, ctypes.c_float, _I64, ctypes.c_int]
    lib.talaria_decode_mlp.argtypes = [_P, _I64, _I64, _P, ctypes.c_float, _P, _P, _I64, _I64, ctypes.c_int]
    lib.talaria_decode_moe.argtypes = [_P, _I64, _I64, _P, ctypes.c_float, _P, _P, _P, _I64, _I64, ctypes.c_int,
                                       _I64, _I64, ctypes.c_int]
    for fn in (lib.talaria_small_rows, lib.talaria_paged_decode, lib.talaria_moe_experts, lib.talaria_moe_routed,
               lib.talaria_decode_attention, lib.talaria_decode_mlp, lib.talaria_decode_moe):
        fn.restype = ctypes.c_int
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


def _dense_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """The MoE kernels' common ground: turned on, float32 on the CPU, the experts stacked dense and
    contiguous (not packed), and the kernels here."""
    return (MOE_EXPERTS and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and x.device.type == "cpu" and x.dtype == gate_up.dtype == down.dtype == torch.float32
            and gate_up.dim() == down.dim() == 3 and gate_up.is_contiguous() and down.is_contiguous()
            and library() is not None)


def moe_experts_runs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor) -> bool:
    """Whether `moe_experts` runs this layer's experts: `_dense_experts`, and at most MAX_ROWS
    assignments to any expert (`counts`, per expert: a decode step's; a prompt's many go to the GEMMs)."""
    return _dense_experts(x, gate_up, down) and int(counts.max()) <= MAX_ROWS


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


def moe_routed_runs(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `moe_routed` runs this layer on `h`: 1 to MAX_ROWS tokens (a decode step's) and
    `_dense_experts` (softmax routing is the caller's check)."""
    return h.dim() == 2 and 1 <= h.shape[0] <= MAX_ROWS and _dense_experts(h, gate_up, down)


def moe_routed(logits: torch.Tensor, h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int,
               norm: bool) -> torch.Tensor:
    """A MoE layer's routed experts on h (T, H), routing included: logits (T, E) float32, the router's;
    each token's k best experts, weighted by their softmax probabilities (renormalised over the k when
    `norm`), gate_up (E, 2I, H), down (E, H, I) -> (T, H), the weighted sum of its experts' outputs.
    One call, where the torch path makes a dozen around the experts (talaria/executor/moe.py)."""
    (T, H), (E, two_i, _) = h.shape, gate_up.shape
    if logits.shape != (T, E) or logits.dtype != torch.float32 or down.shape != (E, H, two_i // 2) or not 1 <= k <= E:
        raise ValueError(f"moe_routed: logits {tuple(logits.shape)} {logits.dtype}, h {tuple(h.shape)}, gate_up "
                         f"{tuple(gate_up.shape)}, down {tuple(down.shape)}, top-{k}: not a MoE layer")
    h, logits = h.contiguous(), logits.contiguous()
    out = torch.empty(T, H, dtype=torch.float32)
    if library().talaria_moe_routed(logits.data_ptr(), h.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
                                    out.data_ptr(), T, E, k, int(norm), H, two_i // 2, PREFETCH_ROWS,
                                    torch.get_num_threads()):
        raise ValueError(f"moe_routed: {T} tokens, not 1 to {MAX_ROWS}")
    return out
