"""Tiny random MLA models (DeepSeek-V3; GLM-5's glm_moe_dsa with its sparse-attention indexer), built
in float64 with transformers' own config classes.

These families have no synthetic shape in Talaria: a test builds one here, saves it as a checkpoint
directory (`save`: safetensors beside the byte tokenizer) that Talaria loads with `prepare_model`,
and keeps the transformers model as the reference (its own float64 `generate`, whose router, norms
and indexer scores compute in float32 as the engine does). Routing is group-limited (4 groups, the
best 2 kept: GLM-5's default of one group would hide it); GLM's `index_topk` is below the prompts'
lengths, so the indexer's selection matters. Used by tests/executor/test_mla_equivalence.py and
bench/chaos.py.
"""

from __future__ import annotations

from tests.hybrid_models import greedy, save  # noqa: F401  (one save and one reference generate for every family)

FAMILIES = ("deepseek_v3", "glm_moe_dsa")
TINY = {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
        "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "v_head_dim": 12, "qk_nope_head_dim": 8,
        "max_position_embeddings": 256, "eos_token_id": None, "bos_token_id": None}  # tp 4: one head a rank
INDEXER = {"index_topk": 12, "index_head_dim": 16, "index_n_heads": 8,
           "indexer_types": ["full", "shared", "full"]}  # a shared layer reuses layer 0's selection


def build(family: str, seed: int = 7, **overrides):
    """A transformers MLA model in float64 with the eager experts, weights of unit-scale outputs so
    that greedy tokens are well separated; the router's selection bias drawn too (zeros would hide
    it). `overrides` replace TINY's config values."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config, GlmMoeDsaConfig

    config = {"deepseek_v3": DeepseekV3Config, "glm_moe_dsa": GlmMoeDsaConfig}[family]
    extra = INDEXER if family == "glm_moe_dsa" else {}
    model = AutoModelForCausalLM.from_config(config(**TINY | extra | overrides), dtype=torch.float64,
                                             experts_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif p.dim() >= 2:  # projections, router, experts: 1 / sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / p.shape[-1] ** 0.5)
    return model.eval()
