"""The architecture of a Llama-family model, independent of where its weights come from.

One frozen record that the config validator, the gateway (context length, special tokens) and the
engine (shapes, RoPE, norms, experts) all read. It round-trips through a Hugging Face
``config.json`` so a converted model directory is a plain HF directory.

Mixture-of-Experts models (Qwen2-MoE, Qwen3-MoE) are the same decoder with some layers' MLP
replaced by a routed set of experts (docs/moe.md); ``num_experts == 0`` means a dense model.

Hybrid models (Qwen3-Next, Qwen3.5-MoE) interleave Gated DeltaNet layers (linear attention with a
per-sequence recurrent state: ``layer_types``, the ``linear_*`` fields) with gated full-attention
layers (a sigmoid output gate, partial RoPE), and use zero-centred RMSNorms (weight 1 + w).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                    "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_moe")  # Gated DeltaNet layers between gated attention layers
FAMILIES = tuple(f for f in HF_ARCHITECTURES if f not in HYBRID_FAMILIES)  # families synthetic models may have
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", *HYBRID_FAMILIES)
# config.json model_type values the engine reads; a Qwen3.5 checkpoint's text model is "qwen3_5_moe_text"
# (the text-only one) or the "text_config" of a "qwen3_5_moe" (the vision-language one)
HF_MODEL_TYPES = ("llama", "mistral", *FAMILIES[1:], *HYBRID_FAMILIES, "qwen3_5_moe_text")
HF_MODEL_TYPE = {"qwen3_5_moe": "qwen3_5_moe_text"}  # family -> the model_type its to_hf_config writes

# model types people will try, and why the engine cannot run them (the refusal says so)
UNSUPPORTED_MODEL_TYPES = {
    "glm_moe_dsa": "GLM-5 uses multi-head latent attention (MLA) and DeepSeek sparse attention (DSA), "
                   "which the engine does not implement",
    "qwen3_5": "dense Qwen3.5 is not served yet (its MoE sibling qwen3_5_moe is)",
    "qwen3_5_text": "dense Qwen3.5 is not served yet (its MoE sibling qwen3_5_moe is)",
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
    family: str = "llama"  # one of FAMILIES or HYBRID_FAMILIES
    num_experts: int = 0  # routed experts per MoE layer; 0 = a dense model
    num_experts_per_tok: int = 0  # top-k: experts each token is routed to
    moe_intermediate_size: int = 0  # each routed expert's MLP width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert behind a sigmoid gate; 0 = none
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (those stay dense)
    # hybrid families: "linear_attention" (Gated DeltaNet) or "full_attention" per layer; () = all full
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0  # DeltaNet query/key heads
    linear_num_value_heads: int = 0  # DeltaNet value heads (a multiple of the key heads)
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0  # the depthwise causal convolution's width
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * this dims of a head
    attn_output_gate: bool = False  # q_proj also yields a gate: o_proj(attention * sigmoid(gate))
    norm_offset: float = 0.0  # RMSNorm weight is (offset + w): 1 for zero-centred norms

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_hybrid(self) -> bool:
        return self.family in HYBRID_FAMILIES

    def is_linear_layer(self, layer: int) -> bool:
        """Whether `layer` is a Gated DeltaNet (linear-attention) layer, else full attention."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def rotary_dim(self) -> int:
        """Dims of a head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is routed experts (HF Qwen2-/Qwen3-MoE's rule), else dense."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def param_count(self) -> int:
        """Parameters as stored (tied embeddings counted once; every expert, not only the active ones)."""
        q = self.q_size * (2 if self.attn_output_gate else 1)
        attn = self.hidden_size * (q + 2 * self.kv_size) + self.q_size * self.hidden_size
        if self.attention_bias:
            attn += q + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        h = self.hidden_size
        kd, vd, vh = self.linear_key_dim, self.linear_value_dim, self.linear_num_value_heads
        conv = 2 * kd + vd
        linear = h * (conv + vd + 2 * vh) + conv * self.linear_conv_kernel_dim + 2 * vh + \
            self.linear_value_head_dim + vd * h  # in_proj_qkv, z, b, a; conv; dt_bias, A_log; norm; out_proj
        mixers = sum(linear if self.is_linear_layer(i) else attn for i in range(self.num_layers))
        dense = 3 * h * self.intermediate_size
        moe = self.num_experts * (h + 3 * h * self.moe_intermediate_size)  # router row + expert
        if self.shared_expert_intermediate_size:
            moe += 3 * h * self.shared_expert_intermediate_size + h  # shared expert + its gate
        mlps = sum(moe if self.is_moe_layer(i) else dense for i in range(self.num_layers))
        emb = self.vocab_size * h
        return mixers + self.num_layers * 2 * h + mlps + emb * (1 if self.tie_word_embeddings else 2) + h

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        """The architecture of a HF config.json; UnsupportedArchitecture for a model_type we cannot run."""
        model_type = cfg.get("model_type", "llama")
        why = unsupported_reason(model_type)
        if why:
            raise UnsupportedArchitecture(why)
        if model_type == "qwen3_5_moe":  # the vision-language checkpoint: its text model is "text_config"
            text = cfg.get("text_config") or {}
            # the outer config decides the tying, as transformers' ForConditionalGeneration does
            cfg = text | {"tie_word_embeddings": cfg.get("tie_word_embeddings", False), "model_type": model_type}
        family = "qwen3_5_moe" if model_type == "qwen3_5_moe_text" else model_type
        hybrid = family in HYBRID_FAMILIES
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta")
        partial = cfg.get("partial_rotary_factor", 0.25 if hybrid else 1.0)  # transformers' defaults
        if isinstance(scaling, dict):
            theta = scaling.get("rope_theta", theta)
            partial = scaling.get("partial_rotary_factor", partial)
            scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
            if scaling.get("rope_type", scaling.get("type", "default")) == "default":
                scaling = None
        moe = family in MOE_FAMILIES
        layer_types = ()
        if hybrid:  # hub configs may give only the interval: every interval-th layer attends
            every = cfg.get("full_attention_interval", 4)
            layer_types = tuple(cfg.get("layer_types") or ("full_attention" if (i + 1) % every == 0 else "linear_attention"
                                                           for i in range(cfg["num_hidden_layers"])))
        # Qwen2-MoE names its q/k/v bias "qkv_bias"; transformers 5 writes Qwen3-MoE's expert count
        # as "num_local_experts"
        bias = cfg.get("qkv_bias", True) if model_type == "qwen2_moe" else \
            cfg.get("attention_bias", model_type == "qwen2")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0) if hybrid else cfg["intermediate_size"],
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
            qk_norm=family in ("qwen3", "qwen3_moe", *HYBRID_FAMILIES),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            family=family if family in HF_ARCHITECTURES else "llama",
            num_experts=(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if moe else 0,
            num_experts_per_tok=cfg["num_experts_per_tok"] if moe else 0,
            moe_intermediate_size=cfg["moe_intermediate_size"] if moe else 0,
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0)
            if family in ("qwen2_moe", *HYBRID_FAMILIES) else 0,
            # Qwen3.5-MoE always renormalises the top-k weights (its config has no such key)
            # the hybrids renormalise unless told otherwise; Qwen3.5-MoE's layers are all MoE (it has no such keys)
            norm_topk_prob=bool(cfg.get("norm_topk_prob", hybrid)) if moe else False,
            decoder_sparse_step=1 if family == "qwen3_5_moe" else cfg.get("decoder_sparse_step") or 1,
            mlp_only_layers=() if family == "qwen3_5_moe" else tuple(cfg.get("mlp_only_layers") or ()),
            layer_types=layer_types,
            linear_num_key_heads=cfg.get("linear_num_key_heads", 0) if hybrid else 0,
            linear_num_value_heads=cfg.get("linear_num_value_heads", 0) if hybrid else 0,
            linear_key_head_dim=cfg.get("linear_key_head_dim", 0) if hybrid else 0,
            linear_value_head_dim=cfg.get("linear_value_head_dim", 0) if hybrid else 0,
            linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 0) if hybrid else 0,
            partial_rotary_factor=float(partial),
            attn_output_gate=hybrid,
            norm_offset=1.0 if hybrid else 0.0,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json that transformers loads as the same model."""
        cfg: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURES[self.family]],
            "model_type": HF_MODEL_TYPE.get(self.family, self.family),
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
        if self.family in HYBRID_FAMILIES:
            cfg |= {"shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                    "layer_types": list(self.layer_types),
                    "linear_num_key_heads": self.linear_num_key_heads,
                    "linear_num_value_heads": self.linear_num_value_heads,
                    "linear_key_head_dim": self.linear_key_head_dim,
                    "linear_value_head_dim": self.linear_value_head_dim,
                    "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
                    "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                        "partial_rotary_factor": self.partial_rotary_factor}}
        return cfg
