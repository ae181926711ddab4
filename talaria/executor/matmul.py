"""The model's matrix products with its weights: one entry point, `linear(x, w)`.

Every projection of the model code goes through here, whatever the weight is: a plain tensor in
the arena, or a quantized one (talaria/executor/quant.py) that is dequantized just before use. This
is where a product picks how it runs (its backend), so the model code says only what it multiplies.

**Backends on the CPU.** torch's float32 `F.linear` runs MKL's GEMM, whose kernels for a few rows
are slow on some CPUs: on the 2-core AMD EPYC (AVX-512, avx512_bf16) the project is developed on,
oneDNN (`torch.ops.mkldnn._linear_pointwise`) on the very same weight is up to 2.2x faster, most at
1 to 16 rows of the large weights, while for small weights at 2 to 8 rows MKL with the weight on
the left (`w @ x^T`) beats both (docs/engine-cpu.md has the measured table). No rule of thumb holds
across shapes, so each product is *measured*: the first time a (dtype, weight shape, bias, row
bucket) comes through, every backend runs it a few times on a random input of the bucket's rows,
interleaved so a noisy neighbour slows them alike, with its weight streaming from memory as in a
forward, and the fastest run wins. The choice is kept for the process, and in a file under the
conversion cache keyed by the CPU model, torch's version and its thread count
(`$TALARIA_CACHE_DIR/matmul/`) when it can be trusted, its runs steady. One made while the machine
was oversubscribed (on a shared 2-core machine under a load of 10, every backend's run waits out a
neighbour's time slice) is marked so: busy processes reuse it, a quiet one measures that shape again
and its choice replaces it. So a machine measures a shape about once; deleting the folder measures
again. `TALARIA_MATMUL=<backend>` forces one backend everywhere it runs.

The libraries are not the end of it. On the 2-core Intel Xeon the project later ran on, every one of
them reads a float32 weight at 24-28 GB/s for one row but 9-15 GB/s from 4 rows up: at 8 rows the
arithmetic is as long as the memory stream and they do not overlap the two. A fourth backend,
`small_rows` (talaria/executor/cpu_kernels.py), is an AVX-512 kernel of our own for 1 to 8 rows that
prefetches the weight ahead of its loads; it is measured beside the libraries like any backend, and
where it cannot run (no AVX-512, no compiler, past 8 rows, bfloat16) it is left out.

Every backend reads the weight where it lies, a plain tensor in the arena: none keeps a prepacked
copy, so staging, D2D switches and host restores, which copy arena bytes and rebind views, stay
exactly as they are (a prepacked oneDNN weight would be a second copy of every weight outside the
arena, rebuilt at every switch).

float64 (the equivalence tests' reference dtype), float16, other devices and packed weights take
the one path they always took (`F.linear`, the GPU's own BLAS, `quantized_linear`).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from talaria.executor import cpu_kernels
from talaria.executor.quant import QStack, QWeight, Weight, quantized_linear
from talaria.models.conversion_cache import default_cache_dir, fingerprint

Backend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # x (M, in), w, bias -> (M, out)
MEASURED = (torch.float32, torch.bfloat16)  # the CPU dtypes whose products are measured
MAX_ROWS = 1024  # the largest row bucket: a longer prefill chunk runs as the 1,024-row bucket chose
MIN_ROUNDS, MAX_ROUNDS = 3, 12  # timed runs of each backend: a steady measurement takes MIN_ROUNDS at least
BUDGET_S = 0.25  # a measurement stops once it has taken this long, whatever its rounds (then it is not steady)
STEADY = 1.2  # a backend's two fastest runs within 20%: the measurement is worth keeping in the file
STREAM_BYTES = 256 << 10  # a weight this large is measured streaming from memory, as a forward reads it
STREAM_CAP = 64 << 20  # the copies it streams over: twice the last-level cache, but never more than this
ENV_VAR = "TALARIA_MATMUL"
SCHEMA = 4  # of the choices file (3: large weights streamed; 4: streams capped, busy measurements kept, flagged)


def _f_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, bias)


def _weight_left(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(w @ x^T)^T: BLAS splits the product over the weight's rows, which suits a few tokens."""
    y = torch.mm(w, x.t()).t().contiguous()  # (M, out)
    return y if bias is None else y.add_(bias)


def _onednn(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


# small_rows: our AVX-512 kernel for float32 at 1 to 8 rows; it raises NotImplementedError for anything
# else and where it cannot run, and a measurement leaves it out of that product
BACKENDS: dict[str, Backend] = {"f_linear": _f_linear, "weight_left": _weight_left, "onednn": _onednn,
                                "small_rows": cpu_kernels.small_rows}


def row_bucket(rows: int) -> int:
    """The power of two at or above `rows`, at most MAX_ROWS: the row count a choice is measured at."""
    return min(MAX_ROWS, 1 << max(rows - 1, 0).bit_length())


def last_level_cache() -> int:
    """Bytes of the CPU's largest cache (sysfs), or 32 MiB where it does not say."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError):
            pass
    return max(sizes, default=32 << 20)


def streamed(w: torch.Tensor) -> list[torch.Tensor]:
    """`w` and copies of it, twice the last-level cache in all (at most STREAM_CAP): run over them in
    turn, a product reads its weight from memory, as in a forward, whose weights outgrow the cache.
    The cap bounds what a measurement costs on a CPU with a very large cache (a 300 MiB L3 made
    600 MiB of copies a shape, and seconds of measuring under load); there it is partly in cache."""
    n = -(-min(2 * last_level_cache(), STREAM_CAP) // (w.numel() * w.element_size()))
    return [w] + [w.clone() for _ in range(n - 1)]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


class MatmulDispatch:
    """Which backend runs each product on the CPU, measured once per shape and row bucket.

    One per process (`DISPATCH`): what is fastest is a property of the machine and of torch's
    thread count, not of a model, so every model and rank of the process shares the choices, and a
    thread count of its own keeps its own (a benchmark that changes threads measures again).
    """

    def __init__(self, backends: dict[str, Backend] = BACKENDS, folder: Callable[[], Path] | None = None,
                 clock: Callable[[], float] = time.perf_counter, forced: str | None = None,
                 quiet: Callable[[], bool] = lambda: os.getloadavg()[0] <= (os.cpu_count() or 1)) -> None:
        """folder: where choices persist, asked when a file is read or written (None: this process
        only); forced: one backend's name, used for every product; quiet: whether the machine has a
        core for each runnable thread (the 1-minute load average), asked after a measurement."""
        if forced is not None and forced not in backends:
            raise ValueError(f"{ENV_VAR}={forced!r}: choose one of {', '.join(backends)}")
        self.backends = backends
        self.folder = folder
        self.clock = clock
        self.forced = forced
        self.quiet = quiet
        self.chosen: dict[tuple[int, str], str] = {}  # (threads, key) -> backend name
        self.seconds: dict[tuple[int, str], dict[str, float]] = {}  # what this process measured for each choice
        self.kept: dict[tuple[int, str], bool] = {}  # the steady measurements, for the file: were they quiet?
        self._loaded: set[int] = set()  # thread counts whose file has been read
        self._fast: dict[tuple, Backend] = {}  # (threads, dtype, shape, bias, bucket) -> backend: the hot path's lookup

    @classmethod
    def default(cls) -> MatmulDispatch:
        """The process's dispatch: choices kept under the conversion cache, TALARIA_MATMUL honoured (a
        name that is no backend is a warning, not an import error, and every product is measured)."""
        forced = os.environ.get(ENV_VAR) or None
        if forced is not None and forced not in BACKENDS:
            warnings.warn(f"{ENV_VAR}={forced!r} is not a backend ({', '.join(BACKENDS)}): ignored, each product "
                          "runs on the backend measured fastest", stacklevel=2)
            forced = None
        return cls(folder=lambda: default_cache_dir() / "matmul", forced=forced)

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., in) @ w (out, in)^T + bias on the backend chosen for it."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not (x.device.type == "cpu" and x.dtype in MEASURED and w.dtype == x.dtype and rows
                and w.dim() == 2 and w.is_contiguous()):
            return F.linear(x, w, bias)
        x2 = x.reshape(rows, x.shape[-1])
        if self.forced:
            try:
                return self.backends[self.forced](x2, w, bias).view(*x.shape[:-1], w.shape[0])
            except NotImplementedError:  # a product the forced backend cannot run (small_rows past 8 rows)
                return F.linear(x, w, bias)
        fast = (torch.get_num_threads(), x.dtype, w.shape, bias is not None, row_bucket(rows))
        fn = self._fast.get(fast)
        if fn is None:
            fn = self._fast[fast] = self.backends[self.backend(x.dtype, w, bias, rows)]
        y = fn(x2, w, bias)  # (rows, out)
        return y.view(*x.shape[:-1], w.shape[0])

    def backend(self, dtype: torch.dtype, w: torch.Tensor, bias: torch.Tensor | None, rows: int) -> str:
        """The backend's name for this product: chosen before, or measured now."""
        threads = torch.get_num_threads()
        bucket = row_bucket(rows)
        shape = f"{w.shape[0]}x{w.shape[1]}"
        key = (threads, f"{str(dtype).removeprefix('torch.')} {shape} bias={int(bias is not None)} rows<={bucket}")
        if key not in self.chosen and threads not in self._loaded:
            self._load(threads)
        if key not in self.chosen:
            seconds, steady = self.measure(bucket, w, bias)
            self.seconds[key], self.chosen[key] = seconds, min(seconds, key=seconds.get)
            if steady:
                self.kept[key] = self.quiet()
                self._save(threads)
        return self.chosen[key]

    def measure(self, rows: int, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[dict[str, float], bool]:
        """The fastest run of each backend on a random (rows, in) input, in seconds, and whether the
        measurement was steady: each backend's two fastest runs (of MIN_ROUNDS at least) within
        STEADY of each other.

        The runs interleave the backends, so a neighbour's burst of work slows them alike, and the
        fastest run is kept (the slower ones measure the neighbours). Rounds go on until the runs are
        steady, up to MAX_ROUNDS, and stop once the measurement has taken BUDGET_S (a busy machine
        then pays about that much a shape and bucket, not seconds); an unsteady measurement still
        chooses, for this process only. One untimed call each first: oneDNN builds its primitive on the first. A backend that
        cannot run the product is left out.

        A weight of STREAM_BYTES or more is measured as a forward reads it, from memory: a timed run
        is the product over `streamed(w)`, a copy after another, divided by the copies. Measured in
        the cache, the backend with the cheapest call would win at a few rows; streaming, the one
        that streams best does, which is what a forward pays.
        """
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
        runs: dict[str, list[float]] = {}
        for name, fn in self.backends.items():
            try:
                fn(x, w, bias)
            except (RuntimeError, NotImplementedError):
                continue
            runs[name] = []
        if not runs:
            raise RuntimeError(f"no matmul backend runs a {tuple(w.shape)} {w.dtype} product")
        weights = streamed(w) if w.numel() * w.element_size() >= STREAM_BYTES else [w]
        start = self.clock()
        while True:
            for name, times in runs.items():
                fn = self.backends[name]
                t0 = self.clock()
                for each in weights:
                    fn(x, each, bias)
                times.append((self.clock() - t0) / len(weights))
            best = {name: sorted(times)[:2] for name, times in runs.items()}
            rounds = len(runs[next(iter(runs))])
            steady = rounds >= MIN_ROUNDS and all(b[1] <= STEADY * b[0] for b in best.values())
            if steady or rounds >= MAX_ROUNDS or self.clock() - start > BUDGET_S:
                return {name: b[0] for name, b in best.items()}, steady

    # ---- the file: one per CPU model, torch version and thread count ---------------------------

    def path(self, threads: int) -> Path | None:
        if self.folder is None:
            return None
        # the backends that run here: a file of choices made with our kernels is not read where they cannot
        # run (TALARIA_CPU_KERNELS=0, no compiler), which would choose a backend that raises on every call
        runnable = sorted(n for n in self.backends if n != "small_rows" or cpu_kernels.library() is not None)
        key = fingerprint({"schema": SCHEMA, "cpu": cpu_name(), "torch": torch.__version__, "threads": threads,
                           "backends": runnable})
        return self.folder() / f"{key}.json"

    def _load(self, threads: int) -> None:
        """The file's choices; on a quiet machine not those measured on a busy one, which it measures
        again (and its quiet measurement replaces them in the file)."""
        self._loaded.add(threads)
        path = self.path(threads)
        try:
            stored = json.loads(path.read_text())["choices"] if path is not None else {}
        except (OSError, ValueError, KeyError, TypeError):
            return  # absent or unreadable: measure
        quiet = self.quiet()
        for key, entry in stored.items():
            if isinstance(entry, dict) and entry.get("backend") in self.backends and \
                    not (quiet and entry.get("quiet") is False):
                self.chosen[(threads, key)] = entry["backend"]

    def _save(self, threads: int) -> None:
        """Merge this process's steady choices into the file; another process's, written meanwhile,
        stay, and a busy measurement never replaces a quiet one."""
        path = self.path(threads)
        if path is None:
            return
        try:
            stored = json.loads(path.read_text()).get("choices", {})
        except (OSError, ValueError, AttributeError):
            stored = {}
        mine = {k: {"backend": self.chosen[(t, k)], "seconds": self.seconds[(t, k)], "quiet": quiet}
                for (t, k), quiet in self.kept.items()
                if t == threads and (quiet or stored.get(k, {}).get("quiet") is False or k not in stored)}
        body = {"schema": SCHEMA, "cpu": cpu_name(), "torch": torch.__version__, "threads": threads,
                "choices": stored | mine}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs the next process its measurements


DISPATCH = MatmulDispatch.default()


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ w (out, in)^T + bias -> (..., out), in x's dtype."""
    if isinstance(w, (QWeight, QStack)):
        return quantized_linear(x, w, bias)
    return DISPATCH.linear(x, w, bias)
