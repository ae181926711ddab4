"""The model's matrix products with its weights: one entry point, `linear(x, w)`.

Every projection of the model code goes through here, whatever the weight is: a plain tensor in
the arena, or a quantized one (talaria/executor/quant.py) that is dequantized just before use. This
is where a product picks how it runs (its backend), so the model code says only what it multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from talaria.executor.quant import QStack, QWeight, Weight, quantized_linear


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ w (out, in)^T + bias -> (..., out), in x's dtype."""
    if isinstance(w, (QWeight, QStack)):
        return quantized_linear(x, w, bias)
    return F.linear(x, w, bias)
