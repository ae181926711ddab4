"""Equality rule for quantized checkpoints (float64 compute): tiny Qwen3-MoE (a dense first layer,
then experts) and DeepSeek-V3 (MLA) models written as real FP8 block-scaled and NVFP4 checkpoint
directories (tests/quantized.py, blocks of 16 so that most shapes are ragged), loaded by Talaria with
their weights packed, give the greedy tokens of transformers running the same checkpoint dequantized
in float64 by the tests' own few-line function, at TP 1, 2 and 4 (slices that start inside a scale
block), through switches and host restores. The arena holds the packed bytes.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from talaria.config.schema import ModelConfig, Pool
from talaria.contracts.call import InstanceCall
from talaria.executor.parallel import Shard
from talaria.executor.weights import weights_nbytes
from talaria.models.source import prepare_model
from talaria.models.weight_format import weight_format
from tests.executor.group_turns import group_turns
from tests.executor.hand_profile import write_profile
from tests.executor.test_moe_equivalence import Reference, hf_greedy
from tests.mla_models import build as build_mla
from tests.quantized import ROUTED_EXPERTS_ONLY, quantize_checkpoint, reference_model
from tests.tiny_models import GREEDY, engine, instance, run, tokens

BLOCK = (16, 16)
SUBSTRATE = {"pool": Pool.COLD, "page_size": 4, "debug_poison": True, "staging_chunk_bytes": 4096,
             "host_kv_bytes": 8 << 20, "ttft_s": 3600.0, "arena_bytes": 16 << 20}
# name -> (model, format, excluded modules)
CHECKPOINTS = {"moe-fp8": ("moe", "fp8", ()), "moe-nvfp4": ("moe", "nvfp4", ()),
               "mla-fp8": ("mla", "fp8", ()), "mla-nvfp4": ("mla", "nvfp4", ROUTED_EXPERTS_ONLY)}


def build_moe(seed: int = 3, **overrides):
    """A tiny transformers Qwen3-MoE in float64: layer 0 dense, then 8 experts of width 16, top-2."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(**{"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0],
                               "norm_topk_prob": True, "max_position_embeddings": 256, "eos_token_id": None,
                               "bos_token_id": None} | overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if p.dim() < 2 or "embed" in name or "lm_head" in name else p.shape[-1] ** -0.5
            p.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> dict[str, Reference]:
    root = tmp_path_factory.mktemp("quantized")
    models = {"moe": build_moe(), "mla": build_mla("deepseek_v3")}
    out = {}
    for name, (model, fmt, exclude) in CHECKPOINTS.items():
        quantize_checkpoint(models[model], root / name, fmt, block=BLOCK, exclude=exclude)
        files = prepare_model(ModelConfig(name=name, source=str(root / name), dtype="float64"), None)
        out[name] = Reference(files, hf_greedy(reference_model(models[model].config, root / name)))
    return out


@pytest.fixture(scope="module")
def profile_for(tmp_path_factory):
    def write(files, tp: int) -> str:
        return write_profile(tmp_path_factory.mktemp("profile"), files, tp, SUBSTRATE["arena_bytes"])
    return write


rng = random.Random(11)
PROMPTS = {name: [rng.randrange(256) for _ in range(n)] for name, n in zip(CHECKPOINTS, (21, 26, 23, 30))}
BESIDE = [rng.randrange(256) for _ in range(17)]
TAIL = [6, 7]


def test_tp1_quantized_checkpoints_equal_their_dequantized_reference(refs, profile_for):
    for name, ref in refs.items():
        core = engine([ref.files], page_size=4, host_kv_bytes=0, profile=profile_for([ref.files], 1))
        outs = run(core, [InstanceCall(str(i), name, tuple(p), GREEDY) for i, p in enumerate((PROMPTS[name], BESIDE))])
        assert [tokens(outs["0"]), tokens(outs["1"])] == [ref.greedy(PROMPTS[name]), ref.greedy(BESIDE)], name


def test_the_dequantization_matters(refs):
    """The original float64 model answers differently from its quantized checkpoint: the equality
    above is with the packed weights, not with weights that happen to round to the same tokens."""
    original = Reference(refs["moe-nvfp4"].files, hf_greedy(build_moe()))
    assert original.greedy(PROMPTS["moe-nvfp4"]) != refs["moe-nvfp4"].greedy(PROMPTS["moe-nvfp4"])


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_groups_switch_and_restore_quantized_models(refs, profile_for, tp):
    """Two quantized models time-share a group of worker processes over gloo; each rank holds its
    slices of the packed weights (scale blocks cut mid-block at tp 4); turn 2 comes back from host."""
    for pair in (("moe-fp8", "mla-nvfp4"), ("moe-nvfp4", "mla-fp8")):
        files = [refs[n].files for n in pair]
        config = instance(files, tp=tp, profile=profile_for(files, tp), **SUBSTRATE)
        results = group_turns(config, files, {n: PROMPTS[n] for n in pair}, {n: BESIDE for n in pair}, TAIL)
        for (name, turn), (prompt, toks, usage) in results.items():
            assert toks == refs[name].greedy(prompt), f"{name} turn {turn} tp={tp}"
            assert turn != 2 or usage.restored_tokens > 0 or usage.cached_tokens > 0, f"{name}: turn 2 recomputed"


def packed_ratio(directory) -> float:
    """Bytes of a checkpoint's packed weights and their scales over the same weights in bf16."""
    from safetensors import safe_open

    own = plain = 0
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for name in names:
            t = f.get_slice(name)
            numel = math.prod(t.get_shape())
            if name.endswith(("_scale_inv", "_scale", "_scale_2", "input_scale")):
                own += numel * (4 if t.get_dtype() == "F32" else 1)
            elif name + "_scale_inv" in names or name + "_scale" in names:
                own += numel
                plain += numel * (2 if t.get_dtype() == "U8" else 1) * 2
    return own / plain


def test_the_arena_holds_the_packed_bytes(tmp_path):
    """A rank's weights take the checkpoint's packed weights and scales plus the plain tensors in the
    model dtype (±1%, the rest is alignment). In bf16, the whole model in FP8 takes <= 0.55x of the
    plain model's bytes; NVFP4's packed weights <= 0.30x of theirs (the whole tiny model: 0.32x, its
    embeddings, norms and routers being 4.5% of its parameters against ~2% in Qwen3-30B-A3B)."""
    model = build_moe(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=6,
                      head_dim=64, num_experts=4)
    plain = tmp_path / "plain"
    quantize_checkpoint(model, plain, "fp8", exclude=("*",))  # everything excluded: a plain checkpoint
    arch = prepare_model(ModelConfig(name="p", source=str(plain), dtype="bfloat16"), None).arch
    bf16 = weights_nbytes(Shard(0, 1, arch), torch.bfloat16, plain)
    ratios = {}
    for fmt in ("fp8", "nvfp4"):
        quantize_checkpoint(model, tmp_path / fmt, fmt)
        packed = weights_nbytes(Shard(0, 1, arch), torch.bfloat16, tmp_path / fmt)
        expected = weight_format(tmp_path / fmt, 2).ratio * arch.param_count() * 2
        assert abs(packed - expected) <= 0.01 * expected, fmt
        ratios[fmt] = packed / bf16
    assert ratios["fp8"] <= 0.55 and ratios["nvfp4"] < 0.33, ratios
    assert packed_ratio(tmp_path / "nvfp4") <= 0.30 and packed_ratio(tmp_path / "fp8") <= 0.55
