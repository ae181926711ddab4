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
the chunked form (chunks of CHUNK tokens: within a chunk the delta rule's updates are one unit lower
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
CHUNK = 32  # tokens per chunk of the chunked delta rule
# heads and chunks whose state-free parts `chunked` computes together; these and CHUNK were the
# fastest of the sizes tried on one CPU core at Qwen3.5's dims (bench/README.md, the DeltaNet row)
BLOCK_HEADS, BLOCK_CHUNKS = 16, 4


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

    Within a chunk the delta rule's updates are one unit lower triangular system that needs no
    state (the WY/UT form, as flash-linear-attention's chunk_gated_delta_rule), so only three
    products per chunk, (C x d) by (d x d), wait for the previous chunk's state. The work goes in
    blocks of BLOCK_HEADS heads by BLOCK_CHUNKS chunks (`_Block`): buffers of a few MB that stay
    in cache, where materialising every chunk's at once took ten of 268 MB for an 8,192-token
    prompt at Qwen3.5's dims and streamed them through memory."""
    H, n, dk = k.shape
    dv = v.shape[-1]
    if n == 0:
        return torch.empty_like(v)
    pad = -n % CHUNK
    if pad:  # zero tokens (beta 0, decay 1) change neither the outputs nor the state
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    N = (n + pad) // CHUNK
    q, k, v = q.reshape(H, N, CHUNK, dk), k.reshape(H, N, CHUNK, dk), v.reshape(H, N, CHUNK, dv)
    log_decay = g.reshape(H, N, CHUNK).cumsum(dim=-1)  # (H, N, C): from each chunk's start, its token's own included
    beta = beta.reshape(H, N, CHUNK)
    heads, chunks = min(BLOCK_HEADS, H), min(BLOCK_CHUNKS, N)
    block = _Block(heads * chunks, dk, dv, v)
    out = torch.empty(H, N, CHUNK, dv, dtype=v.dtype, device=v.device)
    for h in range(0, H, heads):
        hs = slice(h, h + heads)
        s = state[hs]  # (heads, dk, dv), a view: updated in place
        for c in range(0, N, chunks):
            cs = slice(c, c + chunks)
            o = block.run(q[hs, cs], k[hs, cs], v[hs, cs], log_decay[hs, cs], beta[hs, cs], s)
            out[hs, cs] = o.transpose(0, 1)
    return out.view(H, N * CHUNK, dv)[:, :n]


class _Block:
    """Buffers for up to `size` (head, chunk) pairs of `chunked`, reused block after block.

    A block's rows are chunk-major (row j * heads + h: chunk j of head h), so the rows that wait
    for the same state are contiguous."""

    def __init__(self, size: int, dk: int, dv: int, like: torch.Tensor):
        C = CHUNK

        def buf(*shape):
            return torch.empty(size, *shape, dtype=like.dtype, device=like.device)

        self.k, self.q, self.v = buf(C, dk), buf(C, dk), buf(C, dv)  # the block's inputs, gathered
        self.log_decay, self.beta = buf(C), buf(C)
        self.decay = buf(C, C)  # exp(log decay_i - log decay_j), i >= j; zero above
        self.system = buf(C, C)  # the strictly lower part of the chunk's triangular system
        self.reads = buf(C, C)  # q_i k_j decay_ij, i >= j: the causal reads within the chunk
        self.inverse, self.inverse_w = buf(C, C), buf(C, C)
        self.w, self.u = buf(C, dk), buf(C, dv)
        self.k_rest = buf(C, dk)  # k times the decay from its token to the chunk's end
        self.v_new = buf(C, dv)  # u - w S: what the state does not predict
        self.q_state = buf(C, dv)  # q exp(log decay) S: what the chunk reads from the state
        self.o = buf(C, dv)
        self.eye = torch.eye(C, dtype=like.dtype, device=like.device).expand(size, C, C)

    def run(self, q, k, v, log_decay, beta, s: torch.Tensor) -> torch.Tensor:
        """q, k (heads, chunks, C, dk), v (heads, chunks, C, dv), log_decay, beta (heads, chunks, C)
        -> o (chunks, heads, C, dv), a view of a buffer; s (heads, dk, dv) carried through the
        chunks in place."""
        heads, chunks, C = k.shape[:3]
        rows = heads * chunks
        kc, qc, vc, ld, b, decay, system, reads, inverse, inverse_w, w, u, k_rest, v_new, q_state, o, eye = (
            x[:rows] for x in (self.k, self.q, self.v, self.log_decay, self.beta, self.decay, self.system,
                               self.reads, self.inverse, self.inverse_w, self.w, self.u, self.k_rest,
                               self.v_new, self.q_state, self.o, self.eye))
        for dst, src in ((kc, k), (qc, q), (vc, v), (ld, log_decay), (b, beta)):  # gathered chunk-major
            dst.view(chunks, heads, *src.shape[2:]).copy_(src.transpose(0, 1))
        # the state-free parts, every chunk of the block at once
        torch.sub(ld[:, :, None], ld[:, None, :], out=decay)
        decay.exp_().tril_()  # above the diagonal exp may overflow: tril_ replaces it, nothing multiplies it
        torch.bmm(kc, kc.transpose(-1, -2), out=system).mul_(decay).mul_(b[:, :, None])
        torch.bmm(qc, kc.transpose(-1, -2), out=reads).mul_(decay)
        # (I + tril(beta_i k_i k_j decay_ij, -1))^-1: the diagonal and above are implied, not read
        torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True, out=inverse)
        gamma = ld.exp()  # (rows, C): decay from the chunk's start
        torch.mul(inverse, (b * gamma)[:, None, :], out=inverse_w)  # beta and decay on the columns,
        inverse.mul_(b[:, None, :])  # not on (C x d) rows
        torch.bmm(inverse_w, kc, out=w)  # w = inverse (beta gamma k)
        torch.bmm(inverse, vc, out=u)  # u = inverse (beta v)
        torch.mul(kc, (ld[:, -1:] - ld).exp_()[:, :, None], out=k_rest)
        qc.mul_(gamma[:, :, None])
        last = gamma[:, -1, None, None]  # (rows, 1, 1): decay over the whole chunk
        # the chunks one after another through the state, each a batch of the block's heads
        for j in range(chunks):
            r = slice(j * heads, (j + 1) * heads)
            torch.baddbmm(u[r], w[r], s, alpha=-1, out=v_new[r])
            torch.bmm(qc[r], s, out=q_state[r])
            s.mul_(last[r])
            s.baddbmm_(k_rest[r].transpose(-1, -2), v_new[r])
        torch.baddbmm(q_state, reads, v_new, out=o)  # the state's reads plus the causal reads within the chunk
        return o.view(chunks, heads, C, -1)


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
