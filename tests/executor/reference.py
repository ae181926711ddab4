"""The plain reference every equivalence test compares against: full recompute, no cache, no TP.

Written independently of the engine (HF weight names, unfused projections, explicit GQA repeat,
softmax attention by hand), so a shared bug is unlikely. Greedy decoding recomputes the whole
sequence for every token.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from talaria.contracts.arch import ModelArch


class ReferenceLlama:
    def __init__(self, directory: Path, dtype: torch.dtype = torch.float64) -> None:
        self.arch = ModelArch.from_hf_config(json.loads((directory / "config.json").read_text()))
        self.w = {k: v.to(dtype) for k, v in load_file(directory / "model.safetensors").items()}
        self.dtype = dtype

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.arch.rms_norm_eps) * w

    def _rope(self, x: torch.Tensor) -> torch.Tensor:  # x: (heads, T, hd)
        a, T = self.arch, x.shape[1]
        inv = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float64) / a.head_dim))
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x1, x2 = x[..., : a.head_dim // 2], x[..., a.head_dim // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    @torch.inference_mode()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits (T, V) for every position of `tokens`."""
        a, w, T = self.arch, self.w, len(tokens)
        x = w["model.embed_tokens.weight"][torch.tensor(tokens)]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        for i in range(a.num_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"])

            def proj(name: str, heads: int, h: torch.Tensor = h, p: str = p) -> torch.Tensor:
                y = h @ w[p + f"self_attn.{name}.weight"].T
                if a.attention_bias:
                    y = y + w[p + f"self_attn.{name}.bias"]
                return y.view(T, heads, a.head_dim).transpose(0, 1)  # (heads, T, hd)

            q, k, v = proj("q_proj", a.num_heads), proj("k_proj", a.num_kv_heads), proj("v_proj", a.num_kv_heads)
            if a.qk_norm:
                q = self._norm(q, w[p + "self_attn.q_norm.weight"])
                k = self._norm(k, w[p + "self_attn.k_norm.weight"])
            q, k = self._rope(q), self._rope(k)
            rep = a.num_heads // a.num_kv_heads
            k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
            scores = (q @ k.transpose(1, 2)) / math.sqrt(a.head_dim)
            scores = scores.masked_fill(~causal, float("-inf"))
            o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, -1)
            x = x + o @ w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            up = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        x = self._norm(x, w["model.norm.weight"])
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return x @ head.T

    def greedy(self, prompt: list[int], max_tokens: int, eos: tuple[int, ...] = ()) -> list[int]:
        tokens = list(prompt)
        out: list[int] = []
        for _ in range(max_tokens):
            nxt = int(self.logits(tokens)[-1].argmax())
            out.append(nxt)
            tokens.append(nxt)
            if nxt in eos:
                break
        return out
