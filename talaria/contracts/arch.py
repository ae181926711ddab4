"""The architecture of a Llama-family model, independent of where its weights come from.

One frozen record that the config validator, the gateway (context length, special tokens) and the
engine (shapes, RoPE, norms) all read. It round-trips through a Hugging Face ``config.json`` so a
converted model directory is a plain HF directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FAMILIES = tuple(HF_ARCHITECTURES)  # the model families the engine runs


@dataclass(frozen=True, slots=True)
class ModelArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
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
    family: str = "llama"  # llama | qwen2 | qwen3

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def param_count(self) -> int:
        """Parameters as stored (tied embeddings counted once)."""
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        layer = attn + mlp + 2 * self.hidden_size
        emb = self.vocab_size * self.hidden_size
        return self.num_layers * layer + emb * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of K and V per token over all layers, unsharded."""
        return 2 * self.num_layers * self.kv_size * itemsize

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        model_type = cfg.get("model_type", "llama")
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
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            family=model_type if model_type in ("qwen2", "qwen3") else "llama",
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
        return cfg
