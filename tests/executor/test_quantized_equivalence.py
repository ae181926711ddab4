"""Equality rule for quantized checkpoints (float64 compute): tiny dense Qwen3, Qwen3-MoE (a dense
first layer, then experts) and DeepSeek-V3 (MLA) models written as real FP8 block-scaled and NVFP4 checkpoint
directories (tests/quantized.py, blocks of 16 so that most shapes are ragged), loaded by Talaria with
their weights packed, give the greedy tokens of transformers running the same checkpoint dequantized
in float64 by the tests' own few-line function, at TP 1, 2 and 4 (slices that start inside a scale
block), through switches and host restores. The arena holds the packed bytes.
"""

from __future__ import annotations

import json
import math
import random
import struct

import pytest
import torch

from talaria.config.schema import ModelConfig, Pool
from talaria.contracts.arch import ModelArch
from talaria.contracts.call import InstanceCall
from talaria.contracts.kv_layout import kv_layout
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
               "mla-fp8": ("mla", "fp8", ()), "mla-nvfp4": ("mla", "nvfp4", ROUTED_EXPERTS_ONLY),
               "dense-nvfp4": ("dense", "nvfp4", ())}


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


def build_dense(seed: int = 4):
    """A tiny dense transformers Qwen3 in float64, drawn as `build_moe`'s."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         eos_token_id=None, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
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
    models = {"moe": build_moe(), "mla": build_mla("deepseek_v3"), "dense": build_dense()}
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
PROMPTS = {name: [rng.randrange(256) for _ in range(n)] for name, n in zip(CHECKPOINTS, (21, 26, 23, 30, 19))}
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


def header_only_checkpoint(directory, arch, fmt: str) -> None:
    """A Qwen3-MoE checkpoint of `arch`'s real shape in `fmt`, as its safetensors header alone (names,
    dtypes, shapes; no data): enough for `weights_nbytes`, whose dry run reads no tensor."""
    h, hd, e = arch.hidden_size, arch.head_dim, arch.num_experts
    tensors = {"model.embed_tokens.weight": (arch.vocab_size, h), "lm_head.weight": (arch.vocab_size, h),
               "model.norm.weight": (h,)}
    packed = {}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate.weight": (e, h)}
        packed |= {p + "self_attn.q_proj.weight": (arch.q_size, h), p + "self_attn.k_proj.weight": (arch.kv_size, h),
                   p + "self_attn.v_proj.weight": (arch.kv_size, h), p + "self_attn.o_proj.weight": (h, arch.q_size)}
        m = arch.moe_intermediate_size
        for x in range(e):
            packed |= {f"{p}mlp.experts.{x}.gate_proj.weight": (m, h), f"{p}mlp.experts.{x}.up_proj.weight": (m, h),
                       f"{p}mlp.experts.{x}.down_proj.weight": (h, m)}
    header = {name: {"dtype": "BF16", "shape": list(shape), "data_offsets": [0, 0]} for name, shape in tensors.items()}
    for name, (rows, cols) in packed.items():
        if fmt == "fp8":
            header[name] = {"dtype": "F8_E4M3", "shape": [rows, cols], "data_offsets": [0, 0]}
            header[name + "_scale_inv"] = {"dtype": "F32", "shape": [-(-rows // 128), -(-cols // 128)],
                                           "data_offsets": [0, 0]}
        else:
            header[name] = {"dtype": "U8", "shape": [rows, cols // 2], "data_offsets": [0, 0]}
            header[name + "_scale"] = {"dtype": "F8_E4M3", "shape": [rows, cols // 16], "data_offsets": [0, 0]}
            header[name + "_scale_2"] = {"dtype": "F32", "shape": [], "data_offsets": [0, 0]}
    directory.mkdir()
    raw = json.dumps(header).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128]} if fmt == "fp8" else None
    (directory / "config.json").write_text(json.dumps({"quantization_config": quant} if quant else {}))
    if fmt == "nvfp4":
        (directory / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4",
                                                                                      "group_size": 16}}))


def test_at_qwen3_30b_a3b_shape_the_packed_arena_is_under_the_format_bounds(tmp_path):
    """Qwen3-30B-A3B's real shape (48 layers, 128 experts of 768, vocab 151,936), served in bf16 at
    TP 1: the arena the engine's own loader sizes for an FP8 checkpoint is <= 0.55x the plain bf16
    one, for an NVFP4 one <= 0.30x (embeddings, norms and routers stay bf16)."""
    arch = ModelArch.from_hf_config({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                                     "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                                     "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                                     "num_experts": 128, "num_experts_per_tok": 8, "max_position_embeddings": 40960})
    plain = weights_nbytes(Shard(0, 1, arch), torch.bfloat16)
    ratios = {}
    for fmt in ("fp8", "nvfp4"):
        header_only_checkpoint(tmp_path / fmt, arch, fmt)
        ratios[fmt] = weights_nbytes(Shard(0, 1, arch), torch.bfloat16, tmp_path / fmt) / plain
    assert ratios["fp8"] <= 0.55 and ratios["nvfp4"] <= 0.30, ratios


def test_the_file_checks_name_the_format_and_size_the_arena_by_the_packed_bytes(refs, tmp_path):
    """`config check --files` / `talaria up`: the model line names the format and its packed-to-plain
    ratio, the weights line what a rank holds, and the arena check counts the packed bytes."""
    from talaria.config.errors import ConfigError
    from talaria.config.loader import load_config
    from talaria.node.preflight import check_files

    files = refs["moe-fp8"].files
    ratio = weight_format(files.directory, 8).ratio
    packed = math.ceil(files.arch.param_count() * 8 * ratio)
    # the headers' estimate against the loader's count: this tiny model's 256-byte alignment is ~2%
    assert abs(packed - weights_nbytes(Shard(0, 1, files.arch), torch.float64, files.directory)) <= 0.03 * packed

    def check(arena: int) -> list[str]:
        (tmp_path / "talaria.toml").write_text(
            f'[[models]]\nname = "q"\nsource = "{files.directory}"\ndtype = "float64"\n\n'
            f'[[instances]]\nname = "c"\npool = "cold"\nmodels = ["q"]\narena_bytes = {arena}\n')
        return check_files(load_config(tmp_path / "talaria.toml"))

    info = check(16 << 20)
    assert any(line.startswith('model "q": qwen3_moe') and f"weights fp8 (blocks 16x16), {ratio:.2f}x" in line
               for line in info), info
    assert any(line.startswith('instance "c" model "q" weights: ~') and "packed" in line for line in info), info
    pages = 4 * kv_layout(files.arch, 1, 16, "float64").page_bytes  # the least KV an arena must hold
    with pytest.raises(ConfigError, match="too small"):
        check(packed + pages - 1)
    assert check(packed + pages)  # room for the packed weights: the plain ones would not have fit
    assert files.arch.param_count() * 8 > packed + pages
