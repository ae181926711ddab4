"""Synthetic models: deterministic per seed, honour the shape, load in transformers, peaked logits."""

from __future__ import annotations

import numpy as np
import pytest

from talaria.config.schema import ModelConfig, SyntheticShape
from talaria.models.errors import ModelSourceError
from talaria.models.source import prepare_model
from talaria.models.synthetic import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    byte_tokenizer,
    synthetic_arch,
    synthetic_weights,
)


def test_same_seed_same_weights_different_seed_different_weights():
    arch = synthetic_arch(SyntheticShape())
    a, b, c = synthetic_weights(arch, 7), synthetic_weights(arch, 7), synthetic_weights(arch, 8)
    assert list(a) == list(b) == list(c)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert all(not np.array_equal(a[k], c[k]) for k in a)
    assert all(w.dtype == np.float32 for w in a.values())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
def test_family_and_tying_decide_the_tensors(family):
    arch = synthetic_arch(SyntheticShape(family=family, tie_word_embeddings=True, head_dim=32, decoder_sparse_step=2))
    w = synthetic_weights(arch, 0)
    assert "lm_head.weight" not in w
    assert ("model.layers.0.self_attn.q_proj.bias" in w) == (family in ("qwen2", "qwen2_moe"))
    assert ("model.layers.1.self_attn.k_norm.weight" in w) == (family in ("qwen3", "qwen3_moe"))
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    moe = family.endswith("_moe")  # layer 1 routes to 8 experts of width 32, layer 0 stays dense (step 2)
    assert ("model.layers.1.mlp.experts.7.down_proj.weight" in w) == moe
    assert ("model.layers.1.mlp.shared_expert_gate.weight" in w) == (family == "qwen2_moe")
    assert "model.layers.0.mlp.gate_proj.weight" in w and ("model.layers.1.mlp.gate_proj.weight" in w) != moe
    if moe:
        assert w["model.layers.1.mlp.gate.weight"].shape == (8, 64)
        assert w["model.layers.1.mlp.experts.0.gate_proj.weight"].shape == (32, 64)
    assert sum(t.size for t in w.values()) == arch.param_count()


def test_shape_errors_name_the_field():
    with pytest.raises(ModelSourceError, match="vocab_size = 100 is too small.*>= 259"):
        synthetic_arch(SyntheticShape(vocab_size=100))
    with pytest.raises(ModelSourceError, match="num_heads = 4 is not a multiple of num_kv_heads = 3"):
        synthetic_arch(SyntheticShape(num_kv_heads=3))
    with pytest.raises(ModelSourceError, match="family = 'gpt2'"):
        synthetic_arch(SyntheticShape(family="gpt2"))
    with pytest.raises(ModelSourceError, match="num_experts_per_tok = 3 must be between 1 and num_experts = 2"):
        synthetic_arch(SyntheticShape(family="qwen3_moe", num_experts=2, num_experts_per_tok=3))


def test_byte_tokenizer_ids_are_bytes_then_specials():
    tok, config = byte_tokenizer(300)
    assert tok.encode("héllo", add_special_tokens=False).ids == list("héllo".encode())
    assert [tok.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>")] == [BOS_ID, EOS_ID, PAD_ID]
    assert tok.token_to_id("<|reserved_40|>") == 299 and tok.get_vocab_size() == 300
    assert tok.encode("a<|eos|>", add_special_tokens=False).ids == [97, EOS_ID]
    assert tok.decode([104, 105, EOS_ID]) == "hi"
    assert config["eos_token"] == "<|eos|>"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
def test_transformers_loads_the_directory_with_well_separated_logits(tmp_path, family):
    import torch
    import transformers
    files = prepare_model(ModelConfig(name="s", source="synthetic:", seed=5, shape=SyntheticShape(family=family)),
                          None, tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(files.directory)
    assert model.config.model_type == family
    with torch.no_grad():
        logits = model(torch.tensor([list(b"hello synthetic world")])).logits[0]
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.5  # greedy argmax is robust to float reordering
    assert logits.std(dim=-1).min() > 2.0  # far from uniform
