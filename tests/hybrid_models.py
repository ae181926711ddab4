"""Tiny random hybrid models (Gated DeltaNet layers between gated attention layers, MoE with a gated
shared expert), built in float64 with transformers' own Qwen3-Next and Qwen3.5-MoE config classes.

These families have no synthetic shape in Talaria: a test builds one here, saves it as a checkpoint
directory (`save`: safetensors beside the byte tokenizer) that Talaria loads with `prepare_model`,
and keeps the transformers model as the reference (`greedy`: its own float64 `generate`, whose
pure-torch delta rule computes in float32 as the engine does). Used by
tests/executor/test_hybrid_equivalence.py and bench/chaos.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from talaria.models.synthetic import byte_tokenizer

FAMILIES = ("qwen3_next", "qwen3_5_moe")
TINY = {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 256, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8}  # tp 2 splits every head kind


def build(family: str, seed: int = 7, **overrides):
    """A transformers hybrid model in float64 with the eager experts, weights drawn so that greedy
    tokens are well separated (decays and step sizes of both signs around their typical values).
    `overrides` replace TINY's config values."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (
        Qwen3_5MoeTextConfig,
    )

    config_class = {"qwen3_next": Qwen3NextConfig, "qwen3_5_moe": Qwen3_5MoeTextConfig}[family]
    model = AutoModelForCausalLM.from_config(config_class(**TINY | overrides), dtype=torch.float64,
                                             experts_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:  # zero-centred norms: 1 + w
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            else:  # projections, convolution, router, experts: 1 / sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / p.shape[-1] ** 0.5)
    return model.eval()


def save(model, directory: Path) -> None:
    """The checkpoint directory Talaria loads: `save_pretrained`'s files and the byte tokenizer."""
    model.save_pretrained(directory)
    tok, tok_config = byte_tokenizer(model.config.get_text_config().vocab_size)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy `generate` of exactly n tokens after `prompt`: what the engine decodes
    with `ignore_eos`. The tiny configs set no `eos_token_id`, so generate stops only at n and never
    masks the tokenizer's EOS (as `min_new_tokens` would); a shorter answer means one was set."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    tokens = out[0, len(prompt):].tolist()
    if len(tokens) != n:
        raise RuntimeError(f"generate stopped after {len(tokens)} of {n} tokens: the model's generation config "
                           f"has eos_token_id {model.generation_config.eos_token_id}; the engine's ignore_eos "
                           "calls never stop early, so build the reference without one")
    return tokens
