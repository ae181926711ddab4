"""The architecture of a Llama-family model, independent of where its weights come from.

One frozen record that the config validator, the gateway (context length, special tokens) and the
engine (shapes, RoPE, norms, experts) all read. It round-trips through a Hugging Face
``config.json`` so a converted model directory is a plain HF directory.

Mixture-of-Experts models (Qwen2-MoE, Qwen3-MoE) are the same decoder with some layers' MLP
replaced by a routed set of experts (docs/moe.md); ``num_experts == 0`` means a dense model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
FAMILIES = tuple(HF_ARCHITECTURES)  # the model families the engine runs
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")
HF_MODEL_TYPES = ("llama", "mistral", *FAMILIES[1:])  # config.json model_type values the engine reads

# model types people will try, and why the engine cannot run them (the refusal says so)
_DELTANET = "Gated DeltaNet (linear-attention) layers, which the engine does not implement"
UNSUPPORTED_MODEL_TYPES = {
    "glm_moe_dsa": "GLM-5 uses multi-head latent attention (MLA) and DeepSeek sparse attention (DSA), "
                   "which the engine does not implement",
    "qwen3_5": f"Qwen3.5 interleaves {_DELTANET}",
    "qwen3_5_text": f"Qwen3.5 interleaves {_DELTANET}",
    "qwen3_5_moe": f"Qwen3.5-MoE (e.g. Qwen3.5-122B-A10B) interleaves {_DELTANET}",
    "qwen3_5_moe_text": f"Qwen3.5-MoE (e.g. Qwen3.5-122B-A10B) interleaves {_DELTANET}",
    "qwen3_next": f"Qwen3-Next interleaves {_DELTANET}",
    "deepseek_v3": "DeepSeek-V3 uses multi-head latent attention (MLA), which the engine does not implement",
    "deepseek_v32": "DeepSeek-V3.2 uses multi-head latent attention (MLA) and DeepSeek sparse attention (DSA), "
                    "which the engine does not implement",
}


class UnsupportedArchitecture(ValueError):
    """A config.json the engine cannot run; the message says why and what it runs instead."""


def unsupported_reason(model_type: str) -> str | None:
    """Why the engine cannot run `model_type` (None when it can)."""
    if model_type in HF_MODEL_TYPES:
        return None
    why = UNSUPPORTED_MODEL_TYPES.get(model_type)
    served = f"Talaria serves {', '.join(HF_MODEL_TYPES)} models (docs/moe.md)"
    return f"model_type {model_type!r} is not supported: {why}; {served}" if why else \
        f"model_type {model_type!r} is not supported; {served}"


@dataclass(frozen=True, slots=True)
class ModelArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (the dense layers of an MoE model)
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when fewer than num_heads)
    head_dim: int
    max_position: int  # context length in tokens
    rope_theta: float = 10000.0
    # HF "rope_scaling"/"rope_parameters" dict without "rope_theta"; None = plain RoPE
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    family: str = "llama"  # one of FAMILIES
    num_experts: int = 0  # routed experts per MoE layer; 0 = a dense model
    num_experts_per_tok: int = 0  # top-k: experts each token is routed to
    moe_intermediate_size: int = 0  # each routed expert's MLP width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert behind a sigmoid gate; 0 = none
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (those stay dense)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is routed experts (HF Qwen2-/Qwen3-MoE's rule), else dense."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def param_count(self) -> int:
        """Parameters as stored (tied embeddings counted once; every expert, not only the active ones)."""
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        h = self.hidden_size
        dense = 3 * h * self.intermediate_size
        moe = self.num_experts * (h + 3 * h * self.moe_intermediate_size)  # router row + expert
        if self.shared_expert_intermediate_size:
            moe += 3 * h * self.shared_expert_intermediate_size + h  # shared expert + its gate
        mlps = sum(moe if self.is_moe_layer(i) else dense for i in range(self.num_layers))
        emb = self.vocab_size * h
        return self.num_layers * (attn + 2 * h) + mlps + emb * (1 if self.tie_word_embeddings else 2) + h

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        """The architecture of a HF config.json; UnsupportedArchitecture for a model_type we cannot run."""
        model_type = cfg.get("model_type", "llama")
        why = unsupported_reason(model_type)
        if why:
            raise UnsupportedArchitecture(why)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta")
        if isinstance(scaling, dict):
            theta = scaling.get("rope_theta", theta)
            scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
            if scaling.get("rope_type", scaling.get("type", "default")) == "default":
                scaling = None
        moe = model_type in MOE_FAMILIES
        # Qwen2-MoE names its q/k/v bias "qkv_bias"; transformers 5 writes Qwen3-MoE's expert count
        # as "num_local_experts"
        bias = cfg.get("qkv_bias", True) if model_type == "qwen2_moe" else \
            cfg.get("attention_bias", model_type == "qwen2")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position=cfg.get("max_position_embeddings", 4096),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=scaling or None,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            family=model_type if model_type in FAMILIES else "llama",
            num_experts=(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if moe else 0,
            num_experts_per_tok=cfg["num_experts_per_tok"] if moe else 0,
            moe_intermediate_size=cfg["moe_intermediate_size"] if moe else 0,
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0)
            if model_type == "qwen2_moe" else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) if moe else False,
            decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json that transformers loads as the same model."""
        cfg: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else
            (self.eos_token_ids[0] if self.eos_token_ids else None),
        }
        if self.family in MOE_FAMILIES:
            cfg |= {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers),
            }
        if self.family == "qwen2_moe":
            cfg |= {"qkv_bias": self.attention_bias,
                    "shared_expert_intermediate_size": self.shared_expert_intermediate_size}
        return cfg
