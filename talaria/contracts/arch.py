"""The architecture of a Llama-family model, independent of where its weights come from.

One frozen record that the config validator, the gateway (context length, special tokens) and the
engine (shapes, RoPE, norms, experts) all read. It round-trips through a Hugging Face
``config.json`` so a converted model directory is a plain HF directory.

Mixture-of-Experts models (Qwen2-MoE, Qwen3-MoE) are the same decoder with some layers' MLP
replaced by a routed set of experts (docs/moe.md); ``num_experts == 0`` means a dense model.

Hybrid models (Qwen3-Next, Qwen3.5-MoE) interleave Gated DeltaNet layers (linear attention with a
per-sequence recurrent state: ``layer_types``, the ``linear_*`` fields) with gated full-attention
layers (a sigmoid output gate, partial RoPE), and use zero-centred RMSNorms (weight 1 + w).

MLA families (DeepSeek-V3, GLM-5) replace attention by multi-head latent attention (``kv_lora_rank``
and the ``qk_*`` / ``v_head_dim`` fields; docs/models.md): keys and values come from one shared
latent, so ``head_dim`` is a query/key head's nope + rope dims and every head is its own KV head.
GLM-5 adds DeepSeek sparse attention, an indexer that picks each query's ``index_topk`` tokens
(``indexer_types``). Their MoE routes by sigmoid scores with a selection bias, inside groups
(``router_scoring``, ``n_group``, ``topk_group``), and its shared experts are ungated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                    "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
                    "deepseek_v3": "DeepseekV3ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_moe")  # Gated DeltaNet layers between gated attention layers
MLA_FAMILIES = ("deepseek_v3", "glm_moe_dsa")  # multi-head latent attention (GLM-5: with a sparse indexer)
# families synthetic models may have (the others are tested on tiny models transformers builds)
FAMILIES = tuple(f for f in HF_ARCHITECTURES if f not in HYBRID_FAMILIES + MLA_FAMILIES)
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", *HYBRID_FAMILIES, *MLA_FAMILIES)
# config.json model_type values the engine reads; a Qwen3.5 checkpoint's text model is "qwen3_5_moe_text"
# (the text-only one) or the "text_config" of a "qwen3_5_moe" (the vision-language one)
HF_MODEL_TYPES = ("llama", "mistral", *FAMILIES[1:], *HYBRID_FAMILIES, "qwen3_5_moe_text", *MLA_FAMILIES)
HF_MODEL_TYPE = {"qwen3_5_moe": "qwen3_5_moe_text"}  # family -> the model_type its to_hf_config writes

# model types people will try, and why the engine cannot run them (the refusal says so)
UNSUPPORTED_MODEL_TYPES = {
    "qwen3_5": "dense Qwen3.5 is not served yet (its MoE sibling qwen3_5_moe is)",
    "qwen3_5_text": "dense Qwen3.5 is not served yet (its MoE sibling qwen3_5_moe is)",
    "deepseek_v32": "DeepSeek-V3.2's sparse attention indexer (half-split RoPE, its own key scaling) is not "
                    "served yet (DeepSeek-V3 and GLM-5's glm_moe_dsa are)",
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
    # MLA families: queries through a rank-q_lora_rank bottleneck (0: one q_proj), keys and values from
    # a kv_lora_rank latent plus one rotated key of qk_rope_head_dim that all heads share
    q_lora_rank: int = 0
    kv_lora_rank: int = 0  # 0: not MLA
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout)
    # DeepSeek sparse attention (GLM-5): "full" layers run the indexer, "shared" ones reuse the selection
    # of the layer before; () = dense attention
    indexer_types: tuple[str, ...] = ()
    index_topk: int = 0  # tokens each query attends to
    index_n_heads: int = 0
    index_head_dim: int = 0
    # routing: "softmax" (Qwen) or "sigmoid" (DeepSeek-V3, GLM-5: a bias added to choose experts only, top
    # groups first, the chosen raw sigmoids renormalised and scaled)
    router_scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True  # the shared expert sits behind a sigmoid gate (Qwen), else always on

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

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def latent_dim(self) -> int:
        """An MLA layer's cached numbers a token: the normalised latent and the shared rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def has_indexer(self, layer: int) -> bool:
        """Whether `layer` runs its own sparse-attention indexer (and caches its keys)."""
        return bool(self.indexer_types) and self.indexer_types[layer] == "full"

    def is_linear_layer(self, layer: int) -> bool:
        """Whether `layer` is a Gated DeltaNet (linear-attention) layer, else full attention."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def rotary_dim(self) -> int:
        """Dims of a head that RoPE rotates (the rest pass through): MLA rotates its rope dims."""
        return self.qk_rope_head_dim if self.is_mla else int(self.head_dim * self.partial_rotary_factor)

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

    def param_count(self, tp: int = 1) -> int:
        """Parameters one of `tp` ranks holds as the engine shards them; at tp 1 the model as stored
        (tied embeddings counted once, every expert, not only the active ones).

        Attention and MLP projections split over tp (a KV head is replicated when tp exceeds the KV
        heads; MLA splits its heads and replicates the latent and query projections and the indexer),
        embedding and LM head split by vocabulary (rounded up); norms, routers and the shared expert's
        gate are replicated (docs/moe.md, docs/models.md)."""
        def up(n: int) -> int:
            return -(-n // tp)

        h = self.hidden_size
        q, kv = up(self.q_size), self.head_dim * up(self.num_kv_heads)
        gated = 2 if self.attn_output_gate else 1
        attn = h * (q * gated + 2 * kv) + q * h
        attn += (q * gated + 2 * kv if self.attention_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        if self.is_mla:
            heads, lq = up(self.num_heads), self.q_lora_rank
            q_in = lq or h
            attn = (h * lq + lq if lq else 0) + q_in * heads * self.head_dim  # q_a_proj, its norm, q_b_proj
            attn += h * self.latent_dim + self.kv_lora_rank  # kv_a_proj_with_mqa, kv_a_layernorm
            attn += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim) + heads * self.v_head_dim * h
        idx, ih = self.index_head_dim, self.index_n_heads
        indexer = (self.q_lora_rank * ih * idx + h * idx + 2 * idx + h * ih) if self.indexer_types else 0
        # a Gated DeltaNet layer: its projections, convolution and per-head parameters split by key head
        kd, vd = up(self.linear_key_dim), up(self.linear_value_dim)
        vh, conv = up(self.linear_num_value_heads), 2 * kd + vd
        linear = h * (conv + vd + 2 * vh) + conv * self.linear_conv_kernel_dim + 2 * vh + \
            self.linear_value_head_dim + vd * h  # in_proj_qkv, z, b, a; conv; dt_bias, A_log; norm; out_proj
        mixers = sum(linear if self.is_linear_layer(i) else attn + indexer * self.has_indexer(i)
                     for i in range(self.num_layers))
        dense = 3 * h * up(self.intermediate_size)
        moe = self.num_experts * (h + 3 * h * up(self.moe_intermediate_size))  # router row + expert
        moe += self.num_experts if self.router_scoring == "sigmoid" else 0  # the selection bias
        if self.shared_expert_intermediate_size:
            moe += 3 * h * up(self.shared_expert_intermediate_size) + h * self.shared_expert_gated  # + its gate
        mlps = sum(moe if self.is_moe_layer(i) else dense for i in range(self.num_layers))
        emb = up(self.vocab_size) * h
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
        fields = dict(
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
        return cls(**fields | (_mla_fields(cfg, family) if family in MLA_FAMILIES else {}))

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


# transformers' config defaults for the keys a hub config may leave out
_MLA_DEFAULTS = {
    "deepseek_v3": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                    "first_k_dense_replace": 3, "n_shared_experts": 1, "rope_interleave": True},
    "glm_moe_dsa": {"q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
                    "v_head_dim": 256, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
                    "first_k_dense_replace": 3, "n_shared_experts": 1, "rope_interleave": True,
                    "index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128},
}


def _mla_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """ModelArch fields of a DeepSeek-V3 or GLM-5 config.json, over the common ones."""
    c = _MLA_DEFAULTS[family] | {k: v for k, v in cfg.items() if v is not None}
    if c.get("attention_bias"):
        raise UnsupportedArchitecture(f"{family} with attention_bias = true is not supported (the released "
                                      "checkpoints have none)")
    layers = cfg["num_hidden_layers"]
    dense = tuple(i for i, t in enumerate(c.get("mlp_layer_types") or ()) if t == "dense") if "mlp_layer_types" in c \
        else tuple(range(min(c["first_k_dense_replace"], layers)))
    indexer: tuple[str, ...] = ()
    if family == "glm_moe_dsa":  # every layer runs the indexer unless its config says "shared" (transformers' rule)
        pattern = c.get("indexer_types") or c.get("index_topk_pattern")
        if isinstance(pattern, str):
            pattern = [{"F": "full", "S": "shared"}[x] for x in pattern]
        freq, offset = max(c.get("index_topk_freq", 1), 1), c.get("index_skip_topk_offset", 2)
        indexer = tuple(pattern or ("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)))
    moe = c["moe_intermediate_size"]
    return {
        "num_kv_heads": cfg["num_attention_heads"],  # every head keys and values the shared latent
        "head_dim": c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
        "q_lora_rank": (cfg["q_lora_rank"] if "q_lora_rank" in cfg else c["q_lora_rank"]) or 0,  # null: one q_proj
        "kv_lora_rank": c["kv_lora_rank"],
        "qk_nope_head_dim": c["qk_nope_head_dim"],
        "qk_rope_head_dim": c["qk_rope_head_dim"],
        "v_head_dim": c["v_head_dim"],
        "rope_interleave": bool(c["rope_interleave"]) or family == "glm_moe_dsa",
        "indexer_types": indexer,
        "index_topk": c.get("index_topk", 0) if indexer else 0,
        "index_n_heads": c.get("index_n_heads", 0) if indexer else 0,
        "index_head_dim": c.get("index_head_dim", 0) if indexer else 0,
        "num_experts": c.get("n_routed_experts") or c.get("num_experts") or 0,
        "norm_topk_prob": bool(c.get("norm_topk_prob", True)),
        "mlp_only_layers": dense,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": moe * c["n_shared_experts"],
        "shared_expert_gated": False,
        "router_scoring": "sigmoid",
        "n_group": c["n_group"],
        "topk_group": c["topk_group"],
        "routed_scaling_factor": float(c["routed_scaling_factor"]),
    }
