"""GGUF -> Hugging Face directory: architecture from metadata, float32 weights under HF names.

llama.cpp renames every tensor (``blk.3.attn_q.weight``) and, for the ``llama`` architecture only,
reorders the rows of the q and k projections so its RoPE can rotate adjacent pairs instead of the
two halves of each head. We rename back and undo that reorder, exactly as transformers' GGUF loader
does (``LlamaTensorProcessor`` in ``transformers/modeling_gguf_pytorch_utils.py``); the tests
compare every tensor with transformers' own load of the same file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from talaria.contracts.arch import FAMILIES, MOE_FAMILIES, ModelArch
from talaria.models.errors import ModelSourceError
from talaria.models.gguf_file import GgufFile
from talaria.models.gguf_tokenizer import VOCAB_ARRAYS, gguf_tokenizer
from talaria.models.hf_dir import write_hf_dir

FORMAT_VERSION = 1  # bump when the output of convert_gguf changes; part of the cache fingerprint

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+ frequency factors, folded into rope_scaling instead


GGUF_FAMILIES = tuple(f for f in FAMILIES if f not in MOE_FAMILIES)  # dense only: no GGUF MoE tensor layout here


def gguf_arch(gguf: GgufFile) -> ModelArch:
    """The model's architecture from metadata and the tensor table alone (no tensor is dequantized
    except the tiny ``rope_freqs`` vector of Llama 3.1+)."""
    family = gguf.architecture
    if family not in GGUF_FAMILIES:
        raise ModelSourceError(f"{gguf.path}: architecture {family!r} is not supported from GGUF; Talaria reads "
                               f"{', '.join(GGUF_FAMILIES)} GGUF files (MoE models: from a safetensors directory)")
    meta, p = gguf.metadata, family
    try:
        vocab_size, hidden = gguf.tensors["token_embd.weight"].shape
        heads = meta[f"{p}.attention.head_count"]
        kv_heads = meta.get(f"{p}.attention.head_count_kv", heads)
        head_dim = meta.get(f"{p}.attention.key_length", hidden // heads)
        theta = float(meta.get(f"{p}.rope.freq_base", 10000.0))
        eos = tuple(dict.fromkeys(meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                    "tokenizer.ggml.eom_token_id") if k in meta))
        return ModelArch(
            vocab_size=vocab_size,
            hidden_size=meta[f"{p}.embedding_length"],
            intermediate_size=meta[f"{p}.feed_forward_length"],
            num_layers=meta[f"{p}.block_count"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position=meta.get(f"{p}.context_length", 4096),
            rope_theta=theta,
            rope_scaling=_rope_scaling(gguf, head_dim, theta),
            rms_norm_eps=meta.get(f"{p}.attention.layer_norm_rms_epsilon", 1e-5),
            tie_word_embeddings="output.weight" not in gguf.tensors,
            attention_bias="blk.0.attn_q.bias" in gguf.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos,
            family=family,
        )
    except KeyError as e:
        raise ModelSourceError(f"{gguf.path}: metadata key or tensor {e} is missing; "
                               "re-convert the model with a current llama.cpp") from None


def convert_gguf(path: Path, out_dir: Path, progress: Callable[[str, int, int], None] | None = None) -> ModelArch:
    """Write ``path`` as an HF directory into the empty ``out_dir``; weights dequantized to float32."""
    gguf = GgufFile.open(path, string_arrays=VOCAB_ARRAYS)
    arch = gguf_arch(gguf)
    tokenizer, tokenizer_config = gguf_tokenizer(gguf, arch.max_position)
    names = [n for n in gguf.tensors if n != _ROPE_FREQS]
    tensors: dict[str, np.ndarray] = {}
    for done, name in enumerate(names):
        if progress is not None:
            progress("dequantize", done, len(names))
        tensors[_hf_name(gguf, name)] = _unpermute(arch, name, gguf.read(name))
    if progress is not None:
        progress("dequantize", len(names), len(names))
        progress("write", 0, 1)
    write_hf_dir(out_dir, arch, tensors, tokenizer, tokenizer_config)
    if progress is not None:
        progress("write", 1, 1)
    return arch


def _hf_name(gguf: GgufFile, name: str) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{suffix}"
    m = _BLOCK.fullmatch(name)
    if m is None or m[2] not in _LAYER:
        raise ModelSourceError(f"{gguf.path}: tensor {name!r} has no Hugging Face counterpart; "
                               "this GGUF is not a plain llama/qwen2/qwen3 model")
    return f"model.layers.{m[1]}.{_LAYER[m[2]]}.{m[3]}"


def _unpermute(arch: ModelArch, name: str, w: np.ndarray) -> np.ndarray:
    """Undo llama.cpp's q/k row interleave (llama architecture only; qwen files are not permuted)."""
    if arch.family != "llama" or not (".attn_q." in name or ".attn_k." in name):
        return w
    heads = arch.num_heads if ".attn_q." in name else arch.num_kv_heads
    # llama.cpp wrote rows as (heads, half, 2) from HF's (heads, 2, half); swap them back
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_scaling(gguf: GgufFile, head_dim: int, theta: float) -> dict | None:
    meta, p = gguf.metadata, gguf.architecture
    kind = meta.get(f"{p}.rope.scaling.type", "none")
    factor = meta.get(f"{p}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        original = meta.get(f"{p}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original}
    if kind not in ("none", "linear", "yarn"):
        raise ModelSourceError(f"{gguf.path}: rope scaling type {kind!r} is not supported")
    if _ROPE_FREQS in gguf.tensors:
        return _llama3_scaling(gguf, gguf.read(_ROPE_FREQS), head_dim, theta)
    return None


def _llama3_scaling(gguf: GgufFile, stored: np.ndarray, head_dim: int, theta: float) -> dict:
    """Recover HF's ``llama3`` rope parameters from llama.cpp's per-frequency factors.

    llama.cpp computes the factors from (factor, low, high, original context); every Llama 3.x
    release uses low=1, high=4, original=8192 and only varies ``factor`` (the largest stored
    value), so we rebuild with those and refuse the file if the result does not match.
    """
    factor, low, high, original = float(stored.max()), 1.0, 4.0, 8192
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    rebuilt = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            rebuilt.append(1.0)
        elif wavelen > original / low:
            rebuilt.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            rebuilt.append(1 / ((1 - smooth) / factor + smooth))
    if not np.allclose(rebuilt, stored, rtol=1e-3):
        raise ModelSourceError(f"{gguf.path}: its rope_freqs do not match Llama 3 rope scaling; "
                               "use the model's Hugging Face directory instead")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original}
