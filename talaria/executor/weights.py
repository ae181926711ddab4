"""Load one rank's shard of a Llama-family checkpoint (HF safetensors names) into the arena.

q/k/v are fused into one column-parallel matrix and gate/up into another, so a layer runs two
matmuls where the checkpoint has five; shapes are per rank. An MoE layer's MLP holds its router
and its experts instead (talaria/executor/moe.py). An MLA layer (DeepSeek-V3, GLM-5) holds its latent
projections instead of q/k/v (talaria/executor/mla.py). A hybrid model's Gated DeltaNet layer holds its
linear-attention weights instead of q/k/v and o_proj (talaria/executor/deltanet.py); its attention
layers' q rows carry each head's output gate after its query (the checkpoint's q_proj order). The rank reads only its slices, straight into
the arena (talaria/executor/checkpoint.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from talaria.executor.arena import Arena, align_up
from talaria.executor.checkpoint import CheckpointError, Progress, ShardReader
from talaria.executor.deltanet import deltanet_shapes, load_deltanet
from talaria.executor.mla import load_mla, mla_shapes
from talaria.executor.moe import load_moe, moe_shapes
from talaria.executor.parallel import Shard
from talaria.executor.quant import QStack, QuantFormat, QWeight, Weight, WeightReader


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # (H,)
    qkv: torch.Tensor | None  # ((heads (x 2 with an output gate) + 2 kv_heads) * hd, H); None in a DeltaNet layer
    qkv_bias: torch.Tensor | None  # ((heads + 2 kv_heads) * hd,)
    q_norm: torch.Tensor | None  # (hd,)
    k_norm: torch.Tensor | None  # (hd,)
    o_proj: torch.Tensor | None  # (H, heads * hd); None in a DeltaNet layer
    post_norm: torch.Tensor  # (H,)
    # a dense layer's MLP (None in an MoE layer)
    gate_up: torch.Tensor | None = None  # (2 * I_local, H)
    down: torch.Tensor | None = None  # (H, I_local)
    # an MoE layer's MLP (None in a dense layer): E experts, top-k routing
    router: torch.Tensor | None = None  # (E, H), replicated
    router_bias: torch.Tensor | None = None  # (E,), replicated: sigmoid routing's selection bias
    experts_gate_up: torch.Tensor | None = None  # (E, 2 * Im_local, H): each expert's gate rows, then up rows
    experts_down: torch.Tensor | None = None  # (E, H, Im_local)
    shared_gate_up: torch.Tensor | None = None  # (2 * Is_local, H): Qwen2-MoE's shared expert
    shared_down: torch.Tensor | None = None  # (H, Is_local)
    shared_gate: torch.Tensor | None = None  # (1, H), replicated: sigmoid gate of the shared expert
    # a Gated DeltaNet layer's token mixer (None elsewhere; deltanet.py), per rank: Hk key heads, Hv value heads
    la_qkv: torch.Tensor | None = None  # (C, H), C = 2 Hk dk + Hv dv: q, k, v channels
    la_z: torch.Tensor | None = None  # (Hv dv, H): the output gate
    la_b: torch.Tensor | None = None  # (Hv, H): beta = sigmoid(b)
    la_a: torch.Tensor | None = None  # (Hv, H): the decay's input
    la_conv: torch.Tensor | None = None  # (C, 1, K): depthwise causal convolution
    la_dt_bias: torch.Tensor | None = None  # (Hv,)
    la_A_log: torch.Tensor | None = None  # (Hv,)
    la_norm: torch.Tensor | None = None  # (dv,), replicated
    la_out: torch.Tensor | None = None  # (H, Hv dv): row-parallel
    # an MLA layer's attention (None elsewhere; mla.py), per rank: hl heads; o_proj above is its output
    mla_a: torch.Tensor | None = None  # (q_lora + latent + rope [+ index d + index heads], H), replicated
    mla_q_norm: torch.Tensor | None = None  # (q_lora,)
    mla_q_b: torch.Tensor | None = None  # (hl (nope + rope), q_lora or H)
    mla_kv_norm: torch.Tensor | None = None  # (latent,)
    mla_kv_b: torch.Tensor | None = None  # (hl (nope + v), latent)
    idx_q: torch.Tensor | None = None  # (index heads * index d, q_lora): the sparse-attention indexer's queries
    idx_k_norm: torch.Tensor | None = None  # (2, index d): its key LayerNorm's weight and bias


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # (V_local, H), vocab-parallel
    layers: list[LayerWeights]
    norm: torch.Tensor  # (H,)
    lm_head: torch.Tensor  # (V_local, H); the embedding itself when tied
    bytes_read: int = 0  # checkpoint bytes this rank read to fill them (its slices, nothing more)


def _layer_shapes(shard: Shard, layer: int) -> list[tuple[int, ...]]:
    a, hd = shard.arch, shard.arch.head_dim
    h, qkv = a.hidden_size, (shard.heads * (2 if a.attn_output_gate else 1) + 2 * shard.kv_heads) * hd
    if a.is_linear_layer(layer):
        shapes = [(h,), (h,), *deltanet_shapes(shard)]
    elif a.is_mla:
        shapes = [(h,), (h,), *mla_shapes(shard, layer)]
    else:
        shapes = [(h,), (qkv, h), (h, shard.heads * hd), (h,)]
        shapes += [(qkv,)] if a.attention_bias else []
        shapes += [(hd,), (hd,)] if a.qk_norm else []
    if a.is_moe_layer(layer):
        return shapes + moe_shapes(shard)
    return shapes + [(2 * shard.intermediate, h), (h, shard.intermediate)]


def weight_shapes(shard: Shard) -> list[tuple[int, ...]]:
    """Shapes of every tensor `load_weights` allocates for this shard (their order does not matter)."""
    a = shard.arch
    heads = 1 if a.tie_word_embeddings else 2  # an untied checkpoint may still lack lm_head: upper bound
    layers = [s for i in range(a.num_layers) for s in _layer_shapes(shard, i)]
    return layers + [(shard.vocab, a.hidden_size)] * heads + [(a.hidden_size,)]


def weights_nbytes(shard: Shard, dtype: torch.dtype, directory: Path | None = None) -> int:
    """Arena bytes the shard's weights take: the size of the weights region and of its host image.

    For a quantized checkpoint in `directory` (talaria/executor/quant.py) the loader's own
    allocations are counted, on the meta device: what is packed, how and where its slices start is
    the checkpoint's to say, and reading it the way `load_weights` does is the one way to agree."""
    item = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for shape in weight_shapes(shard):
        n = item
        for d in shape:
            n *= d
        total += align_up(n)
    if directory is None or QuantFormat.of(directory) is None:
        return total
    dry = Arena(2 * total + (64 << 20), "meta")  # scales and their alignment never double a plain image
    load_weights(directory, shard, dry, dtype, dry_run=True)
    return dry.used_low


def rebind(weights: ModelWeights, source: Arena, target: Arena) -> ModelWeights:
    """The same parameters as views of `target` at the offsets they have in `source`.

    A model's host image and its device weights region share one layout, so a switch copies bytes
    and rebinds views; no tensor is re-created from the checkpoint.
    """
    def move(t: Weight | None) -> Weight | None:
        if isinstance(t, QWeight):
            return QWeight(t.kind, move(t.data), move(t.scale), move(t.scale2), t.block, t.offset)
        if isinstance(t, QStack):
            return QStack([move(p) for p in t.parts])
        return None if t is None else target.view_at(source.offset_of(t), tuple(t.shape), t.dtype)

    layers = [LayerWeights(*(move(getattr(lw, f)) for f in LayerWeights.__slots__)) for lw in weights.layers]
    embed = move(weights.embed)
    lm_head = embed if weights.lm_head is weights.embed else move(weights.lm_head)
    return ModelWeights(embed=embed, layers=layers, norm=move(weights.norm), lm_head=lm_head,
                        bytes_read=weights.bytes_read)


def load_weights(directory: Path, shard: Shard, arena: Arena, dtype: torch.dtype,
                 progress: Progress | None = None, *, dry_run: bool = False) -> ModelWeights:
    """This rank's shard of the checkpoint in `directory`, allocated in `arena` in load order;
    linear weights the checkpoint stores quantized stay packed (talaria/executor/quant.py).

    `progress(bytes read, bytes to read)` is called as the reads advance. `dry_run`: allocate and
    check every read, read nothing (`weights_nbytes` counts a quantized checkpoint's bytes so)."""
    ckpt = ShardReader(directory)
    arch, hd = shard.arch, shard.arch.head_dim
    h0, h1 = shard.head_range
    k0, k1 = shard.kv_head_range

    def alloc(shape: tuple[int, ...], what: str, as_dtype: torch.dtype | None = None) -> torch.Tensor:
        return arena.alloc(shape, as_dtype or dtype, what=what)

    reader = WeightReader(ckpt, alloc, QuantFormat.of(directory))
    read, stacked = reader.linear, reader.stacked

    def vocab_rows(name: str) -> torch.Tensor:
        v0, v1 = shard.vocab_range
        out = alloc((shard.vocab, arch.hidden_size), name)
        out[v1 - v0:].zero_()  # the last rank's padding rows
        ckpt.read_into(out[: v1 - v0], name, 0, v0, v1)
        return out

    h = arch.hidden_size
    q, kv = (h0 * hd, h1 * hd), (k0 * hd, k1 * hd)
    gated = 2 if arch.attn_output_gate else 1  # q_proj rows: each head's query, then its output gate
    # a vision-language checkpoint (Qwen3.5) keeps its text model under model.language_model.
    model = "model.language_model." if "model.language_model.embed_tokens.weight" in ckpt else "model."
    layers = []
    for i in range(arch.num_layers):
        p = f"{model}layers.{i}."
        a = p + "self_attn."
        input_norm = read(p + "input_layernorm.weight", shape=(h,), what=p + "input_layernorm")
        post = (p + "post_attention_layernorm.weight", p + "post_attention_layernorm")  # (name, what)
        if arch.is_linear_layer(i):
            post_norm = read(post[0], shape=(h,), what=post[1])
            if reader.quantized(p + "linear_attn.out_proj.weight"):
                raise CheckpointError(f"{directory}: quantized Gated DeltaNet layers are not supported yet "
                                      "(docs/models.md)")
            lw = LayerWeights(input_norm, None, None, None, None, None, post_norm,
                              **load_deltanet(ckpt, p + "linear_attn.", shard, alloc))
        elif arch.is_mla:
            mla = load_mla(reader, a, shard, i)
            lw = LayerWeights(input_norm, None, None, None, None, mla.pop("o_proj"), read(post[0], shape=(h,), what=post[1]),
                              **mla)
        else:
            qkv = [(a + "q_proj.", q[0] * gated, q[1] * gated), (a + "k_proj.", *kv), (a + "v_proj.", *kv)]
            lw = LayerWeights(
                input_norm=input_norm,
                qkv=stacked([(n + "weight", x, y) for n, x, y in qkv], (h,), a + "qkv"),
                qkv_bias=stacked([(n + "bias", x, y) for n, x, y in qkv], (), a + "qkv_bias")
                if arch.attention_bias else None,
                q_norm=read(a + "q_norm.weight", shape=(hd,), what=a + "q_norm") if arch.qk_norm else None,
                k_norm=read(a + "k_norm.weight", shape=(hd,), what=a + "k_norm") if arch.qk_norm else None,
                o_proj=read(a + "o_proj.weight", 1, *q, shape=(h, shard.heads * hd), what=a + "o_proj"),
                post_norm=read(post[0], shape=(h,), what=post[1]),
            )
        if arch.is_moe_layer(i):
            for field, tensor in load_moe(reader, p + "mlp.", shard).items():
                setattr(lw, field, tensor)
        else:
            i0, i1 = shard.width_range(shard.intermediate)
            lw.gate_up = stacked([(p + "mlp.gate_proj.weight", i0, i1), (p + "mlp.up_proj.weight", i0, i1)],
                                 (h,), p + "gate_up")
            lw.down = read(p + "mlp.down_proj.weight", 1, i0, i1, shape=(h, shard.intermediate), what=p + "down_proj")
        layers.append(lw)
    embed = vocab_rows(model + "embed_tokens.weight")
    tied = arch.tie_word_embeddings or "lm_head.weight" not in ckpt
    norm = read(model + "norm.weight", shape=(h,), what=model + "norm")
    lm_head = embed if tied else vocab_rows("lm_head.weight")
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head,
                        bytes_read=0 if dry_run else ckpt.run(progress))
