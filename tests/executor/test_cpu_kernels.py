"""Talaria's CPU kernels (talaria/executor/cpu_kernels.py), each against the exact computation in
float64. The small-row product: within float32 rounding on every row count, input tail and
weight-row tail it meets, with its prefetch or without; refused (for the dispatch to leave it out)
outside its domain. The paged decode attention: within float32 rounding on every context shape,
reading nothing past a context. A layer's MoE experts in one call: within float32 rounding, empty
and multi-pass experts included. All: the same bits on any thread count, built once under a lock,
a failed build remembered. They must run here where they can: a machine with AVX-512 and a compiler
that silently fell back to torch would fail this file.
"""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch
import torch.nn.functional as F

from talaria.executor import cpu_kernels
from talaria.executor.matmul import MatmulDispatch
from tests.executor.test_matmul import operands  # x (rows, k), w (out, k) / sqrt(k), bias (out,)


def rounding(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    """float32's error on a length-K dot product as it accumulates in practice: sqrt(K) eps sum |x w|
    (and the bias added after it)."""
    bound = x.shape[1] ** 0.5 * 2.0 ** -24 * (x.abs().double() @ w.abs().double().T).max().item()
    return bound + (0.0 if b is None else 2.0 ** -24 * (bound + b.abs().max().item()))


def test_it_runs_here_where_it_can():
    can = (torch.backends.cpu.get_cpu_capability() == "AVX512" and shutil.which("g++") is not None
           and os.environ.get("TALARIA_CPU_KERNELS") != "0")
    assert (cpu_kernels.library() is not None) == can, cpu_kernels._missing


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no AVX-512 or no compiler: the kernels cannot run here")
class TestSmallRows:
    @pytest.mark.parametrize("k", [5, 16, 17, 31, 576, 1537])  # below one vector, whole vectors, masked tails
    @pytest.mark.parametrize("out", [1, 3, 257, 960])  # odd: the last weight-row pair is a single row
    def test_every_row_count_is_the_exact_product_within_float32_rounding(self, k, out):
        for rows in range(1, cpu_kernels.MAX_ROWS + 1):
            x, w, b = operands(rows, out, k, seed=rows)
            for bias in (None, b):
                exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
                for prefetch in (0, cpu_kernels.PREFETCH_ROWS):
                    y = cpu_kernels.small_rows(x, w, bias, prefetch=prefetch)
                    assert y.shape == (rows, out) and y.dtype == torch.float32
                    err = (y.double() - exact).abs().max().item()
                    assert err <= rounding(x, w, bias), (rows, out, k, prefetch, err)

    def test_the_same_bits_on_any_thread_count_and_inputs_read_as_they_lie(self):
        """Threads split the weight's rows, never a dot product: each output is summed in one order."""
        x, w, b = operands(8, 3072, 576)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = cpu_kernels.small_rows(x, w, b)
            torch.set_num_threads(2)
            two = cpu_kernels.small_rows(x, w, b)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, two)
        strided = torch.cat([x, x], dim=1)[:, :576]  # a column slice, as MLA multiplies its cache rows
        assert torch.equal(cpu_kernels.small_rows(strided, w, b), cpu_kernels.small_rows(x, w, b))

    def test_its_result_is_float32_whatever_the_default_dtype(self):
        x, w, b = operands(3, 40, 32)
        default = torch.get_default_dtype()
        try:
            torch.set_default_dtype(torch.float64)
            y = cpu_kernels.small_rows(x, w, b)
        finally:
            torch.set_default_dtype(default)
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, F.linear(x, w, b))

    def test_a_forced_kernel_runs_its_domain_and_the_rest_on_f_linear(self):
        d = MatmulDispatch(forced="small_rows")
        x, w, b = operands(9, 64, 96)
        assert torch.equal(d.linear(x[:8], w, b), cpu_kernels.small_rows(x[:8], w, b))
        assert torch.equal(d.linear(x, w, b), F.linear(x, w, b))  # 9 rows: past the kernel
        assert torch.equal(d.linear(x[:8].bfloat16(), w.bfloat16()), F.linear(x[:8].bfloat16(), w.bfloat16()))


def test_outside_its_domain_it_refuses_and_a_wrong_shape_is_an_error():
    x, w, b = operands(9, 64, 96)
    for args in ((x, w), (x[:4].bfloat16(), w.bfloat16()), (x[:4], w.t().contiguous().t()), (x[:4].double(), w)):
        with pytest.raises(NotImplementedError):
            cpu_kernels.small_rows(*args)
    if cpu_kernels.library() is not None:
        with pytest.raises(RuntimeError, match="do not make a product"):
            cpu_kernels.small_rows(x[:4], w[:, :95].contiguous())
        with pytest.raises(RuntimeError, match="do not make a product"):
            cpu_kernels.small_rows(x[:4], w, b[:63])


@pytest.mark.skipif(shutil.which("g++") is None, reason="no compiler: nothing to build with")
def test_builders_starting_together_build_it_once(tmp_path, monkeypatch):
    """Ranks start together: one builds under the lock, the others wait and load its library. Three
    threads here, each opening the lock file itself: flock excludes them as it does processes."""
    calls = tmp_path / "calls"
    cxx = tmp_path / "cxx"
    cxx.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo compile >> {calls};; *) echo link >> {calls};; esac\n'
                   'exec g++ "$@"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    built = []
    threads = [threading.Thread(target=lambda: built.append(cpu_kernels.build(tmp_path / "k"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 3 and len(set(built)) == 1 and built[0].is_file()
    sources = sum(name.endswith(".cpp") for name in cpu_kernels.SOURCES)
    assert calls.read_text().split() == ["compile"] * sources + ["link"]  # one build: each source, one link


def test_a_failed_build_is_remembered_with_the_compilers_message(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(OSError, match="could not build it"):
        cpu_kernels.build(tmp_path)
    (failed,) = tmp_path.glob("*.failed")
    assert "false: exit 1" in failed.read_text()
    monkeypatch.setenv("CXX", "g++")  # a compiler now, but the failure stands until the folder goes
    with pytest.raises(OSError, match="failed before"):
        cpu_kernels.build(tmp_path)
    assert not list(tmp_path.glob("*.so"))


def reference_attention(q, k_cache, v_cache, pages, lengths, scale):
    """softmax(q K^T scale) V per sequence in float64, its context gathered from its pages."""
    B, nh, hd = q.shape
    nkv = k_cache.shape[2]
    out = []
    for b in range(B):
        n = int(lengths[b])
        k = k_cache[pages[b]].reshape(-1, nkv, hd)[:n].double().repeat_interleave(nh // nkv, 1)  # (n, nh, hd)
        v = v_cache[pages[b]].reshape(-1, nkv, hd)[:n].double().repeat_interleave(nh // nkv, 1)
        p = (torch.einsum("hd,thd->ht", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("ht,thd->hd", p, v))
    return torch.stack(out)


def paged_cache(n_pages: int, page_size: int, nkv: int, hd: int, seed: int = 0):
    """K and V of one layer as the engine's views: each page holds every layer's K and V, so a layer's
    K is a (pages, page_size, nkv, hd) view with the page stride of the whole page."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(n_pages, 3, 2, page_size, nkv, hd, generator=g)
    return pool[:, 1, 0], pool[:, 1, 1]


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no AVX-512 or no compiler: the kernels cannot run here")
class TestPagedDecode:
    @pytest.mark.parametrize(("nh", "nkv", "hd"), [(9, 3, 64), (8, 8, 32), (4, 1, 128), (16, 2, 256)])
    def test_each_context_is_attended_in_place_within_float32_rounding(self, nh, nkv, hd):
        """Contexts of 1 token, within a page, on a page's edge and over many pages, in pages
        scattered through the pool, the rest of the table padding that must not be read (NaN)."""
        page_size, lengths = 16, torch.tensor([1, 7, 16, 17, 130, 64])
        k_cache, v_cache = paged_cache(40, page_size, nkv, hd)
        width = -(-int(lengths.max()) // page_size)
        g = torch.Generator().manual_seed(1)
        pages = torch.stack([torch.randperm(39, generator=g)[:width] + 1 for _ in lengths])
        for b, n in enumerate(lengths.tolist()):  # past each context: the null page, poisoned, and NaN rows
            pages[b, -(-n // page_size):] = 0
        k_cache[0], v_cache[0] = float("nan"), float("nan")
        q = torch.randn(len(lengths), nh, hd, generator=g)
        out = cpu_kernels.paged_decode(q, k_cache, v_cache, pages, lengths, hd ** -0.5)
        exact = reference_attention(q, k_cache, v_cache, pages, lengths, hd ** -0.5)
        assert out.shape == q.shape and not out.isnan().any()
        assert (out.double() - exact).abs().max().item() <= 2e-6  # outputs of magnitude ~1: float32's rounding

    def test_the_same_bits_on_any_thread_count(self):
        k_cache, v_cache = paged_cache(20, 16, 3, 64)
        pages, lengths = torch.arange(1, 19).view(2, 9), torch.tensor([130, 99])
        q = torch.randn(2, 9, 64)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = cpu_kernels.paged_decode(q, k_cache, v_cache, pages, lengths, 0.125)
            torch.set_num_threads(2)
            two = cpu_kernels.paged_decode(q, k_cache, v_cache, pages, lengths, 0.125)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, two)

    def test_it_takes_what_it_can_run(self):
        k_cache, v_cache = paged_cache(4, 16, 3, 64)
        q = torch.randn(2, 9, 64)
        assert cpu_kernels.paged_decode_runs(q, k_cache, v_cache)
        assert not cpu_kernels.paged_decode_runs(q.double(), k_cache.double(), v_cache.double())
        assert not cpu_kernels.paged_decode_runs(q[..., :40], k_cache[..., :40], v_cache[..., :40])  # 40 wide
        assert not cpu_kernels.paged_decode_runs(q, k_cache.transpose(2, 3), v_cache.transpose(2, 3))  # strided heads


def test_turned_off_by_the_environment_torch_runs_everything(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_library", None)  # as a process starting with the variable set
    monkeypatch.setattr(cpu_kernels, "_missing", None)
    monkeypatch.setenv("TALARIA_CPU_KERNELS", "0")
    assert cpu_kernels.library() is None and "TALARIA_CPU_KERNELS=0" in cpu_kernels._missing
    x, w, _ = operands(4, 64, 96)
    with pytest.raises(NotImplementedError, match="turned off"):
        cpu_kernels.small_rows(x, w)
    k_cache, v_cache = paged_cache(4, 16, 3, 64)
    assert not cpu_kernels.paged_decode_runs(torch.randn(2, 9, 64), k_cache, v_cache)


def experts_reference(x, gate_up, down, counts):
    """Each expert's silu(x Wg^T) * (x Wu^T) Wd^T over its assignments, in float64."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        gate, up = (x[start:start + n].double() @ gate_up[e].double().T).chunk(2, dim=-1)
        out.append((F.silu(gate) * up) @ down[e].double().T)
        start += n
    return torch.cat(out)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no AVX-512 or no compiler: the kernels cannot run here")
@pytest.mark.parametrize(("hidden", "inter"), [(96, 40), (512, 256), (64, 7)])  # expert widths with and without a tail
def test_the_experts_of_a_layer_in_one_call_within_float32_rounding(hidden, inter):
    """Experts with no assignment, one, eight, and eleven (past eight rows: two passes), gates of both
    signs far out (silu's two branches)."""
    g = torch.Generator().manual_seed(hidden)
    counts = torch.tensor([3, 0, 8, 1, 11, 2])
    gate_up = torch.randn(6, 2 * inter, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(6, hidden, inter, generator=g) / inter ** 0.5
    x = torch.randn(int(counts.sum()), hidden, generator=g) * 4
    y = cpu_kernels.moe_experts(x, gate_up, down, counts)
    exact = experts_reference(x, gate_up, down, counts)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert (y.double() - exact).abs().max().item() <= 1e-6 * max(1.0, exact.abs().max().item())
    with pytest.raises(ValueError, match="do not make the experts"):
        cpu_kernels.moe_experts(x[:-1], gate_up, down, counts)


def test_the_expert_kernel_takes_what_it_can_run():
    gate_up, down, x = torch.randn(4, 32, 16), torch.randn(4, 16, 16), torch.randn(5, 16)
    can, few, many = cpu_kernels.library() is not None, torch.tensor([8, 0, 2, 1]), torch.tensor([9, 0, 2, 1])
    assert cpu_kernels.moe_experts_runs(x, gate_up, down, few) == can
    assert not cpu_kernels.moe_experts_runs(x, gate_up, down, many)  # a prompt's assignments: the GEMMs
    assert not cpu_kernels.moe_experts_runs(x.double(), gate_up.double(), down.double(), few)
    assert not cpu_kernels.moe_experts_runs(x, gate_up.transpose(1, 2), down, few)


def routed_reference(logits, h, gate_up, down, k, norm):
    """Each token's k best experts by logit (the earlier first among equals), weighted by their softmax
    probabilities (renormalised over the k when `norm`), in float64."""
    probs = logits.double().softmax(-1)
    chosen = logits.argsort(dim=-1, descending=True, stable=True)[:, :k]
    weights = probs.gather(1, chosen)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros(h.shape, dtype=torch.float64)
    for t in range(h.shape[0]):
        for w, e in zip(weights[t], chosen[t].tolist(), strict=True):
            gate, up = (gate_up[e].double() @ h[t].double()).chunk(2)
            out[t] += w * (down[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no AVX-512 or no compiler: the kernels cannot run here")
@pytest.mark.parametrize(("tokens", "k", "norm", "hidden", "inter"),
                         [(1, 1, False, 96, 40), (8, 2, True, 64, 7), (5, 3, False, 40, 24), (8, 6, True, 512, 256)])
def test_a_moe_layer_routed_in_one_call_within_float32_rounding(tokens, k, norm, hidden, inter):
    """Routing and experts in one call: top-1 to every expert (k = E = 6), widths with and without a
    tail, gates of both signs far out. Token 0's logits tie for every expert (the earlier expert
    first); at eight tokens all pick expert 4 first (one expert's eight rows)."""
    g = torch.Generator().manual_seed(hidden + tokens)
    gate_up = torch.randn(6, 2 * inter, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(6, hidden, inter, generator=g) / inter ** 0.5
    h = torch.randn(tokens, hidden, generator=g) * 4
    logits = torch.randn(tokens, 6, generator=g)
    logits[0] = 0.5
    if tokens == 8:
        logits[:, 4] = 9.0
    out = cpu_kernels.moe_routed(logits, h, gate_up, down, k, norm)
    exact = routed_reference(logits, h, gate_up, down, k, norm)
    assert out.dtype == torch.float32 and out.shape == h.shape
    assert (out.double() - exact).abs().max().item() <= 1e-6 * max(1.0, exact.abs().max().item())


def test_the_routed_kernel_takes_a_decode_step_and_refuses_the_rest():
    gate_up, down, h = torch.randn(4, 32, 16), torch.randn(4, 16, 16), torch.randn(8, 16)
    can = cpu_kernels.library() is not None
    assert cpu_kernels.moe_routed_runs(h, gate_up, down) == can
    assert not cpu_kernels.moe_routed_runs(torch.randn(9, 16), gate_up, down)  # a prompt: the GEMMs
    assert not cpu_kernels.moe_routed_runs(h.double(), gate_up.double(), down.double())
    assert not cpu_kernels.moe_routed_runs(h, gate_up.transpose(1, 2), down)
    if can:
        with pytest.raises(ValueError, match="not a MoE layer"):
            cpu_kernels.moe_routed(torch.randn(8, 5), h, gate_up, down, 2, True)  # 5 logits for 4 experts
        with pytest.raises(ValueError, match="9 tokens, not 1 to 8"):
            cpu_kernels.moe_routed(torch.randn(9, 4), torch.randn(9, 16), gate_up, down, 2, True)
