"""Gated DeltaNet layers (Qwen3-Next, Qwen3.5-MoE) on one TP shard: shapes, loading, forward.

A DeltaNet layer mixes tokens through a fixed-size recurrent state instead of attention. Per token:
q, k, v from one projection through a depthwise causal convolution (width K) and SiLU; q and k
L2-normalised, q scaled by 1/sqrt(d_k); a decay g = -exp(A_log) * softplus(a + dt_bias) and a
step size beta = sigmoid(b). Each value head h keeps a matrix S (d_k x d_v) updated by the gated
delta rule

    S <- exp(g) S;   S <- S + k (beta (v - k^T S))^T;   o = q^T S

and the output is RMSNorm(o) * SiLU(z) through `out_proj`. Per sequence the layer keeps the
convolution's last K - 1 inputs (`conv`) and S (`ssm`): state slots of the cache layout
(talaria/contracts/kv_layout.py), read and written in place here. As transformers does (the
reference), the recurrence runs in float32 whatever the model dtype, and so do the norms.

Decode steps run the recurrence, one token per sequence, batched over sequences. Prompt chunks run
the chunked form (chunks of 64 tokens: within a chunk the delta rule's updates are one unit lower
triangular solve, the WY/UT form of the DeltaNet paper; across chunks the state carries), which
equals the recurrence to float32 rounding and does the work in matmuls.

TP: query/key heads and their value heads split across ranks (a key head serves a contiguous group
of value heads), and with them the convolution's channels and the state; `out_proj` is row-parallel
(the caller all-reduces). Two checkpoint layouts: Qwen3.5's `in_proj_qkv` / `in_proj_z` /
`in_proj_b` / `in_proj_a`, and Qwen3-Next's `in_proj_qkvz` / `in_proj_ba`, grouped by key head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from talaria.executor.checkpoint import ShardReader
from talaria.executor.matmul import linear
from talaria.executor.parallel import Shard

Shape = tuple[int, ...]
CHUNK = 64  # tokens per chunk of the chunked delta rule


@dataclass(frozen=True, slots=True)
class Segment:
    """One sequence's rows in a step, for the layers that keep per-sequence state."""

    row: int  # its first row in the flattened step
    n: int  # its tokens in this step
    slot: int  # its live state slot
    resumed: bool  # it has state from earlier tokens (else the state slot holds zeros)


def segments(chunks) -> list[Segment]:
    """The plan's chunks as state segments, in row order."""
    out, row = [], 0
    for c in chunks:
        if c.state_slot < 0:  # -1 would index the last slot: another sequence's state, silently
            raise ValueError(f"sequence {c.seq_id} has no state slot in a model with per-sequence state")
        out.append(Segment(row, len(c.token_ids), c.state_slot, c.start_pos > 0))
        row += len(c.token_ids)
    return out


def deltanet_shapes(shard: Shard) -> list[Shape]:
    """Arena tensors of one DeltaNet layer on this shard, in `load_deltanet` order."""
    a, h = shard.arch, shard.arch.hidden_size
    kh, vh, vd = shard.linear_key_heads, shard.linear_value_heads, a.linear_value_head_dim
    conv = 2 * kh * a.linear_key_head_dim + vh * vd
    return [(conv, h), (vh * vd, h), (vh, h), (vh, h), (conv, 1, a.linear_conv_kernel_dim), (vh,), (vh,), (vd,),
            (h, vh * vd)]


def load_deltanet(ckpt: ShardReader, prefix: str, shard: Shard, alloc: Callable[[Shape, str], torch.Tensor]) -> dict:
    """One DeltaNet layer's weights into arena views from `alloc(shape, what)`, in `deltanet_shapes`
    order; `prefix` is "...layers.{i}.linear_attn.". Returns LayerWeights' DeltaNet fields by name."""
    a = shard.arch
    kd, vd = a.linear_key_head_dim, a.linear_value_head_dim
    kh, vh = shard.linear_key_heads, shard.linear_value_heads
    k0, v0 = shard.rank * kh, shard.rank * vh
    key, r = a.linear_key_dim, a.linear_num_value_heads // a.linear_num_key_heads  # value heads per key head
    qkv_shape, z_shape, b_shape, a_shape, conv_shape, *_ = deltanet_shapes(shard)
    qkv, z, b, a_ = (alloc(s, prefix + n) for s, n in ((qkv_shape, "qkv"), (z_shape, "z"), (b_shape, "b"),
                                                         (a_shape, "a")))
    q_rows, k_rows, v_rows = slice(0, kh * kd), slice(kh * kd, 2 * kh * kd), slice(2 * kh * kd, None)
    if prefix + "in_proj_qkvz.weight" in ckpt:  # Qwen3-Next: rows grouped by key head [q k v z], [b a]
        group = 2 * kd + 2 * r * vd
        for j in range(kh):
            at = (k0 + j) * group
            ckpt.read_into(qkv[q_rows][j * kd:(j + 1) * kd], prefix + "in_proj_qkvz.weight", 0, at, at + kd)
            ckpt.read_into(qkv[k_rows][j * kd:(j + 1) * kd], prefix + "in_proj_qkvz.weight", 0, at + kd, at + 2 * kd)
            at += 2 * kd
            ckpt.read_into(qkv[v_rows][j * r * vd:(j + 1) * r * vd], prefix + "in_proj_qkvz.weight", 0, at, at + r * vd)
            ckpt.read_into(z[j * r * vd:(j + 1) * r * vd], prefix + "in_proj_qkvz.weight", 0, at + r * vd,
                           at + 2 * r * vd)
            at = (k0 + j) * 2 * r
            ckpt.read_into(b[j * r:(j + 1) * r], prefix + "in_proj_ba.weight", 0, at, at + r)
            ckpt.read_into(a_[j * r:(j + 1) * r], prefix + "in_proj_ba.weight", 0, at + r, at + 2 * r)
    else:  # Qwen3.5: in_proj_qkv rows [q (every key head) | k | v], one row per value head in b and a
        name = prefix + "in_proj_qkv.weight"
        ckpt.read_into(qkv[q_rows], name, 0, k0 * kd, (k0 + kh) * kd)
        ckpt.read_into(qkv[k_rows], name, 0, key + k0 * kd, key + (k0 + kh) * kd)
        ckpt.read_into(qkv[v_rows], name, 0, 2 * key + v0 * vd, 2 * key + (v0 + vh) * vd)
        ckpt.read_into(z, prefix + "in_proj_z.weight", 0, v0 * vd, (v0 + vh) * vd)
        ckpt.read_into(b, prefix + "in_proj_b.weight", 0, v0, v0 + vh)
        ckpt.read_into(a_, prefix + "in_proj_a.weight", 0, v0, v0 + vh)
    conv = alloc(conv_shape, prefix + "conv1d")  # channels [q | k | v], as the projection's rows
    ckpt.read_into(conv[q_rows], prefix + "conv1d.weight", 0, k0 * kd, (k0 + kh) * kd)
    ckpt.read_into(conv[k_rows], prefix + "conv1d.weight", 0, key + k0 * kd, key + (k0 + kh) * kd)
    ckpt.read_into(conv[v_rows], prefix + "conv1d.weight", 0, 2 * key + v0 * vd, 2 * key + (v0 + vh) * vd)
    out = {"la_qkv": qkv, "la_z": z, "la_b": b, "la_a": a_, "la_conv": conv}
    for field, name, shape in (("la_dt_bias", "dt_bias", (vh,)), ("la_A_log", "A_log", (vh,))):
        out[field] = alloc(shape, prefix + name)
        ckpt.read_into(out[field], prefix + name, 0, v0, v0 + vh)
    out["la_norm"] = alloc((vd,), prefix + "norm")
    ckpt.read_into(out["la_norm"], prefix + "norm.weight")
    out["la_out"] = alloc((a.hidden_size, vh * vd), prefix + "out_proj")
    ckpt.read_into(out["la_out"], prefix + "out_proj.weight", 1, v0 * vd, (v0 + vh) * vd)
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def recurrent_step(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token of B sequences: q, k (B, H, dk), v (B, H, dv), g, beta (B, H), all float32 and q, k
    normalised and scaled; `state` (B, H, dk, dv) is updated in place. Returns o (B, H, dv)."""
    state.mul_(g.exp()[..., None, None])
    kv_mem = (state * k[..., None]).sum(dim=-2)  # (B, H, dv): what S predicts for k
    delta = (v - kv_mem) * beta[..., None]
    state.add_(k[..., None] * delta[..., None, :])
    return (state * q[..., None]).sum(dim=-2)


def chunked(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """n tokens of one sequence: q, k (H, n, dk), v (H, n, dv), g, beta (H, n), float32, q and k
    normalised and scaled; `state` (H, dk, dv) is updated in place. Returns o (H, n, dv).

    Chunk by chunk, everything of a chunk computed in the loop: (H, C, C) and (H, C, d) tensors that
    stay in cache, where materialising every chunk's at once took ten buffers of 268 MB for an
    8,192-token prompt at Qwen3.5's dims."""
    n = k.shape[1]
    pad = -n % CHUNK
    if pad:  # zero tokens (beta 0, decay 1) change neither the outputs nor the state
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=k.device).triu(1)
    eye = torch.eye(CHUNK, dtype=k.dtype, device=k.device).expand(k.shape[0], CHUNK, CHUNK)
    out = torch.empty_like(v)
    s = state
    for at in range(0, n + pad, CHUNK):
        c = slice(at, at + CHUNK)
        qc, kc, bc = q[:, c], k[:, c], beta[:, c, None]
        k_beta, v_beta = kc * bc, v[:, c] * bc
        gc = g[:, c].cumsum(dim=-1)  # (H, C): log decay from the chunk's start
        decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(upper, float("-inf")).exp()  # (H, C, C): i >= j
        # the updates inside the chunk as one unit lower triangular system (I + tril(beta_i k_i k_j decay, -1))
        # one solve for the system's inverse (C right-hand sides), then two matmuls, rather than two solves
        # of d each: 1.13x the chunked form's speed at 2,048 tokens (alternating runs of both forms, median)
        system = (k_beta @ kc.transpose(-1, -2)) * decay
        inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)  # (H, C, C)
        u = inverse @ v_beta  # (H, C, dv)
        w = inverse @ (k_beta * gc.exp()[..., None])
        v_new = u - w @ s  # the corrections the state does not predict
        attn = (qc @ kc.transpose(-1, -2)) * decay  # within-chunk reads, causal
        out[:, c] = (qc * gc.exp()[..., None]) @ s + attn @ v_new
        s = s * gc[..., -1:, None].exp() + (kc * (gc[..., -1:] - gc).exp()[..., None]).transpose(-1, -2) @ v_new
    state.copy_(s)
    return out[:, :n]


def _conv(x: torch.Tensor, past: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution and SiLU of x (C, n) after `past` (C, K-1) inputs -> (C, n)."""
    full = torch.cat((past, x), dim=-1)  # (C, K - 1 + n)
    return F.silu(F.conv1d(full[None], weight, groups=weight.shape[0])[0])


def gated_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head's output (in float32), times SiLU of the gate z (float32), in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype) * F.silu(z.float())).to(x.dtype)


def deltanet_mixer(h: torch.Tensor, lw, shard: Shard, segs: list[Segment], conv_state: torch.Tensor,
                   ssm_state: torch.Tensor) -> torch.Tensor:
    """h: (T, H) normed hidden states -> (T, H), this rank's partial sum (all-reduce to finish).

    conv_state (slots, C, K-1) and ssm_state (slots, Hv, dk, dv) are the layer's state slots,
    updated in place for every segment."""
    a = shard.arch
    kh, vh, kd, vd = shard.linear_key_heads, shard.linear_value_heads, a.linear_key_head_dim, a.linear_value_head_dim
    T = h.shape[0]
    mixed = linear(h, lw.la_qkv).t()  # (C, T)
    z = linear(h, lw.la_z).view(T, vh, vd)
    beta = linear(h, lw.la_b).sigmoid()  # (T, Hv)
    g = -lw.la_A_log.float().exp() * F.softplus(linear(h, lw.la_a).float() + lw.la_dt_bias)  # (T, Hv)
    past_len = conv_state.shape[-1]
    conv = torch.empty_like(mixed)
    steps = [s for s in segs if s.n == 1 and s.resumed]  # decode: the recurrence, all sequences at once
    rows = torch.tensor([s.row for s in steps], device=h.device)
    slots = torch.tensor([s.slot for s in steps], device=h.device)
    if steps:  # one token each: their past inputs and it, through the convolution at once
        full = torch.cat((conv_state[slots], mixed[:, rows].t()[..., None]), dim=-1)  # (B, C, K)
        conv[:, rows] = F.silu(F.conv1d(full, lw.la_conv, groups=full.shape[1]))[..., 0].t()
        conv_state[slots] = full[..., 1:]
    for s in segs:  # prompt chunks: each sequence's own past inputs, and it keeps its last ones
        if s.n == 1 and s.resumed:
            continue
        x = mixed[:, s.row:s.row + s.n]
        past = conv_state[s.slot]
        conv[:, s.row:s.row + s.n] = _conv(x, past, lw.la_conv)
        conv_state[s.slot] = torch.cat((past, x), dim=-1)[:, -past_len:]
    q, k, v = conv.t().split((kh * kd, kh * kd, vh * vd), dim=-1)
    rep = vh // kh  # value heads per key head
    q = _l2norm(q.reshape(T, kh, kd).float()).repeat_interleave(rep, dim=1)  # (T, Hv, dk)
    k = _l2norm(k.reshape(T, kh, kd).float()).repeat_interleave(rep, dim=1)
    v, beta, g = v.reshape(T, vh, vd).float(), beta.float(), g.float()
    o = torch.empty(T, vh, vd, dtype=torch.float32, device=h.device)
    if steps:
        state = ssm_state[slots]  # (B, Hv, dk, dv), a copy
        # scaled as the reference scales each path (a division here, a product below): the same bits
        o[rows] = recurrent_step(q[rows] / kd ** 0.5, k[rows], v[rows], g[rows], beta[rows], state)
        ssm_state.index_copy_(0, slots, state)
    for s in segs:  # prompt chunks: the chunked form, one sequence at a time
        if s.n == 1 and s.resumed:
            continue
        r = slice(s.row, s.row + s.n)
        o[r] = chunked((q[r] * kd ** -0.5).transpose(0, 1), k[r].transpose(0, 1), v[r].transpose(0, 1), g[r].t(), beta[r].t(),
                       ssm_state[s.slot]).transpose(0, 1)
    out = gated_norm(o.to(h.dtype), z, lw.la_norm, a.rms_norm_eps)  # (T, Hv, dv)
    return linear(out.reshape(T, vh * vd), lw.la_out)
