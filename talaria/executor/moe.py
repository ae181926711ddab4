"""The Mixture-of-Experts MLP (Qwen2-/Qwen3-MoE, the hybrids, DeepSeek-V3, GLM-5) on one TP shard:
shapes, loading, forward.

Tensor-parallel inside each expert (docs/moe.md): a rank holds every expert's slice of the expert
width, the shared expert's slice and the whole router. The hidden state is the same on every rank,
so every rank routes every token alike; each computes its partial sum of the experts' outputs,
and the caller's one all-reduce completes the layer, as for a dense MLP.

Experts run batched by expert: the (token, expert) assignments are sorted by expert, and each
expert that received tokens runs one gate/up and one down matmul over all of them: one grouped
GEMM per projection (`torch.nn.functional.grouped_mm`) on CUDA, one matmul pair per expert with
tokens elsewhere (see `use_grouped_mm`).

Checkpoints come in two layouts, both read here: one tensor per expert and projection
(`mlp.experts.{e}.gate_proj.weight`, what transformers' save_pretrained writes by default) and
transformers 5's fused tensors (`mlp.experts.gate_up_proj` (E, 2I, H) and `mlp.experts.down_proj`
(E, H, I), what it writes with `save_original_format=False`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from talaria.contracts.arch import ModelArch
from talaria.executor import cpu_kernels
from talaria.executor.checkpoint import CheckpointError
from talaria.executor.matmul import linear
from talaria.executor.parallel import Shard
from talaria.executor.quant import QStack, WeightReader, dense

Shape = tuple[int, ...]


def moe_shapes(shard: Shard) -> list[Shape]:
    """Arena tensors of one MoE layer's MLP on this shard (see `load_moe`)."""
    a, h, im, ish = shard.arch, shard.arch.hidden_size, shard.moe_intermediate, shard.shared_intermediate
    shapes: list[Shape] = [(a.num_experts, h), (a.num_experts, 2 * im, h), (a.num_experts, h, im)]
    shapes += [(a.num_experts,)] if a.router_scoring == "sigmoid" else []
    if a.shared_expert_intermediate_size:
        shapes += [(2 * ish, h), (h, ish)] + [(1, h)] * a.shared_expert_gated
    return shapes


def load_moe(reader: WeightReader, prefix: str, shard: Shard) -> dict:
    """One MoE layer's MLP into arena views from the reader's `alloc(shape, what)`, in `moe_shapes`
    order (quantized experts stay packed: `QStack` of gate and up, `QWeight` down).

    Each view is filled with this rank's slice of its checkpoint tensors (queued on the reader's
    checkpoint: nothing reads a whole expert, nor the whole fused tensor); `prefix` is
    "model.layers.{i}.mlp.". Returns LayerWeights' MoE fields by name.
    """
    ckpt, alloc = reader.ckpt, reader.alloc
    a, h, im = shard.arch, shard.arch.hidden_size, shard.moe_intermediate
    i0, i1 = shard.width_range(im)
    full = a.moe_intermediate_size
    e = prefix + "experts."
    router = alloc((a.num_experts, h), prefix + "gate")
    ckpt.read_into(router, prefix + "gate.weight")
    n = a.num_experts
    if reader.quantized(f"{e}0.gate_proj.weight"):  # one tensor per expert, each kept packed
        gate_up = QStack([reader.experts(lambda x: f"{e}{x}.gate_proj.weight", n, 0, i0, i1, e + "gate"),
                          reader.experts(lambda x: f"{e}{x}.up_proj.weight", n, 0, i0, i1, e + "up")])
        down = reader.experts(lambda x: f"{e}{x}.down_proj.weight", n, 1, i0, i1, e + "down")
    else:
        gate_up = alloc((n, 2 * im, h), e + "gate_up")  # per expert: gate rows, then up rows
        down = alloc((n, h, im), e + "down")
        if reader.fmt is not None and any(e + "gate_up_proj" + x in ckpt for x in ("_scale_inv", "_weight_scale")):
            raise CheckpointError(f"{e}gate_up_proj: quantized fused experts are not supported yet; save the "
                                  "checkpoint with one tensor per expert (docs/models.md)")
        if e + "gate_up_proj" in ckpt:  # fused: (E, 2I, H) and (E, H, I)
            ckpt.read_into(gate_up[:, :im], e + "gate_up_proj", 1, i0, i1)
            ckpt.read_into(gate_up[:, im:], e + "gate_up_proj", 1, full + i0, full + i1)
            ckpt.read_into(down, e + "down_proj", 2, i0, i1)
        else:
            for x in range(n):
                ckpt.read_into(gate_up[x, :im], f"{e}{x}.gate_proj.weight", 0, i0, i1)
                ckpt.read_into(gate_up[x, im:], f"{e}{x}.up_proj.weight", 0, i0, i1)
                ckpt.read_into(down[x], f"{e}{x}.down_proj.weight", 1, i0, i1)
    out = {"router": router, "experts_gate_up": gate_up, "experts_down": down}
    if a.router_scoring == "sigmoid":  # DeepSeek-V3's selection bias
        out["router_bias"] = alloc((a.num_experts,), prefix + "gate.e_score_correction_bias")
        ckpt.read_into(out["router_bias"], prefix + "gate.e_score_correction_bias")
    if a.shared_expert_intermediate_size:
        ish = shard.shared_intermediate
        s0, s1 = shard.width_range(ish)
        s = prefix + ("shared_expert." if a.shared_expert_gated else "shared_experts.")
        out["shared_gate_up"] = reader.stacked([(s + "gate_proj.weight", s0, s1), (s + "up_proj.weight", s0, s1)],
                                               (h,), s + "gate_up")
        out["shared_down"] = reader.linear(s + "down_proj.weight", 1, s0, s1, shape=(h, ish), what=s + "down")
        if a.shared_expert_gated:
            out["shared_gate"] = alloc((1, h), prefix + "shared_expert_gate")
            ckpt.read_into(out["shared_gate"], prefix + "shared_expert_gate.weight")
    return out


def route(h: torch.Tensor, router: torch.Tensor, arch: ModelArch,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each token and their weights: (T, k) ids, (T, k) weights in h's dtype.

    The softmax runs in float32 whatever the weights' dtype, as transformers and vLLM do: routing
    decisions then match the checkpoint's reference implementation bit for bit. Sigmoid routing
    (DeepSeek-V3, GLM-5) is computed wholly in float32, as its reference does.
    """
    if arch.router_scoring == "sigmoid":
        return _sigmoid_route(h, router, arch, bias)
    probs = F.linear(h, router).softmax(dim=-1, dtype=torch.float32)  # (T, E)
    weights, experts = probs.topk(arch.num_experts_per_tok, dim=-1)  # (T, k) each
    if arch.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights.to(h.dtype)


def _sigmoid_route(h: torch.Tensor, router: torch.Tensor, arch: ModelArch,
                   bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing: sigmoid scores; the selection bias added to choose only; the `topk_group`
    groups whose two best biased scores sum highest, then the top-k experts inside them; the chosen raw
    scores renormalised and times `routed_scaling_factor`."""
    scores = F.linear(h.float(), router.float()).sigmoid()  # (T, E)
    choice = scores + bias.float()
    if arch.n_group > 1:
        groups = choice.view(-1, arch.n_group, arch.num_experts // arch.n_group)
        best = groups.topk(2, dim=-1)[0].sum(dim=-1).topk(arch.topk_group, dim=-1, sorted=False)[1]  # (T, topk_group)
        keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)  # (T, n_group)
        choice = choice.masked_fill(~keep.repeat_interleave(arch.num_experts // arch.n_group, dim=1), float("-inf"))
    experts = choice.topk(arch.num_experts_per_tok, dim=-1, sorted=False)[1]  # (T, k)
    weights = scores.gather(1, experts)
    if arch.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, (weights * arch.routed_scaling_factor).to(h.dtype)


def grouped_mm_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch's grouped GEMM runs for `dtype` on `device` (CPU: float32, bfloat16, float16;
    not float64), found by running it once on a toy problem."""
    try:
        a = torch.ones(2, 4, dtype=dtype, device=device)
        b = torch.ones(2, 4, 4, dtype=dtype, device=device)
        F.grouped_mm(a, b.transpose(1, 2), offs=torch.tensor([1, 2], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


def use_grouped_mm(dtype: torch.dtype, device: torch.device) -> bool:
    """Grouped GEMMs on CUDA, where they are one kernel that skips empty groups. Not on CPU: there
    torch runs one matmul per group with the tokens on the left, which bench/engine.py measured
    slower than the per-expert loop with the weight on the left (a decode step gives each expert a
    few tokens, and BLAS splits a matrix-vector product over the weight's rows)."""
    return device.type == "cuda" and grouped_mm_runs(dtype, device)


def moe_mlp(h: torch.Tensor, lw, arch: ModelArch, grouped: bool) -> torch.Tensor:
    """h: (T, H) normed hidden states -> (T, H), this rank's partial sum (all-reduce to finish).

    grouped: one grouped GEMM over all experts per projection (`use_grouped_mm`), else a matmul
    pair per expert that has tokens. On the CPU in float32, a decode step of at most 8 tokens with
    softmax routing runs its routed experts, routing included, as one kernel call
    (`cpu_kernels.moe_routed`).
    """
    if arch.router_scoring != "sigmoid" and cpu_kernels.moe_routed_runs(h, lw.experts_gate_up, lw.experts_down):
        out = cpu_kernels.moe_routed(F.linear(h, lw.router), h, lw.experts_gate_up, lw.experts_down,
                                     arch.num_experts_per_tok, arch.norm_topk_prob)  # a decode step: one call
    else:
        out = _routed_experts(h, lw, arch, grouped)
    if lw.shared_gate_up is not None:  # every token also runs the shared expert(s): Qwen's gated
        gate, up = linear(h, lw.shared_gate_up).chunk(2, dim=-1)  # (T, Is_local) each
        shared = linear(F.silu(gate) * up, lw.shared_down)  # (T, H), partial over ranks
        out += shared if lw.shared_gate is None else torch.sigmoid(linear(h, lw.shared_gate)) * shared  # gate (T, 1)
    return out


def _routed_experts(h: torch.Tensor, lw, arch: ModelArch, grouped: bool) -> torch.Tensor:
    """`moe_mlp`'s routed experts in torch: the assignments sorted by expert, each expert's run, the
    router-weighted sum."""
    T, H = h.shape
    k = arch.num_experts_per_tok
    grouped = grouped and isinstance(lw.experts_down, torch.Tensor)  # packed experts: one at a time, dequantized
    experts, weights = route(h, lw.router, arch, lw.router_bias)  # (T, k)
    flat = experts.flatten()  # (T k,): assignment j is token j // k's (j % k)-th expert
    order = flat.argsort(stable=True)  # assignments grouped by expert
    counts = torch.bincount(flat, minlength=arch.num_experts)  # (E,) assignments per expert
    x = h[order // k]  # (T k, H): each assignment's token, grouped by expert
    if grouped:
        offs = counts.cumsum(0, dtype=torch.int32)  # (E,) end of each expert's rows
        gate, up = F.grouped_mm(x, lw.experts_gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)  # (T k, I_local)
        y = F.grouped_mm(F.silu(gate) * up, lw.experts_down.transpose(1, 2), offs=offs)  # (T k, H)
    elif cpu_kernels.moe_experts_runs(x, lw.experts_gate_up, lw.experts_down, counts):
        y = cpu_kernels.moe_experts(x, lw.experts_gate_up, lw.experts_down, counts)  # a decode step: one call
    else:
        y = torch.empty_like(x)
        packed = not isinstance(lw.experts_down, torch.Tensor)
        start = 0
        for e, n in enumerate(counts.tolist()):  # one matmul pair per expert with tokens, over all of them
            if n and packed:
                # dequantized one expert at a time; the weight on the left, the tokens transposed
                gate, up = (dense(lw.experts_gate_up[e], h.dtype) @ x[start:start + n].t()).chunk(2)  # (I_local, n)
                act = (F.silu(gate) * up).t().contiguous()  # (n, I_local)
                y[start:start + n] = (dense(lw.experts_down[e], h.dtype) @ act.t()).t()  # (n, H)
            elif n:  # each product on the backend measured fastest for its shape and rows (matmul.py)
                gate, up = linear(x[start:start + n], lw.experts_gate_up[e]).chunk(2, dim=-1)  # (n, I_local) each
                y[start:start + n] = linear(F.silu(gate) * up, lw.experts_down[e])  # (n, H)
            start += n
    by_token = torch.empty_like(y)
    by_token[order] = y  # back in assignment order
    return torch.bmm(weights.unsqueeze(1), by_token.view(T, k, H)).squeeze(1)  # (T, H): router-weighted sum
