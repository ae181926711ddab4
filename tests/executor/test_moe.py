"""The MoE MLP on its own: both ways of running the experts (grouped GEMMs, a matmul pair per
expert) equal a token-by-token computation of the same layer, including experts no token chose."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from talaria.contracts.arch import ModelArch
from talaria.executor import cpu_kernels
from talaria.executor.moe import grouped_mm_runs, moe_mlp

H, E, I, S, T = 32, 8, 12, 20, 13  # hidden, experts, expert width, shared expert width, tokens


def arch(k: int, norm: bool) -> ModelArch:
    return ModelArch(vocab_size=300, hidden_size=H, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=8, max_position=64, family="qwen2_moe", num_experts=E, num_experts_per_tok=k,
                     moe_intermediate_size=I, shared_expert_intermediate_size=S, norm_topk_prob=norm)


def layer(dtype: torch.dtype) -> SimpleNamespace:
    g = torch.Generator().manual_seed(3)

    def w(*shape):
        return (torch.randn(shape, generator=g, dtype=torch.float64) / shape[-1] ** 0.5).to(dtype)
    router = w(E, H)
    router[5] -= 100.0  # expert 5 is never chosen: the grouped GEMM gets an empty group
    return SimpleNamespace(router=router, router_bias=None, experts_gate_up=w(E, 2 * I, H), experts_down=w(E, H, I),
                           shared_gate_up=w(2 * S, H), shared_down=w(H, S), shared_gate=w(1, H))


def token_by_token(h: torch.Tensor, lw, a: ModelArch) -> torch.Tensor:
    """The layer written the plain way: every token, each of its top-k experts, the shared expert."""
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        probs = (h[t] @ lw.router.T).softmax(-1, dtype=torch.float32)
        top, ids = probs.topk(a.num_experts_per_tok)
        if a.norm_topk_prob:
            top = top / top.sum()
        for p, e in zip(top.to(h.dtype), ids.tolist()):
            gate, up = (lw.experts_gate_up[e] @ h[t]).chunk(2)
            out[t] += p * (lw.experts_down[e] @ (F.silu(gate) * up))
        gate, up = (lw.shared_gate_up @ h[t]).chunk(2)
        out[t] += torch.sigmoid(lw.shared_gate @ h[t]) * (lw.shared_down @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("k,norm", [(2, True), (3, False)])
def test_both_expert_paths_equal_the_token_by_token_layer(k, norm):
    a = arch(k, norm)
    h = torch.randn(T, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lw64 = layer(torch.float64)
    assert not grouped_mm_runs(torch.float64, h.device)  # float64 takes the per-expert loop
    torch.testing.assert_close(moe_mlp(h, lw64, a, grouped=False), token_by_token(h, lw64, a), rtol=1e-12, atol=1e-12)
    assert grouped_mm_runs(torch.float32, h.device)
    lw32, h32 = layer(torch.float32), h.float()
    want = token_by_token(h32, lw32, a)
    torch.testing.assert_close(moe_mlp(h32, lw32, a, grouped=True), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe_mlp(h32, lw32, a, grouped=False), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no AVX-512 or no compiler: the kernels cannot run here")
@pytest.mark.parametrize(("tokens", "k", "norm", "kernel"), [(1, 2, True, "moe_routed"), (8, 3, False, "moe_routed"),
                                                             (10, 2, True, "moe_experts")])
def test_a_decode_step_runs_as_one_cpu_kernel_call(monkeypatch, tokens, k, norm, kernel):
    """float32 on the CPU: up to eight tokens (a decode step), the whole routed layer is one call of
    cpu_kernels.moe_routed, routing included; more tokens but no expert with more than eight, the
    experts are one call of cpu_kernels.moe_experts. Either equals the token-by-token layer within
    float32 rounding."""
    a, lw = arch(k, norm), layer(torch.float32)
    h = torch.randn(tokens, H, generator=torch.Generator().manual_seed(2))
    calls = {name: [] for name in ("moe_routed", "moe_experts")}
    for name, fn in [(name, getattr(cpu_kernels, name)) for name in calls]:
        monkeypatch.setattr(cpu_kernels, name, lambda *args, name=name, fn=fn: calls[name].append(args) or fn(*args))
    out = moe_mlp(h, lw, a, grouped=False)
    assert {name: len(c) for name, c in calls.items()} == {n: int(n == kernel) for n in calls}
    torch.testing.assert_close(out, token_by_token(h, lw, a), rtol=1e-5, atol=1e-5)
