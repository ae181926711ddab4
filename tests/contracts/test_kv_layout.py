"""The cache layout descriptor: sizes, offsets and TP split of today's families, and the resume rule."""

from __future__ import annotations

import pytest

from talaria.contracts.arch import ModelArch
from talaria.contracts.kv_layout import CacheTensor, KVLayout, kv_layout, sized_layout

ARCH = ModelArch(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=8,
                 num_kv_heads=4, head_dim=8, max_position=256)


@pytest.mark.parametrize(("tp", "heads"), [(1, 4), (2, 2), (4, 1), (8, 1)])  # tp 8: one head, replicated
def test_gqa_pages_hold_k_and_v_of_every_layer_split_by_kv_heads(tp: int, heads: int):
    layout = kv_layout(ARCH, tp, 16, "bfloat16")
    assert layout.page_bytes == 2 * 3 * heads * 8 * 2 * 16 and layout.token_bytes == layout.page_bytes // 16
    assert (layout.state_bytes, layout.stateful, layout.state_slots(8)) == (0, False, 0)
    block = heads * 8 * 2 * 16  # one layer's K (or V) for a page of 16 tokens
    assert [layout.offsets[(n, i)] for i in range(3) for n in ("k", "v")] == [j * block for j in range(6)]


def test_mixed_dtypes_align_each_block_and_states_get_slots_of_their_own():
    layout = KVLayout(4, (CacheTensor("latent", (0, 1), (3,), "float16", True),
                          CacheTensor("index_k", (0, 1), (1,), "float32", True),
                          CacheTensor("ssm", (2,), (2, 2), "float64", False)))
    # latent 4 tokens x 3 x 2 B = 24, index_k at 24 (4-aligned) 16 B, layer 1's latent at 40, ...
    assert layout.offsets == {("latent", 0): 0, ("index_k", 0): 24, ("latent", 1): 40, ("index_k", 1): 64,
                              ("ssm", 2): 0}
    assert (layout.page_bytes, layout.state_bytes, layout.state_slots(5)) == (80, 32, 10)


def test_the_resume_rule_needs_a_snapshot_only_with_state():
    stateless, stateful = sized_layout(16, 64), sized_layout(16, 64, 1000)
    assert (stateless.page_bytes, stateful.state_bytes) == (1024, 1000)
    assert stateless.resume_pages(7, lambda n: False) == 7
    assert stateful.resume_pages(7, lambda n: n in (2, 5)) == 5
    assert stateful.resume_pages(4, lambda n: n in (2, 5)) == 2 and stateful.resume_pages(1, lambda n: n == 2) == 0


HUB_NEXT = {"model_type": "qwen3_next", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "full_attention_interval": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8}


def test_a_hub_style_hybrid_config_gets_transformers_defaults():
    """Qwen3-Next's published config gives only the attention interval, no rotary factor and no
    norm_topk_prob: layers 3 and 7 attend, a quarter of each head rotates, top-k is renormalised."""
    from talaria.contracts.arch import ModelArch

    arch = ModelArch.from_hf_config(HUB_NEXT)
    assert [i for i in range(8) if not arch.is_linear_layer(i)] == [3, 7]
    assert (arch.rotary_dim, arch.norm_topk_prob) == (4, True)
    assert kv_layout(arch, 1, 16, "float32").tensor("k").layers == (3, 7)


def test_a_vision_language_config_ties_by_its_outer_flag_and_is_all_moe():
    from talaria.contracts.arch import ModelArch

    text = HUB_NEXT | {"model_type": "qwen3_5_moe_text", "tie_word_embeddings": True, "decoder_sparse_step": 2,
                       "mlp_only_layers": [0]}
    arch = ModelArch.from_hf_config({"model_type": "qwen3_5_moe", "tie_word_embeddings": False, "text_config": text})
    assert arch.family == "qwen3_5_moe" and not arch.tie_word_embeddings
    assert all(arch.is_moe_layer(i) for i in range(8))  # transformers ignores the two keys for Qwen3.5
