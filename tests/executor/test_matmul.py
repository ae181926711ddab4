"""The matrix-product dispatch (talaria/executor/matmul.py): every backend computes F.linear's product
within float32 rounding and reads the weight where it lies; the fastest backend is chosen once per
shape and row bucket, kept per thread count in a file; float64 never leaves F.linear. Which backend
is fastest is measured through an injected clock here, so the tests never time anything."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from talaria.executor import cpu_kernels, matmul
from talaria.executor.matmul import (
    BACKENDS,
    STREAM_BYTES,
    MatmulDispatch,
    row_bucket,
    streamed,
)


def operands(rows: int, out: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g, dtype=torch.float64)
    w = torch.randn(out, k, generator=g, dtype=torch.float64) / k ** 0.5
    b = torch.randn(out, generator=g, dtype=torch.float64)
    return x.to(dtype), w.to(dtype), b.to(dtype)


def runs(x: torch.Tensor) -> dict:
    """The backends that run a product of x: all of them, less our kernel past its domain (float32,
    1 to 8 rows) or where it cannot run; tests/executor/test_cpu_kernels.py holds it to both."""
    return {name: fn for name, fn in BACKENDS.items() if name != "small_rows" or (
        x.dtype == torch.float32 and x.shape[0] <= cpu_kernels.MAX_ROWS and cpu_kernels.library() is not None)}


class FakeCosts:
    """Backends that compute F.linear and advance a fake clock by a cost per name and row count (ms)."""

    def __init__(self, cost) -> None:
        self.now = 0.0
        self.cost = cost  # (name, rows) -> seconds
        self.calls: Counter[str] = Counter()

    def clock(self) -> float:
        return self.now

    def backends(self, names=("slow", "fast", "middling")) -> dict:
        def make(name):
            def run(x, w, bias):
                self.calls[name] += 1
                self.now += self.cost(name, x.shape[0]) * 1e-3
                return F.linear(x, w, bias)
            return run
        return {n: make(n) for n in names}


@pytest.mark.parametrize("rows", [1, 3, 8, 33, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_backend_is_f_linear_within_float32_rounding(rows, with_bias):
    x, w, b = operands(rows, 96, 576)
    b = b if with_bias else None
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    f_linear_err = (F.linear(x, w, b).double() - exact).abs().max().item()
    assert ("small_rows" in runs(x)) == (rows <= 8 and cpu_kernels.library() is not None)
    for name, fn in runs(x).items():
        y = fn(x, w, b)
        assert y.shape == (rows, 96) and y.dtype == torch.float32 and y.is_contiguous(), name
        err = (y.double() - exact).abs().max().item()
        assert err <= 4 * f_linear_err + 1e-6, (name, err, f_linear_err)


def test_strided_inputs_are_read_as_they_lie():
    """MLA multiplies a column slice of its cache rows; a transposed input is another stride."""
    x, w, _ = operands(8, 32, 100)
    for xs in (x[:, :48], x[:, :48].t().contiguous().t()):
        for name, fn in runs(xs).items():
            torch.testing.assert_close(fn(xs, w[:, :48].contiguous(), None), F.linear(xs, w[:, :48]), msg=name)


def test_bfloat16_backends_agree_within_bfloat16_rounding():
    x, w, b = operands(8, 64, 256, torch.bfloat16)
    exact = F.linear(x.double(), w.double(), b.double())
    for name, fn in runs(x).items():
        torch.testing.assert_close(fn(x, w, b).double(), exact, rtol=2e-2, atol=2e-2, msg=name)


def test_a_weight_rewritten_in_place_is_read_anew():
    """A switch copies another model's bytes over the arena and rebinds views at the same addresses:
    no backend may answer from a copy of the weight it saw before."""
    x, w, _ = operands(8, 64, 128)
    _, other, _ = operands(8, 64, 128, seed=1)
    for name, fn in runs(x).items():
        arena = w.clone()
        fn(x, arena, None)
        arena.copy_(other)
        torch.testing.assert_close(fn(x, arena, None), F.linear(x, other), rtol=1e-5, atol=1e-5, msg=name)


def test_the_fastest_backend_is_chosen_once_per_shape_and_row_bucket():
    costs = FakeCosts(lambda name, rows: {"slow": 3.0, "fast": 1.0, "middling": 2.0}[name])
    d = MatmulDispatch(costs.backends(), clock=costs.clock)
    x, w, b = operands(8, 32, 16)
    for rows in (5, 6, 7, 8):  # one bucket: measured on the first, then run on the choice
        torch.testing.assert_close(d.linear(x[:rows], w), F.linear(x[:rows], w))
    measured = dict(costs.calls)
    assert measured["slow"] == measured["middling"] == measured["fast"] - 4 == 4  # warm-up, 3 steady runs; 4 products
    assert list(d.chosen.values()) == ["fast"]
    d.linear(x[:4], w)  # rows 3-4: another bucket
    d.linear(x, w, b)  # with a bias: another product
    d.linear(x, w[:16])  # another shape
    assert len(d.chosen) == 4 and set(d.chosen.values()) == {"fast"}
    assert {k for _, k in d.chosen} == {f"float32 32x16 bias=0 rows<={r}" for r in (4, 8)} | {
        "float32 32x16 bias=1 rows<=8", "float32 16x16 bias=0 rows<=8"}


def test_a_large_weight_is_measured_streaming_from_memory(monkeypatch):
    """A model's weights outgrow the caches, so a forward streams each from memory: a weight of
    STREAM_BYTES or more is timed over copies of it filling twice the last-level cache, in turn.
    (A 6 MiB cache here: the machine's 32 MiB would make this test compute 48 products of 4 MiB.)"""
    monkeypatch.setattr(matmul, "last_level_cache", lambda: 6 << 20)
    costs = FakeCosts(lambda name, rows: {"slow": 3.0, "fast": 1.0, "middling": 2.0}[name])
    d = MatmulDispatch(costs.backends(), clock=costs.clock)
    x, w, _ = operands(8, 16 * STREAM_BYTES // 4 // 64, 64)  # 4 MiB: a few copies fill the cache twice
    d.linear(x, w)
    copies = len(streamed(w))
    assert copies * w.numel() * 4 >= 2 * (6 << 20) and copies == 3
    assert costs.calls["slow"] == 1 + 3 * copies  # the warm-up, then three steady rounds over every copy
    seconds = d.seconds[(torch.get_num_threads(), f"float32 {w.shape[0]}x64 bias=0 rows<=8")]
    assert seconds == pytest.approx({"slow": 3e-3, "fast": 1e-3, "middling": 2e-3})  # per product


def test_each_bucket_measures_at_its_own_rows_and_can_choose_differently():
    # "few" wins at one or two rows, "many" from four on: the choice follows the measurement
    costs = FakeCosts(lambda name, rows: (1.0 if rows <= 2 else 5.0) if name == "few" else 2.0)
    d = MatmulDispatch(costs.backends(("few", "many")), clock=costs.clock)
    x, w, _ = operands(300, 32, 16)
    for rows in (1, 2, 3, 8, 300):
        d.linear(x[:rows], w)
    assert [d.chosen[(torch.get_num_threads(), f"float32 32x16 bias=0 rows<={r}")] for r in (1, 2, 4, 8, 512)] == [
        "few", "few", "many", "many", "many"]
    assert [row_bucket(r) for r in (1, 2, 3, 4, 5, 1000, 1024, 1025, 5000)] == [1, 2, 4, 4, 8, 1024, 1024, 1024, 1024]


def test_float64_other_dtypes_and_leading_dims():
    costs = FakeCosts(lambda name, rows: 1.0)
    d = MatmulDispatch(costs.backends(), clock=costs.clock)
    x, w, b = operands(6, 32, 16, torch.float64)
    assert torch.equal(d.linear(x, w, b), F.linear(x, w, b))  # the reference path, bit for bit
    assert torch.equal(d.linear(x.half(), w.half()), F.linear(x.half(), w.half()))
    assert not costs.calls and not d.chosen
    x3 = x.float().view(2, 3, 16)  # (..., in) -> (..., out)
    torch.testing.assert_close(d.linear(x3, w.float(), b.float()), F.linear(x3, w.float(), b.float()))
    assert {k for _, k in d.chosen} == {"float32 32x16 bias=1 rows<=8"}


def test_choices_persist_in_one_file_per_thread_count(tmp_path):
    costs = FakeCosts(lambda name, rows: {"slow": 3.0, "fast": 1.0, "middling": 2.0}[name])
    first = MatmulDispatch(costs.backends(), folder=lambda: tmp_path, clock=costs.clock, quiet=lambda: True)
    x, w, _ = operands(8, 32, 16)
    first.linear(x, w)
    (path,) = tmp_path.glob("*.json")
    stored = json.loads(path.read_text())
    assert stored["threads"] == torch.get_num_threads()
    assert stored["choices"]["float32 32x16 bias=0 rows<=8"]["backend"] == "fast"
    assert set(stored["choices"]["float32 32x16 bias=0 rows<=8"]["seconds"]) == {"slow", "fast", "middling"}

    costs.calls.clear()
    second = MatmulDispatch(costs.backends(), folder=lambda: tmp_path, clock=costs.clock, quiet=lambda: True)
    second.linear(x, w)
    assert costs.calls == {"fast": 1}  # read from the file: nothing measured
    second.linear(x[:1], w)  # a new bucket is measured and merged into the same file
    assert set(json.loads(path.read_text())["choices"]) == {"float32 32x16 bias=0 rows<=8",
                                                            "float32 32x16 bias=0 rows<=1"}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        costs.calls.clear()
        second.linear(x, w)  # another thread count: its own file, measured again
        assert costs.calls["slow"] > 0 and len(list(tmp_path.glob("*.json"))) == 2
    finally:
        torch.set_num_threads(threads)


def test_a_measurement_made_in_noise_chooses_for_this_process_only(tmp_path):
    """Runs that do not repeat (a neighbour's time slices in some of them): the choice holds for the
    process, nothing is written."""
    jitter = iter([2.0, 1.0] + [3.0, 5.0] * 100)  # the warm-up, then one fast run among slow ones
    costs = FakeCosts(lambda name, rows: next(jitter) if name == "slow" else 2.0)
    noisy = MatmulDispatch(costs.backends(), folder=lambda: tmp_path, clock=costs.clock, quiet=lambda: True)
    x, w, _ = operands(8, 32, 16)
    noisy.linear(x, w)
    assert list(noisy.chosen.values()) == ["slow"] and not list(tmp_path.glob("*.json"))
    assert costs.calls["slow"] == 1 + 12 + 1  # the warm-up, rounds up to the limit, the product


def test_a_choice_measured_on_a_busy_machine_is_reused_busy_and_measured_again_quiet(tmp_path):
    """More runnable threads than cores: a steady choice is written marked busy. Another busy process
    reuses it (the suite's hundreds of processes measure a shape once); a quiet one measures it again,
    and its choice replaces the busy one, which never replaces a quiet one."""
    costs = FakeCosts(lambda name, rows: {"slow": 3.0, "fast": 1.0, "middling": 2.0}[name])
    x, w, _ = operands(8, 32, 16)
    key = "float32 32x16 bias=0 rows<=8"

    def run(quiet: bool) -> MatmulDispatch:
        costs.calls.clear()
        d = MatmulDispatch(costs.backends(), folder=lambda: tmp_path, clock=costs.clock, quiet=lambda: quiet)
        d.linear(x, w)
        return d

    run(quiet=False)
    (path,) = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["choices"][key]["quiet"] is False
    run(quiet=False)
    assert costs.calls == {"fast": 1}  # reused
    run(quiet=True)
    assert costs.calls["slow"] > 0  # measured again
    assert json.loads(path.read_text())["choices"][key]["quiet"] is True
    run(quiet=False)
    assert costs.calls == {"fast": 1} and json.loads(path.read_text())["choices"][key]["quiet"] is True


def test_a_forced_backend_runs_everywhere_and_a_wrong_name_is_refused():
    costs = FakeCosts(lambda name, rows: 1.0)
    d = MatmulDispatch(costs.backends(), clock=costs.clock, forced="slow")
    x, w, _ = operands(8, 32, 16)
    d.linear(x, w)
    assert costs.calls == {"slow": 1} and not d.chosen
    with pytest.raises(ValueError, match="TALARIA_MATMUL"):
        MatmulDispatch(costs.backends(), forced="mkl")


def test_a_wrong_name_in_the_environment_is_a_warning_and_every_product_measured(monkeypatch):
    """TALARIA_MATMUL is read when the module is imported: a typo there must not be an import error
    (a traceback from every `talaria` command), nor silently force anything."""
    monkeypatch.setenv("TALARIA_MATMUL", "mkl")
    with pytest.warns(UserWarning, match="TALARIA_MATMUL='mkl' is not a backend"):
        d = MatmulDispatch.default()
    assert d.forced is None
    monkeypatch.setenv("TALARIA_MATMUL", "onednn")
    assert MatmulDispatch.default().forced == "onednn"


def test_choices_made_with_our_kernel_are_not_read_where_it_cannot_run(tmp_path, monkeypatch):
    """A file whose choices name `small_rows` must not be read by a process without the kernel
    (TALARIA_CPU_KERNELS=0, no compiler): it would run a backend that refuses every product."""
    costs = FakeCosts(lambda name, rows: {"small_rows": 1.0, "f_linear": 2.0}[name])
    x, w, _ = operands(8, 32, 16)
    monkeypatch.setattr(cpu_kernels, "library", lambda: object())  # the kernel here
    first = MatmulDispatch(costs.backends(("small_rows", "f_linear")), folder=lambda: tmp_path, clock=costs.clock,
                           quiet=lambda: True)
    first.linear(x, w)
    assert list(first.chosen.values()) == ["small_rows"] and len(list(tmp_path.glob("*.json"))) == 1
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)  # and not there
    costs.calls.clear()
    without = MatmulDispatch(costs.backends(("small_rows", "f_linear")), folder=lambda: tmp_path, clock=costs.clock,
                             quiet=lambda: True)
    without.linear(x, w)
    assert costs.calls["f_linear"] > 1  # measured, not read: its file is another
    assert len(list(tmp_path.glob("*.json"))) == 2
