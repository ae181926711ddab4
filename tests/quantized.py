"""Quantized checkpoints for the tests: tiny float64 transformers models written as real FP8
block-scaled (DeepSeek-V3 layout) or NVFP4 (NVIDIA ModelOpt layout) checkpoint directories, and an
independent float64 reference for each.

`quantize_checkpoint` saves a model the way tests/hybrid_models.py's `save` does (safetensors, config
and the byte tokenizer), then rewrites the projection weights in the format and adds the config
entries the real checkpoints carry. `dequantized_state_dict` reads a directory back to float64 with
the formats' published formulas in a few lines that share nothing with the quantizer but the e2m1
table, and `reference_model` loads that into transformers, so its greedy `generate` is what the
engine must reproduce with the quantized weights and float64 compute.

What is quantized follows the released checkpoints: the 2-D projections of attention, MLP, routed and
shared experts and the DSA indexer's wq_b / wk (DeepSeek-V3's FP8 `Linear`s); never embeddings,
lm_head, norms, routers (`mlp.gate`), biases, `e_score_correction_bias` or the indexer's
`weights_proj`. transformers 5 saves experts per expert (`experts.{e}.gate_proj.weight`) by default;
with `fused=True` it saves one `experts.gate_up_proj` / `experts.down_proj` [E, out, in] tensor
each, quantized per expert slice with the expert dimension leading on data and scales.

Tensors written, for a weight `X.weight` [out, in] (fused experts: `P.experts.gate_up_proj` and
`P.experts.gate_up_proj_scale_inv`, `P.experts.gate_up_proj_weight_scale`, ... with a leading E):
- fp8: `X.weight` float8_e4m3fn [out, in]; `X.weight_scale_inv` float32 [ceil(out/B0), ceil(in/B1)];
  W[i, j] = fp8[i, j] * s[i // B0, j // B1]. A ragged edge block is scaled by its own amax, as if
  zero-padded to the full block (DeepSeek-V3's README_WEIGHTS.md).
- nvfp4: `X.weight` uint8 [out, in / 2], two e2m1 codes a byte, the even column in the low nibble;
  `X.weight_scale` float8_e4m3fn [out, in / 16]; `X.weight_scale_2` float32 [] (global);
  `X.input_scale` float32 [] (the activation scale FP4 GEMMs use; weight-only dequantization ignores
  it); W[o, i] = e2m1 * weight_scale[o, i // 16] * weight_scale_2. `in` must be a multiple of 16: a
  projection whose input width is not stays float64 and is listed in `exclude_modules`.
"""

from __future__ import annotations

import copy
import json
from fnmatch import fnmatch
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.hybrid_models import save

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 codes 0..7; bit 3 of a code is the sign
E4M3_MAX = 448.0  # the largest float8_e4m3fn
NVFP4_GROUP = 16  # ModelOpt's NVFP4 group: one e4m3 scale per 16 consecutive input columns
PROJECTIONS = frozenset({  # the last name of every module whose 2-D weight is quantized
    "q_proj", "k_proj", "v_proj", "o_proj",  # attention
    "gate_proj", "up_proj", "down_proj",  # dense MLP, routed and shared experts
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",  # MLA
    "wq_b", "wk",  # the DSA indexer (its weights_proj stays unquantized, as DeepSeek-V3.2 ships it)
})
# `exclude` patterns that quantize only the routed experts, as NVIDIA's GLM-5 NVFP4 checkpoints do:
# attention (and its indexer), shared experts and the dense layers' MLPs stay unquantized
ROUTED_EXPERTS_ONLY = ("*.self_attn.*", "*.shared_expert*", "*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj")
FORMATS = ("fp8", "nvfp4")


def quantize_checkpoint(model, directory: Path, fmt: str, *, block: tuple[int, int] = (128, 128),
                        exclude: tuple[str, ...] = (), fused: bool = False) -> list[str]:
    """Write `model` (float64) into `directory` as a `fmt` checkpoint ("fp8" or "nvfp4") and return
    the names of the modules left unquantized (lm_head, routers, `exclude` matches, and for nvfp4
    the projections whose input width is not a multiple of 16). `block` is FP8's [B0, B1]
    (`weight_block_size`); `exclude` holds fnmatch patterns over module names
    (`model.layers.0.self_attn.q_proj`; fused experts by tensor name). `fused` writes transformers
    5's fused expert tensors instead of one tensor per expert."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}; use one of: {', '.join(FORMATS)}")
    directory = Path(directory)
    save(model, directory)
    if fused:  # overwrite save_pretrained's files with its fused-expert layout
        model.save_pretrained(directory, save_original_format=False)
    kept: list[str] = []
    for path in sorted(directory.glob("*.safetensors")):
        out = {}
        for key, weight in load_file(path).items():
            module = key.removesuffix(".weight")
            if not _projection(key, weight):
                out[key] = weight
                if weight.dim() == 2 and key.endswith(".weight") and "embed_tokens" not in key:
                    kept.append(module)  # lm_head, routers, weights_proj: linear, never quantized
            elif any(fnmatch(module, p) for p in exclude) or (fmt == "nvfp4" and weight.shape[-1] % NVFP4_GROUP):
                out[key] = weight
                kept.append(module)
            else:
                out |= _fp8(key, weight, block) if fmt == "fp8" else _nvfp4(key, weight)
        save_file(out, path, metadata={"format": "pt"})
    _reindex(directory)
    _write_config(directory, fmt, block, sorted(kept))
    return sorted(kept)


def _projection(key: str, weight: torch.Tensor) -> bool:
    """A per-module projection weight, or transformers 5's fused [E, out, in] expert tensor."""
    parts = key.split(".")
    if weight.dim() == 2:
        return parts[-1] == "weight" and parts[-2] in PROJECTIONS
    return weight.dim() == 3 and len(parts) > 1 and parts[-2] == "experts"


def _stem(key: str) -> str:
    """The prefix of a weight's scale tensors: `X.` for `X.weight` (`X.weight_scale`), `K_` for a
    fused expert tensor K (`K_weight_scale`, ModelOpt's naming for a weight not called `weight`)."""
    return key.removesuffix("weight") if key.endswith(".weight") else key + "_"


def _fp8(key: str, weight: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """FP8 block-scaled: s = amax(block) / 448 per [B0, B1] block, fp8 = W / s in e4m3."""
    b0, b1 = block
    *lead, rows, cols = weight.shape
    r, c = -(-rows // b0), -(-cols // b1)
    padded = weight.new_zeros(*lead, r * b0, c * b1)
    padded[..., :rows, :cols] = weight  # the ragged edge blocks are zero-padded, as DeepSeek-V3 does
    blocks = padded.view(*lead, r, b0, c, b1)
    scale = (blocks.abs().amax(dim=(-3, -1)) / E4M3_MAX).to(torch.float32)  # (..., r, c)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).double()[..., :, None, :, None]
    data = (blocks / divisor).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # divided by the stored scale
    data = data.view(*lead, r * b0, c * b1)[..., :rows, :cols].contiguous()
    return {key: data, key + "_scale_inv": scale}


def _nvfp4(key: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """NVFP4 as ModelOpt exports it: a global scale amax(W) / (448 * 6) per weight (per expert for
    a fused tensor), an e4m3 scale per group of 16 so that the group's amax lands on 6, and each
    value rounded to the nearest e2m1."""
    *lead, rows, cols = weight.shape
    scale_2 = (weight.abs().amax(dim=(-2, -1)) / (E4M3_MAX * 6)).to(torch.float32)  # (...)
    global_unit = torch.where(scale_2 > 0, scale_2, torch.ones_like(scale_2)).double()[..., None, None]
    groups = weight.view(*lead, rows, cols // NVFP4_GROUP, NVFP4_GROUP)
    scale = groups.abs().amax(dim=-1) / 6 / global_unit  # (..., rows, cols / 16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: 1, as ModelOpt
    scale = scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    unit = scale.double() * global_unit  # the step each group's codes are counted in
    scaled = (groups / unit[..., None]).view(*lead, rows, cols)
    codes = _e2m1_codes(scaled)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # even column in the low nibble
    stem = _stem(key)
    return {key: packed, stem + "weight_scale": scale, stem + "weight_scale_2": scale_2,
            stem + "input_scale": torch.full_like(scale_2, 1 / (E4M3_MAX * 6))}  # as if activations' amax were 1


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The nearest e2m1 code of every value; magnitudes above 6 saturate, and one exactly halfway
    takes the smaller magnitude (random float64 weights never tie, so no rounding rule is copied)."""
    values = torch.tensor(E2M1, dtype=torch.float64)
    midpoints = (values[1:] + values[:-1]) / 2  # 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
    code = torch.bucketize(x.abs(), midpoints)
    return (code | ((x < 0).long() << 3)).to(torch.uint8)


def _reindex(directory: Path) -> None:
    """A sharded checkpoint's index names every tensor's file: rebuild it from the rewritten files."""
    index = directory / "model.safetensors.index.json"
    if not index.exists():
        return
    weight_map = {}
    for path in sorted(directory.glob("*.safetensors")):
        weight_map |= dict.fromkeys(load_file(path), path.name)
    data = json.loads(index.read_text())
    data["weight_map"] = weight_map
    index.write_text(json.dumps(data, indent=2))


def _write_config(directory: Path, fmt: str, block: tuple[int, int], kept: list[str]) -> None:
    """config.json's `quantization_config` (and for NVFP4 `hf_quant_config.json`) as the released
    checkpoints write them: DeepSeek-V3's FP8 fields, with Qwen3-FP8's `modules_to_not_convert`;
    ModelOpt's `hf_quant_config.json` and the compressed-tensors-style copy its exporter puts in
    config.json (`ignore` there is `exclude_modules`)."""
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    if fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(block), "modules_to_not_convert": kept}
    else:
        producer = {"name": "modelopt"}
        hf_quant = {"producer": producer, "quantization": {
            "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": NVFP4_GROUP, "exclude_modules": kept}}
        (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4))
        fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP}
        config["quantization_config"] = {
            "config_groups": {"group_0": {"input_activations": fp4, "weights": fp4, "targets": ["Linear"]}},
            "ignore": kept, "quant_algo": "NVFP4", "producer": producer, "quant_method": "modelopt"}
    config_path.write_text(json.dumps(config, indent=2))


def dequantized_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory in float64, quantized weights dequantized by the
    formats' formulas (FP8: fp8 * scale_inv per block; NVFP4: e2m1 * weight_scale * weight_scale_2),
    scale tensors dropped. Written from the format descriptions, not from the quantizer above."""
    directory = Path(directory)
    raw = {}
    for path in sorted(directory.glob("*.safetensors")):
        raw |= load_file(path)
    quantization = json.loads((directory / "config.json").read_text()).get("quantization_config", {})
    table = torch.tensor(E2M1, dtype=torch.float64)
    out = {}
    for key, t in raw.items():
        stem = key.removesuffix("weight") if key.endswith(".weight") else key + "_"
        if key.endswith(("_scale_inv", "weight_scale", "weight_scale_2", "input_scale")):
            continue
        if key + "_scale_inv" in raw:  # FP8: every [B0, B1] block times its scale
            b0, b1 = quantization["weight_block_size"]
            s = raw[key + "_scale_inv"].double().repeat_interleave(b0, -2).repeat_interleave(b1, -1)
            out[key] = t.double() * s[..., :t.shape[-2], :t.shape[-1]]
        elif stem + "weight_scale" in raw:  # NVFP4: the low nibble is the even column
            codes = torch.stack([t & 15, t >> 4], dim=-1).flatten(-2).long()
            values = table[codes & 7] * (1 - 2 * (codes >> 3))
            group = values.shape[-1] // raw[stem + "weight_scale"].shape[-1]
            out[key] = (values * raw[stem + "weight_scale"].double().repeat_interleave(group, -1)
                        * raw[stem + "weight_scale_2"].double()[..., None, None])
        else:
            out[key] = t.double()
    return out


def reference_model(model_class_or_config, directory: Path):
    """A transformers float64 model (eager experts) holding `dequantized_state_dict(directory)`: the
    reference for the quantized checkpoint. `model_class_or_config` is the model class (its config
    read from the directory) or a config. The weights go through `from_pretrained(state_dict=...)`,
    which maps the per-expert names on disk to transformers 5's fused parameters (a plain
    `load_state_dict` cannot); any missing, unexpected or mis-shaped key is an error, as strict
    loading would make it."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, PretrainedConfig

    directory = Path(directory)
    if isinstance(model_class_or_config, PretrainedConfig):  # the class AutoModelForCausalLM would pick
        config = copy.deepcopy(model_class_or_config)
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    else:
        model_class = model_class_or_config
        config = model_class.config_class.from_pretrained(directory)
    if hasattr(config, "quantization_config"):  # the weights are plain float64 now
        delattr(config, "quantization_config")
    model, info = model_class.from_pretrained(None, config=config, state_dict=dequantized_state_dict(directory),
                                              dtype=torch.float64, experts_implementation="eager",
                                              output_loading_info=True)
    problems = {kind: keys for kind, keys in info.items() if keys}
    if problems:
        raise RuntimeError(f"{directory}: the dequantized weights do not fit {model_class.__name__}: {problems}")
    return model.eval()


def checkpoint_bytes(directory: Path) -> int:
    """The bytes of a directory's safetensors files: what a loader reads and an arena holds."""
    return sum(path.stat().st_size for path in Path(directory).glob("*.safetensors"))
