"""The Llama-family forward pass (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3, Qwen2-/Qwen3-MoE) on one TP shard.

Reads top to bottom like nanoGPT: embed -> N x (attention, MLP) -> norm -> LM head. Tokens of all
sequences in a step are flattened into one batch of T rows; only attention looks at sequences.
A layer's MLP is dense, or routed experts (talaria/executor/moe.py) in an MoE layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from talaria.contracts.arch import ModelArch
from talaria.executor.attention import AttentionMeta, paged_attention
from talaria.executor.kv_cache import KVCache
from talaria.executor.moe import moe_mlp, use_grouped_mm
from talaria.executor.parallel import Shard, TPGroup
from talaria.executor.rope import rope_cos_sin
from talaria.executor.weights import ModelWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, hd); cos/sin: (T, 1, hd). HF layout: rotate the two halves of each head."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaModel:
    def __init__(self, arch: ModelArch, shard: Shard, weights: ModelWeights, group: TPGroup,
                 dtype: torch.dtype, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """rope: where to keep the cos/sin tables (views in the arena's runtime region), if anywhere."""
        self.arch = arch
        self.shard = shard
        self.w = weights
        self.group = group
        self.scale = 1.0 / math.sqrt(arch.head_dim)
        cos, sin = rope_cos_sin(arch, dtype, weights.embed.device)  # (max_pos, hd)
        if rope is not None:
            cos, sin = rope[0].copy_(cos), rope[1].copy_(sin)
        self.cos, self.sin = cos, sin
        v0, v1 = shard.vocab_range
        self.vocab_start, self.vocab_end = v0, v1
        self.grouped = arch.is_moe and use_grouped_mm(dtype, weights.embed.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(input_ids, self.w.embed)
        local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        x = F.embedding((input_ids - self.vocab_start) * local, self.w.embed)
        x = x * local.unsqueeze(-1).to(x.dtype)
        return self.group.all_reduce(x)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta,
                kv: KVCache) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, H)."""
        arch, sh = self.arch, self.shard
        hd, nh, nkv = arch.head_dim, sh.heads, sh.kv_heads
        T = input_ids.shape[0]
        cos = self.cos[positions].unsqueeze(1)  # (T, 1, hd)
        sin = self.sin[positions].unsqueeze(1)
        x = self.embed(input_ids)  # (T, H)
        for i, lw in enumerate(self.w.layers):
            h = rms_norm(x, lw.input_norm, arch.rms_norm_eps)
            qkv = F.linear(h, lw.qkv, lw.qkv_bias)  # (T, (nh + 2 nkv) hd)
            q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=-1)
            q = q.view(T, nh, hd)
            k = k.view(T, nkv, hd)
            v = v.view(T, nkv, hd)
            if lw.q_norm is not None:
                q = rms_norm(q, lw.q_norm, arch.rms_norm_eps)
                k = rms_norm(k, lw.k_norm, arch.rms_norm_eps)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            k_cache, v_cache = kv.layer(i)  # (pages, page_size, nkv, hd) each
            k_cache.index_put_((meta.write_pages, meta.write_offsets), k)
            v_cache.index_put_((meta.write_pages, meta.write_offsets), v)
            o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # (T, nh, hd)
            x = x + self.group.all_reduce(F.linear(o.reshape(T, nh * hd), lw.o_proj))
            h = rms_norm(x, lw.post_norm, arch.rms_norm_eps)
            if lw.router is not None:
                mlp = moe_mlp(h, lw, arch, self.grouped)  # (T, H), partial over ranks
            else:
                gate, up = F.linear(h, lw.gate_up).chunk(2, dim=-1)  # (T, I_local) each
                mlp = F.linear(F.silu(gate) * up, lw.down)  # (T, H), partial over ranks
            x = x + self.group.all_reduce(mlp)
        return rms_norm(x, self.w.norm, arch.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(S, H) -> (S, vocab) on rank 0 (at least float32); None on other ranks."""
        local = F.linear(hidden, self.w.lm_head)  # (S, V_local)
        full = self.group.gather_last_dim(local)
        if full is None:
            return None
        full = full[:, : self.arch.vocab_size]
        return full.float() if full.element_size() < 4 else full
