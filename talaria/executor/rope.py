"""Rotary position tables, including the RoPE scalings checkpoints configure (linear, llama3)."""

from __future__ import annotations

import math

import torch

from talaria.contracts.arch import ModelArch


def inv_frequencies(arch: ModelArch) -> torch.Tensor:
    """(rd/2,) float64 inverse frequencies after scaling, rd the rotated dims of a head."""
    dim = arch.rotary_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = arch.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif kind not in (None, "default"):
        raise ValueError(f"RoPE scaling {kind!r} is not supported (supported: linear, llama3)")
    return inv


def rope_cos_sin(arch: ModelArch, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (max_position, rotary_dim) in the model dtype."""
    pos = torch.arange(arch.max_position, dtype=torch.float64)
    freqs = torch.outer(pos, inv_frequencies(arch))  # (max_pos, rd/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
