"""The norms of the served families, with the reference's float32 casts.

transformers normalises in float32 whatever the model dtype (`hidden.to(float32)`, then back), so a
float64 model's norms are float32 computations there: the engine does the same, since the reference
defines the model. In float32 and half precision `F.rms_norm` is that computation already.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm times `weight`, or with `offset` (a zero-centred norm) times offset + weight, in float32."""
    if offset:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * (offset + weight.float())).to(x.dtype)
    if x.dtype == torch.float64:  # Llama's and DeepSeek's: normalise in float32, weight in the model dtype
        h = x.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return F.rms_norm(x, weight.shape, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm with an affine weight and bias (the sparse-attention indexer's key norm)."""
    return F.layer_norm(x, weight.shape, weight, bias, eps)
