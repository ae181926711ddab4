"""The layer shapes bench/gpu_check.sh measures, and the `talaria profile` configs it writes for them.

    python bench/gpu_shapes.py config SHAPE --device cuda|cpu [--tiny] --out FILE.toml

Two shapes, each as a few layers of its model (the per-layer costs are the point, not the model):

* ``8b-dense``: Llama-3-8B's layer (hidden 4096, MLP 14336, 32 query / 8 KV heads of 128);
* ``30b-a3b-moe``: Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 KV heads of 128, q/k norm,
  128 experts of width 768, top-8 with normalised weights).

Layer sets that `talaria profile` does not take (a hybrid's, an MLA model's) are below, for
bench/layer_floor.py only. ``--tiny`` gives the same families at toy sizes, for ``gpu_check.sh
--dry-run`` on a CPU. The
vocabulary is cut to 32000 in the profile configs (Llama-3 has 128256): a synthetic model is
written to the model cache before it is loaded, and its embedding is not what is being measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from talaria.config.schema import SyntheticShape

LAYERS = 4  # a few layers: the per-layer figures are a total / LAYERS
PROFILE_LAYERS = 2  # `talaria profile` generates and writes its models to disk first: keep them small
PROFILE_VOCAB = 32000

SHAPES = {
    "8b-dense": SyntheticShape(hidden_size=4096, intermediate_size=14336, num_layers=LAYERS, num_heads=32,
                               num_kv_heads=8, head_dim=128, vocab_size=PROFILE_VOCAB, max_position=8192,
                               family="llama"),
    "30b-a3b-moe": SyntheticShape(hidden_size=2048, intermediate_size=6144, num_layers=LAYERS, num_heads=32,
                                  num_kv_heads=4, head_dim=128, vocab_size=PROFILE_VOCAB, max_position=8192,
                                  family="qwen3_moe", num_experts=128, num_experts_per_tok=8,
                                  moe_intermediate_size=768),
}
TINY = {
    "8b-dense": SyntheticShape(hidden_size=64, intermediate_size=224, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=16, vocab_size=320, max_position=512, family="llama"),
    "30b-a3b-moe": SyntheticShape(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                                  head_dim=16, vocab_size=320, max_position=512, family="qwen3_moe",
                                  num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24),
}
DTYPE = {"cuda": "bfloat16", "cpu": "float32"}

# Layer sets of hybrid models, measured by bench/layer_floor.py only (a hybrid is not a synthetic
# family, so `talaria profile` does not take them): ModelArch fields. Qwen3.5-122B-A10B's: hidden
# 3072, gated attention of 32 heads of 256 (2 KV heads, a quarter rotated), Gated DeltaNet of 16
# key / 64 value heads of 128, 256 experts of width 1024 top-8 and a shared expert of 1024 — from
# public descriptions of the checkpoint (its config.json could not be read here; the expert width is
# what 122B parameters over 48 such layers implies); 3 DeltaNet layers and 1 attention layer.
_QWEN35 = {"family": "qwen3_5_moe", "layer_types": ("linear_attention",) * 3 + ("full_attention",),
           "partial_rotary_factor": 0.25, "attn_output_gate": True, "norm_offset": 1.0, "qk_norm": True,
           "norm_topk_prob": True, "linear_conv_kernel_dim": 4, "num_layers": 4}
HYBRID = {"qwen3.5-122b-layers": _QWEN35 | {
    "vocab_size": PROFILE_VOCAB, "hidden_size": 3072, "intermediate_size": 0, "num_heads": 32, "num_kv_heads": 2,
    "head_dim": 256, "max_position": 8192, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024, "linear_num_key_heads": 16,
    "linear_num_value_heads": 64, "linear_key_head_dim": 128, "linear_value_head_dim": 128}}
TINY_HYBRID = {"qwen3.5-122b-layers": _QWEN35 | {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 0, "num_heads": 4, "num_kv_heads": 2,
    "head_dim": 16, "max_position": 512, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 24, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8}}


# GLM-5 (glm_moe_dsa) as its hub config.json gives it, the keys Talaria reads (the values as issue
# 29's brief quotes them; the file was not read from here): MLA of 64 heads (q_lora 2048, latent 512,
# rope 64, nope 192, v 256), the sparse-attention indexer of 32 heads of 128 choosing 2,048 tokens,
# 256 experts of width 2048 top-8 and one shared expert after 3 dense layers. bench/mla_decode.py
# sizes its cache from it; its layer set below is 2 MoE layers of it.
GLM5 = {"model_type": "glm_moe_dsa", "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
        "num_hidden_layers": 78, "num_attention_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256, "index_topk": 2048,
        "index_n_heads": 32, "index_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048, "n_shared_experts": 1, "first_k_dense_replace": 3,
        "max_position_embeddings": 202752}
# Layer sets of MLA models, measured by bench/layer_floor.py only (no synthetic family either): HF
# config.json values, read by ModelArch.from_hf_config as a checkpoint's are. The tiny set keeps the
# indexer's index_topk below the dry run's contexts, so its scoring runs there too.
MLA = {"glm5-layers": GLM5 | {"num_hidden_layers": 2, "first_k_dense_replace": 0, "vocab_size": PROFILE_VOCAB,
                              "max_position_embeddings": 8192}}
TINY_MLA = {"glm5-layers": GLM5 | {
    "num_hidden_layers": 2, "first_k_dense_replace": 0, "vocab_size": 320, "max_position_embeddings": 512,
    "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 12, "index_topk": 8, "index_n_heads": 4,
    "index_head_dim": 16, "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 24}}


def hybrid_arch(name: str, tiny: bool):
    """The ModelArch of hybrid layer set `name` (bench/layer_floor.py)."""
    from talaria.contracts.arch import ModelArch
    return ModelArch(**(TINY_HYBRID if tiny else HYBRID)[name])


def mla_arch(name: str, tiny: bool):
    """The ModelArch of MLA layer set `name` (bench/layer_floor.py), read from its config.json values."""
    from talaria.contracts.arch import ModelArch
    return ModelArch.from_hf_config((TINY_MLA if tiny else MLA)[name])


def shape(name: str, tiny: bool) -> SyntheticShape:
    table = TINY if tiny else SHAPES
    if name not in table:
        raise SystemExit(f"unknown shape {name!r}; use one of: {', '.join(table)}")
    return table[name]


def profile_config(name: str, device: str, tiny: bool) -> str:
    """A talaria.toml with one hot instance serving `name` at PROFILE_LAYERS layers, for `talaria profile`."""
    s = shape(name, tiny)
    fields = {k: getattr(s, k) for k in SyntheticShape.__dataclass_fields__}
    fields["num_layers"] = min(s.num_layers, PROFILE_LAYERS)
    if s.family not in ("qwen3_moe", "qwen2_moe"):
        for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "decoder_sparse_step"):
            fields.pop(k, None)
    lines = [f"{k} = {_toml(v)}" for k, v in fields.items() if v is not None]
    arena = "1GiB" if tiny else "40GiB"
    host_kv = "64MiB" if tiny else "4GiB"
    return "\n".join([
        f"# {name} layer shapes for `talaria profile` (written by bench/gpu_shapes.py; see docs/gpu.md)",
        "[[models]]", f'name = "{name}"', 'source = "synthetic:"', f'dtype = "{DTYPE[device]}"', "seed = 0",
        "[models.shape]", *lines, "",
        "[[instances]]", 'name = "layers"', 'pool = "hot"', f'models = ["{name}"]', "tp = 1",
        f'device = "{device}"', f'arena_bytes = "{arena}"', f'host_kv_bytes = "{host_kv}"',
        "max_batch_tokens = 2048", "",
    ])


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    cfg = sub.add_parser("config", help="write a `talaria profile` config for one shape")
    cfg.add_argument("shape", choices=sorted(SHAPES))
    cfg.add_argument("--device", choices=sorted(DTYPE), required=True)
    cfg.add_argument("--tiny", action="store_true", help="toy sizes (gpu_check.sh --dry-run)")
    cfg.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(profile_config(args.shape, args.device, args.tiny))
    return 0


if __name__ == "__main__":
    sys.exit(main())
