"""The quantized-checkpoint helper (tests/quantized.py) is itself a reference, so it is checked
before anything is compared with it: the quantizer rounds every value to the nearest point of the
format's grid within the format's error bound, on shapes that cut blocks and groups short; the
independent dequantizer reads the nibble order ModelOpt writes; whole tiny Qwen3-MoE and
DeepSeek-V3 directories load into transformers in both formats and both expert layouts and
generate; exclusions stay bit-exact float64; and the bytes on disk are the packed weights plus
their scales, nothing else.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests import mla_models
from tests.hybrid_models import greedy, save
from tests.quantized import (
    E2M1,
    FORMATS,
    ROUTED_EXPERTS_ONLY,
    _fp8,
    _nvfp4,
    checkpoint_bytes,
    dequantized_state_dict,
    quantize_checkpoint,
    reference_model,
)

QWEN3_MOE = {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 24,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256,
             "mlp_only_layers": [0]}  # layer 0 dense; expert down_proj's input width 24 is no multiple of 16
BLOCK = (16, 16)  # FP8 blocks small enough that the tiny widths (24, 32, 48, 80) end mid-block
PROMPT = [5, 17, 99, 3, 250, 41, 8]
# the error bound of one element: FP8 e4m3 keeps 3 mantissa bits (half a step: 2^-4 of the value)
# and its subnormals a step of 2^-9 of the block scale; NVFP4's top e2m1 step is 4 -> 6, half of it
# a sixth of the group's amax, with up to 2^-4 more from rounding the group scale to e4m3
FP8_REL, FP8_SUBNORMAL = 2.0 ** -4, 2.0 ** -10
NVFP4_OF_GROUP_AMAX = (1 + 2.0 ** -4) / 6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny float64 tensors: a second torch thread only waits for a core the machine shares."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    """The float64 originals: a tiny Qwen3-MoE (a dense layer, then routed experts) and the MLA
    family's DeepSeek-V3 (dense layer, routed and shared experts, ragged MLA widths)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    qwen = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**QWEN3_MOE), dtype=torch.float64,
                                            experts_implementation="eager")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in qwen.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            else:  # embeddings unit scale, projections and experts 1 / sqrt(fan_in)
                scale = 1.0 if "embed_tokens" in name or "lm_head" in name else p.shape[-1] ** -0.5
                p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return {"qwen3_moe": qwen.eval(), "deepseek_v3": mla_models.build("deepseek_v3")}


def banded(rows: int, cols: int) -> torch.Tensor:
    """A random matrix whose magnitude grows 4x every 8 rows: one scale for all of it would flush
    the small rows, so only block- or group-local scales pass the per-element bounds."""
    gen = torch.Generator().manual_seed(rows * cols)
    band = 4.0 ** (torch.arange(rows, dtype=torch.float64) // 8)
    return torch.randn(rows, cols, generator=gen, dtype=torch.float64) * band[:, None]


def roundtrip(tmp_path, tensors: dict, quantization_config: dict | None = None) -> dict:
    """Write tensors as a one-file checkpoint directory and read it back with the reference."""
    save_file(tensors, tmp_path / "model.safetensors")
    config = {} if quantization_config is None else {"quantization_config": quantization_config}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return dequantized_state_dict(tmp_path)


def test_fp8_blocks_that_end_mid_matrix_keep_each_element_within_half_an_e4m3_step(tmp_path):
    w = banded(40, 56)  # blocks of 16 x 16: the last block row holds 8 rows, the last column 8
    tensors = _fp8("m.q_proj.weight", w, BLOCK)
    scale = tensors["m.q_proj.weight_scale_inv"]
    assert tensors["m.q_proj.weight"].dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert tuple(scale.shape) == (3, 4)
    assert scale[2, 3] == (w[32:, 48:].abs().max() / 448).float()  # the ragged corner by its own amax
    back = roundtrip(tmp_path, tensors, {"quant_method": "fp8", "weight_block_size": list(BLOCK)})
    assert set(back) == {"m.q_proj.weight"}  # the scale is consumed, not returned
    per_element_scale = scale.double().repeat_interleave(16, 0).repeat_interleave(16, 1)[:40, :56]
    err = (back["m.q_proj.weight"] - w).abs()
    assert (err <= (FP8_REL * w.abs() + FP8_SUBNORMAL * per_element_scale) * (1 + 1e-6)).all()
    block_max = per_element_scale * 448  # hence within 2^-3 of the block's amax as well
    assert err.max() > 0 and (err <= 2.0 ** -3 * block_max * (1 + 1e-6)).all()


def test_nvfp4_values_land_on_the_nearest_point_of_their_groups_grid(tmp_path):
    w = banded(24, 48)  # three groups of 16 a row; the row bands change mid-tensor
    tensors = _nvfp4("m.q_proj.weight", w)
    packed, scale, scale_2 = (tensors[k] for k in ("m.q_proj.weight", "m.q_proj.weight_scale",
                                                   "m.q_proj.weight_scale_2"))
    assert (packed.dtype, tuple(packed.shape)) == (torch.uint8, (24, 24))
    assert (scale.dtype, tuple(scale.shape)) == (torch.float8_e4m3fn, (24, 3))
    assert scale_2.dtype == torch.float32 and scale_2.dim() == 0
    assert scale_2 == (w.abs().max() / (448 * 6)).float()
    back = roundtrip(tmp_path, tensors)["m.q_proj.weight"]
    unit = (scale.double() * scale_2.double()).repeat_interleave(16, 1)  # each element's e2m1 step
    grid = torch.tensor(E2M1, dtype=torch.float64)
    grid = torch.cat([grid, -grid])
    nearest = (w[..., None] - grid * unit[..., None]).abs().min(dim=-1).values
    assert torch.allclose((back - w).abs(), nearest, rtol=0, atol=1e-12)
    group_amax = w.view(24, 3, 16).abs().amax(-1).repeat_interleave(16, 1)
    assert ((back - w).abs() <= NVFP4_OF_GROUP_AMAX * group_amax).all()


def test_nvfp4_packs_the_even_column_into_the_low_nibble(tmp_path):
    """Byte 0x2F holds code 0xF (-6) low and code 0x2 (+1.0) high: column 0 is -6, column 1 is 1."""
    hand = torch.zeros(1, 8, dtype=torch.uint8)
    hand[0, 0] = 0x2F
    back = roundtrip(tmp_path, {"x.weight": hand, "x.weight_scale": torch.ones(1, 1).to(torch.float8_e4m3fn),
                                "x.weight_scale_2": torch.tensor(1.0), "x.input_scale": torch.tensor(1.0)})["x.weight"]
    assert back[0, :3].tolist() == [-6.0, 1.0, 0.0]
    row = torch.zeros(1, 16, dtype=torch.float64)
    row[0, :2] = torch.tensor([-6.0, 1.0])  # amax 6: the group scale is 448, the step exactly 1
    assert _nvfp4("x.weight", row)["x.weight"][0, 0] == 0x2F


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_quantized_directory_loads_into_transformers_and_generates(models, tmp_path, family, fmt, fused):
    """Both families, both formats, both expert layouts: the reference holds the original weights up
    to the format's error, element by element, and everything never quantized bit-exact."""
    original = models[family]
    kept = quantize_checkpoint(original, tmp_path, fmt, block=BLOCK, fused=fused)
    assert "lm_head" in kept and any(name.endswith(".mlp.gate") for name in kept)  # routers stay
    if fmt == "fp8":  # DeepSeek-V3's fields, and the unconverted modules as Qwen3's FP8 releases list them
        assert json.loads((tmp_path / "config.json").read_text())["quantization_config"] == {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16],
            "modules_to_not_convert": kept}
    reference = reference_model(type(original), tmp_path)
    changed = 0
    for (name, ref), orig in zip(reference.state_dict().items(), original.state_dict().values(), strict=True):
        if "embed_tokens" in name or "lm_head" in name or "norm" in name or ".mlp.gate." in name:
            assert torch.equal(ref, orig), name  # never quantized: bit-exact
        # element by element, so a transposed, swapped or misplaced slice (an expert, gate for up)
        # cannot pass; logits are not compared: a tiny random router flips under 2% weight noise
        assert within_format(ref.double(), orig.double(), fmt), name
        changed += not torch.equal(ref, orig)
    assert changed > 0
    assert len(greedy(reference, PROMPT, 6)) == 6


def test_excluded_modules_stay_float64_and_are_listed_where_modelopt_lists_them(models, tmp_path):
    """NVIDIA's GLM-5 NVFP4 layout: only the routed experts quantized. q_b_proj (input 24) would be
    excluded by shape anyway; the dense layer's MLP, the shared experts and attention by pattern."""
    original = models["deepseek_v3"]
    kept = quantize_checkpoint(original, tmp_path, "nvfp4", exclude=ROUTED_EXPERTS_ONLY)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        dtypes = {key: f.get_slice(key).get_dtype() for key in f.keys()}
    assert dtypes["model.layers.1.mlp.experts.3.down_proj.weight"] == "U8"
    for module in ("model.layers.0.mlp.gate_proj", "model.layers.1.mlp.shared_experts.up_proj",
                   "model.layers.1.self_attn.kv_a_proj_with_mqa", "model.layers.2.self_attn.o_proj"):
        assert dtypes[module + ".weight"] == "F64" and module + ".weight_scale" not in dtypes
        assert module in kept
    hf_quant = json.loads((tmp_path / "hf_quant_config.json").read_text())
    assert hf_quant["producer"]["name"] == "modelopt"
    assert hf_quant["quantization"] | {"exclude_modules": None} == {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": None}
    assert hf_quant["quantization"]["exclude_modules"] == kept
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["quant_algo"], config["ignore"]) == ("modelopt", "NVFP4", kept)
    reference = dict(reference_model(original.config, tmp_path).state_dict())  # the config form
    for name, orig in original.state_dict().items():
        if "self_attn" in name or "shared_experts" in name or name.startswith("model.layers.0."):
            assert torch.equal(reference[name], orig), name


def within_format(got: torch.Tensor, want: torch.Tensor, fmt: str) -> bool:
    """Every element within its format's bound, taking the whole tensor's amax for the block's or
    group's (the block scale is at most amax / 448, a group's amax at most the tensor's)."""
    err, amax = (got - want).abs(), want.abs().max()
    if fmt == "fp8":
        return bool((err <= (FP8_REL * want.abs() + FP8_SUBNORMAL * amax / 448) * (1 + 1e-6)).all())
    return bool((err <= NVFP4_OF_GROUP_AMAX * amax).all())


def payload(directory) -> tuple[dict[str, tuple[str, int]], int]:
    """Every tensor's (dtype, bytes) from the safetensors headers, and the bytes the files hold
    beyond their headers (8 bytes of length, then the JSON header)."""
    tensors, data = {}, 0
    for path in directory.glob("*.safetensors"):
        with path.open("rb") as f:
            data += path.stat().st_size - 8 - int.from_bytes(f.read(8), "little")
        with safe_open(path, "pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                size = {"F64": 8, "F32": 4, "F8_E4M3": 1, "U8": 1}[piece.get_dtype()]
                tensors[key] = piece.get_dtype(), size * math.prod(piece.get_shape())
    return tensors, data


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_bytes_on_disk_are_the_packed_weights_and_their_scales(models, tmp_path, fmt):
    """Per quantized [out, in] weight, FP8 holds out*in bytes plus a float32 per 16 x 16 block (the
    ragged ones too): a little over 1/8 of float64; NVFP4 holds out*in/2 bytes, one e4m3 scale per
    16 and two float32 scalars: a little over 1/14."""
    original = models["qwen3_moe"]
    save(original, tmp_path / "f64")
    quantize_checkpoint(original, tmp_path / fmt, fmt, block=BLOCK)
    before, before_data = payload(tmp_path / "f64")
    after, after_data = payload(tmp_path / fmt)
    assert (before_data, after_data) == (sum(b for _, b in before.values()), sum(b for _, b in after.values()))
    with safe_open(tmp_path / "f64" / "model.safetensors", "pt") as f:
        shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}
    expected, quantized_f64 = 0, 0
    for key, (dtype, size) in before.items():
        if after[key][0] == dtype:  # kept as it was
            expected += size
            continue
        (rows, cols), quantized_f64 = shapes[key], quantized_f64 + size
        if fmt == "fp8":
            expected += rows * cols + 4 * -(-rows // 16) * -(-cols // 16)
        else:
            expected += rows * cols // 2 + rows * cols // 16 + 4 + 4
    assert after_data == expected
    quantized_now = after_data - (before_data - quantized_f64)
    assert quantized_now / quantized_f64 < {"fp8": 0.14, "nvfp4": 0.075}[fmt]
    # the files shrink by as much, but for their JSON headers: under 200 bytes per added scale tensor
    headers_before = checkpoint_bytes(tmp_path / "f64") - before_data
    grown = checkpoint_bytes(tmp_path / fmt) - headers_before - expected
    assert 0 <= grown <= 200 * (len(after) - len(before))
