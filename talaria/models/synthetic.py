"""Random-weight models from a ``SyntheticShape`` and a seed: deterministic, tiny, tokenizer included.

Tests and profiling need a model with real Llama-family structure but no download. Weights come
from ``numpy.random.default_rng(seed)`` in a fixed order, so one (shape, seed) is one model on every
machine. They are scaled so the logits are well separated (an N(0, 1) output head over a unit-RMS
hidden state gives logits with std ~ sqrt(hidden)): greedy decoding then picks the same token under
any float reordering, which the engine's "cached equals recomputed" tests rely on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from talaria.config.schema import SyntheticShape
from talaria.contracts.arch import FAMILIES, MOE_FAMILIES, ModelArch
from talaria.models.byte_level import byte_level_bpe, bytes_to_unicode
from talaria.models.errors import ModelSourceError
from talaria.models.hf_dir import write_hf_dir

FORMAT_VERSION = 1  # bump when the weights or tokenizer for a given (shape, seed) change

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
MIN_VOCAB = 259  # 256 bytes + 3 specials

# ChatML-shaped, written with plain-text markers: the byte tokenizer has no such special tokens
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def synthetic_arch(shape: SyntheticShape) -> ModelArch:
    """The architecture ``shape`` describes; raises ModelSourceError for an impossible shape."""
    if shape.vocab_size < MIN_VOCAB:
        raise ModelSourceError(f"synthetic vocab_size = {shape.vocab_size} is too small: the byte tokenizer "
                               f"needs {MIN_VOCAB} ids (256 bytes + bos/eos/pad); set vocab_size >= {MIN_VOCAB}")
    if shape.family not in FAMILIES:
        raise ModelSourceError(f"synthetic family = {shape.family!r} is unknown; use one of {', '.join(FAMILIES)}")
    if shape.num_heads % shape.num_kv_heads:
        raise ModelSourceError(f"synthetic num_heads = {shape.num_heads} is not a multiple of "
                               f"num_kv_heads = {shape.num_kv_heads}")
    if shape.head_dim is None and shape.hidden_size % shape.num_heads:
        raise ModelSourceError(f"synthetic hidden_size = {shape.hidden_size} is not divisible by "
                               f"num_heads = {shape.num_heads}; set head_dim explicitly")
    head_dim = shape.head_dim or shape.hidden_size // shape.num_heads
    if head_dim % 2:
        raise ModelSourceError(f"synthetic head_dim = {head_dim} is odd; RoPE needs an even head_dim")
    moe = shape.family in MOE_FAMILIES
    if moe and not 0 < shape.num_experts_per_tok <= shape.num_experts:
        raise ModelSourceError(f"synthetic num_experts_per_tok = {shape.num_experts_per_tok} must be between 1 "
                               f"and num_experts = {shape.num_experts}")
    return ModelArch(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=head_dim,
        max_position=shape.max_position,
        tie_word_embeddings=shape.tie_word_embeddings,
        attention_bias=shape.family in ("qwen2", "qwen2_moe"),
        qk_norm=shape.family in ("qwen3", "qwen3_moe"),
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID,),
        family=shape.family,
        num_experts=shape.num_experts if moe else 0,
        num_experts_per_tok=shape.num_experts_per_tok if moe else 0,
        moe_intermediate_size=shape.moe_intermediate_size if moe else 0,
        shared_expert_intermediate_size=shape.shared_expert_intermediate_size if shape.family == "qwen2_moe" else 0,
        norm_topk_prob=shape.family == "qwen3_moe",  # as each family's released checkpoints set it
        decoder_sparse_step=shape.decoder_sparse_step if moe else 1,
    )


def synthetic_weights(arch: ModelArch, seed: int) -> dict[str, np.ndarray]:
    """float32 weights under HF names, drawn in a fixed order from ``default_rng(seed)``."""
    rng = np.random.default_rng(seed)

    def linear(out_features: int, in_features: int) -> np.ndarray:
        return (rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    def bias(size: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(size)).astype(np.float32)

    h, i = arch.hidden_size, arch.intermediate_size
    w = {"model.embed_tokens.weight": rng.standard_normal((arch.vocab_size, h)).astype(np.float32)}
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = linear(arch.q_size, h)
        w[p + "self_attn.k_proj.weight"] = linear(arch.kv_size, h)
        w[p + "self_attn.v_proj.weight"] = linear(arch.kv_size, h)
        if arch.attention_bias:
            w[p + "self_attn.q_proj.bias"] = bias(arch.q_size)
            w[p + "self_attn.k_proj.bias"] = bias(arch.kv_size)
            w[p + "self_attn.v_proj.bias"] = bias(arch.kv_size)
        if arch.qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm(arch.head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(arch.head_dim)
        w[p + "self_attn.o_proj.weight"] = linear(h, arch.q_size)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        if arch.is_moe_layer(layer):
            w |= _moe_weights(arch, p + "mlp.", linear)
        else:
            w[p + "mlp.gate_proj.weight"] = linear(i, h)
            w[p + "mlp.up_proj.weight"] = linear(i, h)
            w[p + "mlp.down_proj.weight"] = linear(h, i)
    w["model.norm.weight"] = norm(h)
    if not arch.tie_word_embeddings:
        # N(0, 1) like the embedding, not 1/sqrt(fan_in): keeps logits well separated (module doc)
        w["lm_head.weight"] = rng.standard_normal((arch.vocab_size, h)).astype(np.float32)
    return w


def _moe_weights(arch: ModelArch, p: str, linear: Callable[[int, int], np.ndarray]) -> dict[str, np.ndarray]:
    """One MoE layer's MLP, one tensor per expert (the layout transformers' save_pretrained writes)."""
    h, m, s = arch.hidden_size, arch.moe_intermediate_size, arch.shared_expert_intermediate_size
    w = {p + "gate.weight": linear(arch.num_experts, h)}
    for e in range(arch.num_experts):
        w[f"{p}experts.{e}.gate_proj.weight"] = linear(m, h)
        w[f"{p}experts.{e}.up_proj.weight"] = linear(m, h)
        w[f"{p}experts.{e}.down_proj.weight"] = linear(h, m)
    if s:
        w[p + "shared_expert.gate_proj.weight"] = linear(s, h)
        w[p + "shared_expert.up_proj.weight"] = linear(s, h)
        w[p + "shared_expert.down_proj.weight"] = linear(h, s)
        w[p + "shared_expert_gate.weight"] = linear(1, h)
    return w


def byte_tokenizer(vocab_size: int) -> tuple[Tokenizer, dict]:
    """``(tokenizer, tokenizer_config)``: ids 0..255 are the bytes, then bos/eos/pad, then reserved."""
    spell = bytes_to_unicode()
    vocab = {spell[b]: b for b in range(256)}
    specials = [BOS, EOS, PAD] + [f"<|reserved_{k}|>" for k in range(vocab_size - MIN_VOCAB)]
    vocab |= {token: 256 + k for k, token in enumerate(specials)}
    tokenizer = byte_level_bpe(vocab, merges=[], added=[(t, True) for t in specials])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
    }
    return tokenizer, config


def write_synthetic(shape: SyntheticShape, seed: int, out_dir: Path,
                    progress: Callable[[str, int, int], None] | None = None) -> ModelArch:
    """Write the synthetic model for ``(shape, seed)`` as an HF directory into the empty ``out_dir``."""
    arch = synthetic_arch(shape)
    if progress is not None:
        progress("generate", 0, 1)
    weights = synthetic_weights(arch, seed)
    tokenizer, config = byte_tokenizer(arch.vocab_size)
    write_hf_dir(out_dir, arch, weights, tokenizer, config | {"model_max_length": arch.max_position})
    if progress is not None:
        progress("generate", 1, 1)
    return arch
