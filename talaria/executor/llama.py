"""The Llama-family forward pass (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3, Qwen2-/Qwen3-MoE, the hybrid
Qwen3-Next / Qwen3.5-MoE, and DeepSeek-V3 / GLM-5) on one TP shard.

Reads top to bottom like nanoGPT: embed -> N x (token mixer, MLP) -> norm -> LM head. Tokens of all
sequences in a step are flattened into one batch of T rows; only the token mixer looks at
sequences. The mixer is attention, or in a hybrid model's linear layers Gated DeltaNet
(talaria/executor/deltanet.py), which reads and writes each sequence's state slot, or in DeepSeek-V3
and GLM-5 multi-head latent attention (talaria/executor/mla.py). A hybrid model's
attention is gated (o_proj(attention * sigmoid(gate))), rotates only part of each head, and its
norms are zero-centred (weight 1 + w, in float32, as the reference computes them). A layer's MLP is
dense, or routed experts (talaria/executor/moe.py) in an MoE layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from talaria.contracts.arch import ModelArch
from talaria.executor.attention import AttentionMeta, paged_attention
from talaria.executor.decode_layer import DecodeLayers
from talaria.executor.deltanet import Segment, deltanet_mixer
from talaria.executor.kv_cache import KVCache
from talaria.executor.matmul import linear
from talaria.executor.mla import MLA
from talaria.executor.moe import moe_mlp, use_grouped_mm
from talaria.executor.norms import rms_norm
from talaria.executor.parallel import Shard, TPGroup
from talaria.executor.rope import apply_rope, rope_cos_sin, softmax_scale
from talaria.executor.weights import ModelWeights


class LlamaModel:
    def __init__(self, arch: ModelArch, shard: Shard, weights: ModelWeights, group: TPGroup,
                 dtype: torch.dtype, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """rope: where to keep the cos/sin tables (views in the arena's runtime region), if anywhere."""
        self.arch = arch
        self.shard = shard
        self.w = weights
        self.group = group
        self.scale = softmax_scale(arch)
        self.mla = MLA(shard, self.scale) if arch.is_mla else None
        cos, sin = rope_cos_sin(arch, dtype, weights.embed.device)  # (max_pos, hd)
        if rope is not None:
            cos, sin = rope[0].copy_(cos), rope[1].copy_(sin)
        self.cos, self.sin = cos, sin
        v0, v1 = shard.vocab_range
        self.vocab_start, self.vocab_end = v0, v1
        self.grouped = arch.is_moe and use_grouped_mm(dtype, weights.embed.device)
        self.fused = DecodeLayers.of(arch, weights.layers, shard.heads, shard.kv_heads, group.size, self.scale, dtype,
                                     weights.embed.device)  # a decode step's layers in two calls each, on the CPU

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(input_ids, self.w.embed)
        local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        x = F.embedding((input_ids - self.vocab_start) * local, self.w.embed)
        x = x * local.unsqueeze(-1).to(x.dtype)
        return self.group.all_reduce(x)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta,
                kv: KVCache, segments: list[Segment] | None = None) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, H). `segments`: each sequence's rows
        and state slot (talaria/executor/deltanet.py), for a model with DeltaNet layers."""
        arch, sh = self.arch, self.shard
        eps, offset = arch.rms_norm_eps, arch.norm_offset
        x = self.embed(input_ids)  # (T, H)
        cos = self.cos[positions].unsqueeze(1)  # (T, 1, rd)
        sin = self.sin[positions].unsqueeze(1)
        selection = None  # MLA's sparse attention: the tokens the last indexer chose, for "shared" layers
        fused = self.fused if self.fused is not None and self.fused.runs(x, meta, kv) else None
        fused_mlp = fused.mlp(len(input_ids)) if fused else None
        for i, lw in enumerate(self.w.layers):
            if fused and fused.attention[i]:
                fused.attend(x, lw, i, cos, sin, meta, kv)  # x += the block, in one call
            else:
                h = rms_norm(x, lw.input_norm, eps, offset)
                if lw.la_qkv is not None:
                    mixed = deltanet_mixer(h, lw, sh, segments, kv.view("conv", i), kv.view("ssm", i))
                elif self.mla is not None:
                    mixed, selection = self.mla.forward(h, lw, i, cos, sin, meta, kv, selection)
                else:
                    mixed = self.attention(h, lw, i, cos, sin, meta, kv)
                x = x + self.group.all_reduce(mixed)
            if fused and fused_mlp[i]:
                fused.mlp_block(x, lw)
                continue
            h = rms_norm(x, lw.post_norm, eps, offset)
            if lw.router is not None:
                mlp = moe_mlp(h, lw, arch, self.grouped)  # (T, H), partial over ranks
            else:
                gate, up = linear(h, lw.gate_up).chunk(2, dim=-1)  # (T, I_local) each
                mlp = linear(F.silu(gate) * up, lw.down)  # (T, H), partial over ranks
            x = x + self.group.all_reduce(mlp)
        return rms_norm(x, self.w.norm, eps, offset)

    def attention(self, h: torch.Tensor, lw, layer: int, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMeta,
                  kv: KVCache) -> torch.Tensor:
        """Layer `layer`'s paged attention of h (T, H), its K/V written to the pages -> (T, H), this
        rank's partial sum (o_proj is row-parallel)."""
        arch, sh = self.arch, self.shard
        hd, nh, nkv = arch.head_dim, sh.heads, sh.kv_heads
        T = h.shape[0]
        gated = 2 if arch.attn_output_gate else 1
        qkv = linear(h, lw.qkv, lw.qkv_bias)  # (T, (nh gated + 2 nkv) hd)
        q, k, v = qkv.split((nh * hd * gated, nkv * hd, nkv * hd), dim=-1)
        q = q.view(T, nh, hd * gated)  # each head's query, then its output gate
        gate = q[..., hd:].reshape(T, nh * hd) if gated == 2 else None
        q = q[..., :hd]
        k = k.view(T, nkv, hd)
        v = v.view(T, nkv, hd)
        if lw.q_norm is not None:
            q = rms_norm(q, lw.q_norm, arch.rms_norm_eps, arch.norm_offset)
            k = rms_norm(k, lw.k_norm, arch.rms_norm_eps, arch.norm_offset)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k_cache, v_cache = kv.layer(layer)  # (pages, page_size, nkv, hd) each
        k_cache.index_put_((meta.write_pages, meta.write_offsets), k)
        v_cache.index_put_((meta.write_pages, meta.write_offsets), v)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale).reshape(T, nh * hd)  # (T, nh hd)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return linear(o, lw.o_proj)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(S, H) -> (S, vocab) on rank 0 (at least float32); None on other ranks."""
        local = linear(hidden, self.w.lm_head)  # (S, V_local)
        full = self.group.gather_last_dim(local)
        if full is None:
            return None
        full = full[:, : self.arch.vocab_size]
        return full.float() if full.element_size() < 4 else full
