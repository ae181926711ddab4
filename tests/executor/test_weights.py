"""A shard's weights occupy exactly `weights_nbytes`, and rebinding its host image into another
arena (what a model switch does after copying the bytes) yields the same parameters as views."""

from __future__ import annotations

import pytest
import torch

from talaria.config.schema import ModelConfig, SyntheticShape
from talaria.executor.arena import Arena
from talaria.executor.parallel import Shard
from talaria.executor.weights import load_weights, rebind, weights_nbytes
from talaria.models.source import prepare_model
from tests.tiny_models import tiny_files

MOE_SHAPES = {  # dense layers between MoE ones (step 2); expert widths split over tp 2 and 4
    "qwen3_moe": SyntheticShape(family="qwen3_moe", num_layers=3, decoder_sparse_step=2, moe_intermediate_size=16),
    "qwen2_moe": SyntheticShape(family="qwen2_moe", num_layers=2, shared_expert_intermediate_size=24),
}


@pytest.mark.parametrize("family,tp", [("llama", 1), ("qwen2", 2), ("qwen3", 4), ("qwen3_moe", 2), ("qwen2_moe", 4)])
def test_rebind_after_a_byte_copy_gives_the_same_parameters(model_cache, family, tp):
    if family in MOE_SHAPES:
        files = prepare_model(ModelConfig(name=family, source="synthetic:", dtype="float64",
                                          shape=MOE_SHAPES[family]), None, model_cache)
    else:
        files = tiny_files(family, model_cache)
    shard = Shard(tp - 1, tp, files.arch)
    need = weights_nbytes(shard, torch.float64)
    host = Arena(need, "cpu")
    weights = load_weights(files.directory, shard, host, torch.float64)
    assert host.used_low == need  # the estimate is exact: the host image has no slack
    device = Arena(need + 4096, "cpu")
    device.bytes(0, need).copy_(host.bytes(0, need))
    moved = rebind(weights, host, device)
    assert moved.embed.data_ptr() == device.base + host.offset_of(weights.embed)
    pairs = [(weights.embed, moved.embed), (weights.norm, moved.norm), (weights.lm_head, moved.lm_head)]
    for a, b in zip(weights.layers, moved.layers):
        pairs += [(getattr(a, f), getattr(b, f)) for f in a.__slots__ if getattr(a, f) is not None]
    for a, b in pairs:
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert (moved.lm_head is moved.embed) == (weights.lm_head is weights.embed)
