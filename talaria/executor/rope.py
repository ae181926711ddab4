"""Rotary position tables, including the RoPE scalings checkpoints configure (linear, llama3, yarn).

YaRN (DeepSeek-V3) blends interpolated and original frequencies by a ramp over the rotated dims and
scales cos and sin by its attention factor; MLA models also fold `mscale_all_dim` into the softmax
scale (`softmax_scale`), as transformers' `yarn_apply_mscale` does.
"""

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
    elif kind == "yarn":
        factor = scaling.get("factor") or arch.max_position / scaling["original_max_position_embeddings"]
        inv_interp = inv / factor
        base, old_ctx = arch.rope_theta, scaling["original_max_position_embeddings"]

        def correction_dim(rotations: float) -> float:
            return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low if high > low else 0.001)).clamp(0, 1)
        inv = inv_interp * ramp + inv * (1 - ramp)  # extrapolate (keep) the fast dims, interpolate the slow ones
    elif kind not in (None, "default"):
        raise ValueError(f"RoPE scaling {kind!r} is not supported (supported: linear, llama3, yarn)")
    return inv


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(arch: ModelArch) -> float | None:
    scaling = arch.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return None
    return scaling.get("factor") or arch.max_position / scaling["original_max_position_embeddings"]


def attention_factor(arch: ModelArch) -> float:
    """YaRN's scale on cos and sin (1 for the other scalings)."""
    factor = _yarn_factor(arch)
    if factor is None:
        return 1.0
    scaling = arch.rope_scaling
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor)


def softmax_scale(arch: ModelArch) -> float:
    """1 / sqrt(head_dim); an MLA model's times YaRN's mscale(mscale_all_dim) squared when its config
    sets one (transformers' other families leave the softmax scale alone)."""
    scale = arch.head_dim ** -0.5
    factor, m_all = _yarn_factor(arch), (arch.rope_scaling or {}).get("mscale_all_dim")
    return scale * _mscale(factor, m_all) ** 2 if arch.is_mla and factor is not None and m_all else scale


def rope_cos_sin(arch: ModelArch, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (max_position, rotary_dim) in the model dtype."""
    pos = torch.arange(arch.max_position, dtype=torch.float64)
    freqs = torch.outer(pos, inv_frequencies(arch))  # (max_pos, rd/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = attention_factor(arch)
    return (emb.cos() * scale).to(dtype).to(device), (emb.sin() * scale).to(dtype).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, hd); cos/sin: (T, 1, rd). HF layout: rotate the two halves of each head's first
    rd dims (all of them unless RoPE is partial); the rest pass through."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
    half = rd // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, rd), its dims in pairs (x0, x1), (x2, x3), ... each rotated by one frequency
    (DeepSeek's layout); cos/sin: (T, 1, rd) as `rope_cos_sin` makes them. The result holds the pairs'
    first members, then their second members, as transformers writes it (dot products are what count,
    and the cache holds keys in this order)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
