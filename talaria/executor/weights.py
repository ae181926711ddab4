"""Load one rank's shard of a Llama-family checkpoint (HF safetensors names) into the arena.

q/k/v are fused into one column-parallel matrix and gate/up into another, so a layer runs two
matmuls where the checkpoint has five; shapes are per rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from talaria.executor.arena import Arena, align_up
from talaria.executor.parallel import Shard


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # (H,)
    qkv: torch.Tensor  # ((heads + 2 kv_heads) * hd, H)
    qkv_bias: torch.Tensor | None  # ((heads + 2 kv_heads) * hd,)
    q_norm: torch.Tensor | None  # (hd,)
    k_norm: torch.Tensor | None  # (hd,)
    o_proj: torch.Tensor  # (H, heads * hd)
    post_norm: torch.Tensor  # (H,)
    gate_up: torch.Tensor  # (2 * I_local, H)
    down: torch.Tensor  # (H, I_local)


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # (V_local, H), vocab-parallel
    layers: list[LayerWeights]
    norm: torch.Tensor  # (H,)
    lm_head: torch.Tensor  # (V_local, H); the embedding itself when tied


class _Checkpoint:
    """Tensors by HF name across one or many safetensors files, opened lazily (mmap)."""

    def __init__(self, directory: Path) -> None:
        index = directory / "model.safetensors.index.json"
        if index.exists():
            files = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: directory / f for name, f in files.items()}
        else:
            path = directory / "model.safetensors"
            with safe_open(path, framework="pt") as f:
                self._file_of = dict.fromkeys(f.keys(), path)
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def slice(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        path = self._file_of[name]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        sl = self._open[path].get_slice(name)
        if dim is None:
            return sl[:]
        return sl[start:stop] if dim == 0 else sl[:, start:stop]


def weight_shapes(shard: Shard) -> list[tuple[int, ...]]:
    """Shapes of every tensor `load_weights` allocates for this shard (their order does not matter)."""
    a, hd = shard.arch, shard.arch.head_dim
    h, qkv = a.hidden_size, (shard.heads + 2 * shard.kv_heads) * hd
    layer = [(h,), (qkv, h), (h, shard.heads * hd), (h,), (2 * shard.intermediate, h), (h, shard.intermediate)]
    layer += [(qkv,)] if a.attention_bias else []
    layer += [(hd,), (hd,)] if a.qk_norm else []
    heads = 1 if a.tie_word_embeddings else 2  # an untied checkpoint may still lack lm_head: upper bound
    return layer * a.num_layers + [(shard.vocab, h)] * heads + [(h,)]


def weights_nbytes(shard: Shard, dtype: torch.dtype) -> int:
    """Arena bytes the shard's weights take: the size of the weights region and of its host image."""
    item = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for shape in weight_shapes(shard):
        n = item
        for d in shape:
            n *= d
        total += align_up(n)
    return total


def rebind(weights: ModelWeights, source: Arena, target: Arena) -> ModelWeights:
    """The same parameters as views of `target` at the offsets they have in `source`.

    A model's host image and its device weights region share one layout, so a switch copies bytes
    and rebinds views; no tensor is re-created from the checkpoint.
    """
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else target.view_at(source.offset_of(t), tuple(t.shape), t.dtype)

    layers = [LayerWeights(*(move(getattr(lw, f)) for f in LayerWeights.__slots__)) for lw in weights.layers]
    embed = move(weights.embed)
    lm_head = embed if weights.lm_head is weights.embed else move(weights.lm_head)
    return ModelWeights(embed=embed, layers=layers, norm=move(weights.norm), lm_head=lm_head)


def load_weights(directory: Path, shard: Shard, arena: Arena, dtype: torch.dtype) -> ModelWeights:
    ckpt = _Checkpoint(directory)
    arch, hd = shard.arch, shard.arch.head_dim
    h0, h1 = shard.head_range
    k0, k1 = shard.kv_head_range

    def put(parts: list[torch.Tensor], what: str) -> torch.Tensor:
        rows = sum(p.shape[0] for p in parts)
        out = arena.alloc((rows, *parts[0].shape[1:]), dtype, what=what)
        row = 0
        for part in parts:
            out[row:row + part.shape[0]].copy_(part)
            row += part.shape[0]
        return out

    def vocab_rows(name: str) -> torch.Tensor:
        v0, v1 = shard.vocab_range
        rows = ckpt.slice(name, 0, v0, v1)
        out = arena.alloc((shard.vocab, arch.hidden_size), dtype, what=name)
        out.zero_()
        out[: v1 - v0].copy_(rows)
        return out

    layers = []
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv = [ckpt.slice(a + "q_proj.weight", 0, h0 * hd, h1 * hd),
               ckpt.slice(a + "k_proj.weight", 0, k0 * hd, k1 * hd),
               ckpt.slice(a + "v_proj.weight", 0, k0 * hd, k1 * hd)]
        bias = None
        if arch.attention_bias:
            bias = put([ckpt.slice(a + "q_proj.bias", 0, h0 * hd, h1 * hd),
                        ckpt.slice(a + "k_proj.bias", 0, k0 * hd, k1 * hd),
                        ckpt.slice(a + "v_proj.bias", 0, k0 * hd, k1 * hd)], a + "qkv_bias")
        i0, i1 = shard.rank * shard.intermediate, (shard.rank + 1) * shard.intermediate
        layers.append(LayerWeights(
            input_norm=put([ckpt.slice(p + "input_layernorm.weight")], p + "input_layernorm"),
            qkv=put(qkv, a + "qkv"),
            qkv_bias=bias,
            q_norm=put([ckpt.slice(a + "q_norm.weight")], a + "q_norm") if arch.qk_norm else None,
            k_norm=put([ckpt.slice(a + "k_norm.weight")], a + "k_norm") if arch.qk_norm else None,
            o_proj=put([ckpt.slice(a + "o_proj.weight", 1, h0 * hd, h1 * hd)], a + "o_proj"),
            post_norm=put([ckpt.slice(p + "post_attention_layernorm.weight")], p + "post_attention_layernorm"),
            gate_up=put([ckpt.slice(p + "mlp.gate_proj.weight", 0, i0, i1),
                         ckpt.slice(p + "mlp.up_proj.weight", 0, i0, i1)], p + "gate_up"),
            down=put([ckpt.slice(p + "mlp.down_proj.weight", 1, i0, i1)], p + "down_proj"),
        ))
    embed = vocab_rows("model.embed_tokens.weight")
    tied = arch.tie_word_embeddings or "lm_head.weight" not in ckpt
    return ModelWeights(
        embed=embed,
        layers=layers,
        norm=put([ckpt.slice("model.norm.weight")], "model.norm"),
        lm_head=embed if tied else vocab_rows("lm_head.weight"),
    )
