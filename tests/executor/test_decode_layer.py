"""A decode step's layers in two kernel calls each (talaria/executor/decode_layer.py) against the torch
path they replace: every fused step of a real engine run is computed both ways, float32, and the
hidden states and the keys and values written must agree to float32 rounding."""

from __future__ import annotations

import random

import pytest
import torch

from talaria.config.schema import ModelConfig, SyntheticShape
from talaria.contracts.call import SamplingParams
from talaria.executor import cpu_kernels
from talaria.executor.decode_layer import DecodeLayers
from talaria.executor.llama import LlamaModel
from talaria.models.source import prepare_model
from tests.tiny_models import call, engine, run, tokens

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="Talaria's CPU kernels do not run here")

SHAPES = {  # each a part of the block: biases, q/k norms, 3 query heads a KV head, a hidden size past 16s, MoE
    "llama": SyntheticShape(family="llama"),
    "qwen2": SyntheticShape(family="qwen2", tie_word_embeddings=True),
    "qwen3": SyntheticShape(family="qwen3", head_dim=32),
    "odd widths": SyntheticShape(family="llama", hidden_size=72, intermediate_size=100, num_heads=3, num_kv_heads=1,
                                 head_dim=48),
    "moe every 2nd": SyntheticShape(family="qwen3_moe", head_dim=32, decoder_sparse_step=2, num_layers=4),
    "moe, shared expert": SyntheticShape(family="qwen2_moe", num_experts=4),
}
SAMPLING = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def both_ways(monkeypatch) -> list[tuple[int, bool]]:
    """Every fused decode step runs the torch path first, then the fused one, whose result goes on;
    asserts they agree. Returns each fused step's token count and whether its batch shares a prefix."""
    fused_steps = []
    forward = LlamaModel.forward

    def twice(self, input_ids, positions, meta, kv, segments=None):
        if self.fused is None or not self.fused.runs(input_ids, meta, kv):
            return forward(self, input_ids, positions, meta, kv, segments)
        layers = [i for i, a in enumerate(self.fused.attention) if a]
        where = (meta.write_pages, meta.write_offsets)
        monkeypatch.setattr(cpu_kernels, "DECODE_LAYERS", False)
        plain = forward(self, input_ids, positions, meta, kv, segments)
        written = [tuple(c[where].clone() for c in kv.layer(i)) for i in layers]
        for i in layers:  # the fused path must write them itself
            for c in kv.layer(i):
                c[where] = float("nan")
        monkeypatch.setattr(cpu_kernels, "DECODE_LAYERS", True)
        fused = forward(self, input_ids, positions, meta, kv, segments)
        torch.testing.assert_close(fused, plain, rtol=2e-5, atol=2e-5)
        for i, (k, v) in zip(layers, written, strict=True):
            k_cache, v_cache = kv.layer(i)
            torch.testing.assert_close(k_cache[where], k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v_cache[where], v, rtol=1e-5, atol=1e-5)
        fused_steps.append((len(input_ids), meta.decodes[0].shared is not None))
        return fused

    monkeypatch.setattr(LlamaModel, "forward", twice)
    return fused_steps


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fused_decode_steps_equal_the_torch_path(shape, model_cache, monkeypatch):
    files = prepare_model(ModelConfig(name="tiny", source="synthetic:", dtype="float32", seed=3,
                                      shape=SHAPES[shape]), None, model_cache)
    fused_steps = both_ways(monkeypatch)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 3, 4, 5, 9, 17, 30, 2, 6, 7, 3, 11)]
    calls = [call(str(i), "tiny", p, SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True))
             for i, p in enumerate(prompts)]
    core = engine([files], page_size=4, max_batch_tokens=128)
    outs = run(core, calls)  # 12 decode together, then fewer as they finish
    assert all(len(tokens(outs[c.request_id])) == c.sampling.max_tokens for c in calls)
    counts = {t for t, _ in fused_steps}
    assert {12, 9, 8, 1} <= counts and len(counts) >= 8, fused_steps  # past 8: the products in passes of 8
    model = core.executor.substrate.model
    assert all(model.fused.attention)
    dense, routed = {"moe every 2nd": ([True, False] * 2, [False, True] * 2),  # layers 1 and 3 are MoE
                     "moe, shared expert": ([False] * 2, [False] * 2)}.get(shape, ([True] * 2, [False] * 2))
    assert (model.fused.dense, model.fused.routed) == (dense, routed)


def test_steps_and_models_it_leaves_to_torch(model_cache, monkeypatch):
    """A step of more than 64 decodes, or with a prompt chunk, and a float64 model run the torch path."""
    files = prepare_model(ModelConfig(name="tiny", source="synthetic:", dtype="float32", seed=3,
                                      shape=SHAPES["llama"]), None, model_cache)
    asked, runs = [], DecodeLayers.runs  # every step's size and whether it was decodes only, fused or not
    monkeypatch.setattr(DecodeLayers, "runs", lambda self, x, meta, kv: asked.append((len(x), not meta.prefills))
                        or runs(self, x, meta, kv))
    fused_steps = both_ways(monkeypatch)
    calls = [call(str(i), "tiny", [i % 200 + 1] * 2, SamplingParams(max_tokens=3 + i // 10, temperature=0.0,
                                                                      ignore_eos=True)) for i in range(70)]
    run(engine([files], page_size=4, max_running=80, max_batch_tokens=256, arena_bytes=64 << 20), calls)
    counts = {t for t, _ in fused_steps}
    assert (70, True) in asked and (60, True) in asked  # 70 decoded together, then 60 once 10 finished
    assert max(counts) == 60 and 70 not in counts, sorted(counts)  # the 70: torch; the 60: fused
    assert any(not decodes_only for _, decodes_only in asked)  # and the prompts' steps: torch (not in counts)
    double = prepare_model(ModelConfig(name="tiny", source="synthetic:", dtype="float64", seed=3,
                                       shape=SHAPES["llama"]), None, model_cache)
    assert engine([double], page_size=4).executor.substrate.model.fused is None


@pytest.mark.parametrize("shape", ["llama", "qwen3"])
def test_a_batch_sharing_a_cached_prefix_reads_it_in_place(shape, model_cache, monkeypatch):
    """Calls reusing one prompt's pages decode as a batch with a shared part (attention.py): fused, the
    prefix read in place for each sequence, as the torch path's one read for all."""
    files = prepare_model(ModelConfig(name="tiny", source="synthetic:", dtype="float32", seed=3,
                                      shape=SHAPES[shape]), None, model_cache)
    fused_steps = both_ways(monkeypatch)
    core = engine([files], page_size=4)
    prompt = [random.Random(1).randrange(256) for _ in range(40)]
    run(core, [call("first", "tiny", prompt, SAMPLING)])  # its pages cached
    outs = run(core, [call(str(i), "tiny", prompt + [i + 1, i + 2], SAMPLING) for i in range(5)])
    assert all(outs[str(i)][-1].usage.cached_tokens >= 40 for i in range(5))
    assert sum(shared for _, shared in fused_steps) >= SAMPLING.max_tokens - 2, fused_steps


def test_an_mla_models_dense_layers_fuse_their_mlp_only(tmp_path, monkeypatch):
    """DeepSeek-V3: its MLA attention and its MoE layers (sigmoid routing, a shared expert) run in torch;
    its first, dense layer's MLP block runs fused beside them."""
    from tests.mla_models import build, save

    save(build("deepseek_v3"), tmp_path / "mla")
    files = prepare_model(ModelConfig(name="mla", source=str(tmp_path / "mla"), dtype="float32"), None)
    fused_steps = both_ways(monkeypatch)
    core = engine([files], page_size=4)
    run(core, [call(str(i), "mla", [i + 1] * (3 + i), SamplingParams(max_tokens=6 + 3 * i, temperature=0.0,
                                                                     ignore_eos=True)) for i in range(3)])
    model = core.executor.substrate.model
    assert (model.fused.attention, model.fused.dense, model.fused.routed) == ([False] * 3, [True, False, False],
                                                                                [False] * 3)
    # each decode step of 1, 2 and 3 sequences fused (both_ways checked every fused step against torch). Once
    # in a full suite (session 22, 1 run of 1) an 8-token decode-only step fused too, and agreed: its origin
    # is not yet explained, so only the steps the test is about are required
    assert {1, 2, 3} <= {t for t, _ in fused_steps}, fused_steps
