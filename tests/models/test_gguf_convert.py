"""GGUF conversion: toy files with known weights, and the real SmolLM2 against transformers."""

from __future__ import annotations

import functools
import json

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from talaria.config.schema import SyntheticShape
from talaria.models.errors import ModelSourceError
from talaria.models.gguf_convert import convert_gguf, gguf_arch
from talaria.models.gguf_file import GgufFile

from .conftest import write_toy_gguf


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tie", [False, True])
def test_toy_gguf_converts_back_to_the_hf_weights(tmp_path, family, tie):
    shape = SyntheticShape(family=family, tie_word_embeddings=tie, num_heads=4, num_kv_heads=2)
    _, weights = write_toy_gguf(tmp_path / "toy.gguf", shape, seed=3)
    out = tmp_path / "out"
    out.mkdir()
    stages = []
    converted_arch = convert_gguf(tmp_path / "toy.gguf", out, lambda s, d, n: stages.append((s, d, n)))

    ours = load_file(out / "model.safetensors")
    assert set(ours) == set(weights)  # no lm_head when tied; biases only for qwen2, q/k norms only for qwen3
    for name, w in weights.items():
        np.testing.assert_array_equal(ours[name], w, err_msg=name)  # q/k un-permuted for llama
    assert converted_arch.family == family and converted_arch.tie_word_embeddings == tie
    assert converted_arch.attention_bias == (family == "qwen2") and converted_arch.qk_norm == (family == "qwen3")
    assert (converted_arch.num_heads, converted_arch.num_kv_heads, converted_arch.head_dim) == (4, 2, 16)
    assert converted_arch.eos_token_ids == (257,) and converted_arch.bos_token_id == 256
    assert ("dequantize", len(weights), len(weights)) in stages and stages[-1] == ("write", 1, 1)
    assert json.loads((out / "config.json").read_text())["model_type"] == family


def test_unsupported_architecture_is_refused(tmp_path):
    write_toy_gguf(tmp_path / "toy.gguf", SyntheticShape())
    gguf = GgufFile.open(tmp_path / "toy.gguf")
    gguf.metadata["general.architecture"] = "gemma2"
    with pytest.raises(ModelSourceError, match="architecture 'gemma2' is not supported"):
        gguf_arch(gguf)


def test_smollm2_arch_from_metadata(smollm_gguf):
    arch = gguf_arch(GgufFile.open(smollm_gguf))
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (30, 576, 9, 3)
    assert (arch.vocab_size, arch.head_dim, arch.intermediate_size) == (49152, 64, 1536)
    assert arch.tie_word_embeddings and arch.family == "llama" and arch.rope_theta == 100000.0
    assert arch.bos_token_id == 1 and arch.eos_token_ids == (2,)


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_load(smollm_gguf, smollm_files):
    """Every tensor equals transformers' own dequantize + un-permute of the same file."""
    import accelerate  # noqa: F401  transformers needs it for gguf_file=; a missing one must fail, not skip
    import torch
    import transformers
    # Speed only (~30 s -> ~15 s on 2 cores): transformers parses the file twice and rebuilds the
    # same name map per module; memoizing those pure, read-only steps leaves its weight path untouched.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        mp.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        reference = transformers.AutoModelForCausalLM.from_pretrained(smollm_gguf.parent, gguf_file=smollm_gguf.name)
    expected = reference.state_dict()
    ours = load_file(smollm_files.directory / "model.safetensors")

    assert set(ours) == set(expected) - {"lm_head.weight"}  # tied: transformers' lm_head is embed_tokens
    for name, tensor in ours.items():
        assert torch.equal(torch.from_numpy(tensor), expected[name].float()), name

    cfg = reference.config
    arch = smollm_files.arch
    assert (arch.hidden_size, arch.intermediate_size, arch.num_layers) == (
        cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers)
    assert (arch.num_heads, arch.num_kv_heads, arch.max_position) == (
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings)
    assert arch.rms_norm_eps == cfg.rms_norm_eps and arch.tie_word_embeddings == cfg.tie_word_embeddings
    assert arch.rope_theta == cfg.rope_parameters["rope_theta"]
