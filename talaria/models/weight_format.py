"""A checkpoint's weight format and the bytes it takes in the arena, from its files' headers alone.

Preflight (`talaria config check --files`, `talaria up`) sizes arenas before any rank loads: for a
quantized checkpoint (FP8 block-scaled or NVFP4, talaria/executor/quant.py) the weights the
checkpoint stores packed stay packed in the arena, the rest take the model's dtype. The safetensors
headers (JSON, no tensor data read) give every tensor's dtype and shape, so the ratio of the arena's
bytes to the same weights all plain is known exactly for the whole checkpoint; preflight scales each
rank's plain bytes by it (`ModelArch.param_count(tp)` x dtype bytes x ratio). No torch here.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from talaria.models.errors import ModelSourceError

_ITEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "U8": 1, "I8": 1, "I32": 4, "I64": 8}
_SCALES = ("_scale_inv", "_scale", "_scale_2", "input_scale")


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """How a checkpoint stores its weights: `kind` "fp8", "nvfp4" or "plain", and the arena's bytes
    over the bytes of the same weights all plain in the model dtype (1.0 when plain)."""

    kind: str
    detail: str  # "blocks 128x128", "groups of 16", ""
    ratio: float

    def describe(self) -> str:
        return "plain" if self.kind == "plain" else f"{self.kind} ({self.detail}), {self.ratio:.2f}x the plain bytes"


def weight_format(directory: Path, dtype_bytes: int) -> WeightFormat:
    """The format of the safetensors checkpoint in `directory`, served in a dtype of `dtype_bytes`."""
    config = json.loads((directory / "config.json").read_text()) if (directory / "config.json").exists() else {}
    q = config.get("quantization_config") or {}
    if (directory / "hf_quant_config.json").exists():
        q = json.loads((directory / "hf_quant_config.json").read_text()).get("quantization", {}) | \
            {"quant_method": "modelopt"}
    method = q.get("quant_method")
    if method is None:
        return WeightFormat("plain", "", 1.0)
    if method == "fp8":
        kind, detail = "fp8", "blocks {}x{}".format(*(q.get("weight_block_size") or (128, 128)))
    elif method == "modelopt" and q.get("quant_algo") == "NVFP4":
        kind, detail = "nvfp4", f"groups of {q.get('group_size', 16)}"
    else:
        raise ModelSourceError(f"{directory}: quantization {method!r} {q.get('quant_algo', '')} is not supported; "
                               "Talaria reads FP8 block-scaled and NVFP4 checkpoints (docs/models.md)")
    tensors = _headers(directory)
    arena = plain = 0
    for name, (dtype, shape) in tensors.items():
        numel, own = math.prod(shape), math.prod(shape) * _ITEM.get(dtype, 1)
        if name.endswith(_SCALES):
            arena += own
        elif name + "_scale_inv" in tensors or name + "_scale" in tensors:  # packed: stays as stored
            arena += own
            plain += numel * (2 if dtype == "U8" else 1) * dtype_bytes  # NVFP4: two values a byte
        else:
            arena += numel * dtype_bytes
            plain += numel * dtype_bytes
    return WeightFormat(kind, detail, arena / plain if plain else 1.0)


def _headers(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        ["model.safetensors"]
    out = {}
    for file in files:
        with open(directory / file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        out |= {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}
    return out
