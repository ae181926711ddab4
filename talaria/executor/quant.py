"""Quantized weights: FP8 block-scaled and NVFP4 checkpoints, kept packed in the arena.

A weight a checkpoint stores quantized stays quantized everywhere the node holds it (the arena's
weights region, the host image, staged chunks, D2D gathers): a `QWeight` is its packed values and
scales, arena views like any other parameter, so every byte count is the quantized one. A weight is
dequantized just before use, into a temporary of the model dtype (`dense`), and the model code
multiplies by that; no full-size copy of the model exists at any time.

The formats, as the checkpoints store them (names are the weight's, e.g. `...q_proj.weight`):

- **FP8 block-scaled** (`quantization_config.quant_method = "fp8"`, `weight_block_size` [b0, b1]):
  the weight float8_e4m3fn (out, in), `weight_scale_inv` float32 (⌈out/b0⌉, ⌈in/b1⌉);
  W[i, j] = fp8[i, j] · s[i // b0, j // b1] (multiplied, despite the name).
- **NVFP4** (ModelOpt, `quant_algo = "NVFP4"`, groups of 16 along the input): the weight uint8
  (out, in/2), two e2m1 codes a byte, the low nibble first; `weight_scale` float8_e4m3fn
  (out, in/16); `weight_scale_2` float32, one per weight; W = e2m1 · weight_scale[o, i // 16] ·
  weight_scale_2. (`input_scale`, for FP4 activations, is not read: activations stay in the model
  dtype.)

Which weights are quantized is read from the checkpoint itself (a weight with its scale tensors
beside it); the others (embeddings, norms, routers, excluded modules) load as before.

**TP slices across block edges.** A rank's slice of a weight may start inside a scale block (an
expert width of 1,536 split 8 ways starts rank 1 at column 192, in the middle of a 128-block): the
rank keeps the scale blocks its slice touches and the offset of its first row and column inside the
first of them (`QWeight.offset`). NVFP4 packs two columns a byte, so a column slice must start on an
even column.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from talaria.executor.checkpoint import CheckpointError, ShardReader

FP8, NVFP4 = "fp8", "nvfp4"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by code
_STORED = {FP8: torch.float8_e4m3fn, NVFP4: torch.uint8}
_SCALE = {FP8: torch.float32, NVFP4: torch.float8_e4m3fn}

Shape = tuple[int, ...]
Alloc = Callable[..., torch.Tensor]  # (shape, what, dtype=None) -> an arena view; None: the model dtype


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """A checkpoint's weight format: its kind and its scale blocks (rows, columns)."""

    kind: str  # FP8 or NVFP4
    block: tuple[int, int]  # NVFP4: (1, group size)

    @classmethod
    def of(cls, directory: Path) -> QuantFormat | None:
        """The format of the checkpoint in `directory` (None: unquantized), from its config.json's
        `quantization_config` or ModelOpt's hf_quant_config.json."""
        config = json.loads((directory / "config.json").read_text()) if (directory / "config.json").exists() else {}
        q = config.get("quantization_config") or {}
        modelopt = directory / "hf_quant_config.json"
        if modelopt.exists():
            q = json.loads(modelopt.read_text()).get("quantization", {}) | {"quant_method": "modelopt"}
        method = q.get("quant_method")
        if method is None:
            return None
        if method == "fp8":
            return cls(FP8, tuple(q.get("weight_block_size") or (128, 128)))
        if method == "modelopt" and q.get("quant_algo") == "NVFP4":
            return cls(NVFP4, (1, q.get("group_size", 16)))
        raise CheckpointError(f"{directory}: quantization {method!r} ({q.get('quant_algo', '')}) is not supported; "
                              "Talaria reads FP8 block-scaled and NVFP4 checkpoints (docs/models.md)")


@dataclass(slots=True)
class QWeight:
    """A weight kept quantized, `(..., out, in)` as the model uses it (a leading expert dim or none).

    data: FP8 float8_e4m3fn (..., out, in); NVFP4 uint8 (..., out, in / 2). scale: the blocks the
    slice touches, FP8 float32, NVFP4 float8_e4m3fn (..., out, groups). scale2: NVFP4's global
    float32 scale, (..., 1); None for FP8. offset: the slice's first row and column inside its first
    scale block."""

    kind: str
    data: torch.Tensor
    scale: torch.Tensor
    scale2: torch.Tensor | None
    block: tuple[int, int]
    offset: tuple[int, int]

    @property
    def shape(self) -> Shape:
        *lead, rows, cols = self.data.shape
        return (*lead, rows, cols * (2 if self.kind == NVFP4 else 1))

    def __getitem__(self, i) -> QWeight:
        """One expert's weight (index the leading dim)."""
        return QWeight(self.kind, self.data[i], self.scale[i], None if self.scale2 is None else self.scale2[i],
                       self.block, self.offset)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scale, self.scale2) if t is not None]


@dataclass(slots=True)
class QStack:
    """Weights stacked along their output rows (a fused projection: q/k/v, gate/up), each part kept
    as the checkpoint stores it (quantized or not)."""

    parts: list[QWeight | torch.Tensor]

    @property
    def shape(self) -> Shape:
        *lead, _, cols = self.parts[0].shape
        return (*lead, sum(p.shape[-2] for p in self.parts), cols)

    def __getitem__(self, i) -> QStack:
        return QStack([p[i] for p in self.parts])

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in (p.tensors() if isinstance(p, QWeight) else [p])]


Weight = torch.Tensor | QWeight | QStack


def dense(w: Weight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """`w` as a plain tensor of the model's `dtype`: a quantized one dequantized (into `out` when
    given, else a new tensor), a plain one as it is."""
    if isinstance(w, torch.Tensor):
        return w
    if out is None:
        out = torch.empty(w.shape, dtype=dtype, device=w.tensors()[0].device)
    if isinstance(w, QStack):
        row = 0
        for p in w.parts:
            n = p.shape[-2]
            part = out[..., row:row + n, :]
            if isinstance(p, torch.Tensor):
                part.copy_(p)
            else:
                dense(p, dtype, part)
            row += n
        return out
    rows, cols = w.shape[-2:]
    (b0, b1), (o0, o1) = w.block, w.offset
    if w.kind == FP8:
        out.copy_(w.data)
        scale = w.scale.to(dtype)
        if (o0, o1) == (0, 0) and rows % b0 == 0 and cols % b1 == 0 and out.is_contiguous():  # whole blocks: in place
            lead = out.shape[:-2]
            out.view(*lead, rows // b0, b0, cols // b1, b1).mul_(scale[..., :, None, :, None])
            return out
    else:
        codes = torch.stack((w.data & 0xF, w.data >> 4), dim=-1).flatten(-2)  # (..., out, in): low nibble first
        out.copy_(torch.tensor(E2M1, dtype=dtype, device=w.data.device)[codes.long()])
        scale = w.scale.to(dtype) * w.scale2.to(dtype).unsqueeze(-1)
    out.mul_(scale.repeat_interleave(b0, dim=-2)[..., o0:o0 + rows, :].repeat_interleave(b1, dim=-1)[..., o1:o1 + cols])
    return out


_SCRATCH: dict[tuple, torch.Tensor] = {}


def scratch(shape: Shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable buffer for a dequantized weight of `shape`: one per shape, dtype and device, so a
    model's products dequantize into a handful of layer-sized buffers, never a model-sized copy. Its
    contents last until the next product of the same shape: use it at once."""
    key = (tuple(shape), dtype, device)
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty(shape, dtype=dtype, device=device)
    return _SCRATCH[key]


def quantized_linear(x: torch.Tensor, w: QWeight | QStack, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ w^T (+ bias) for a packed weight: an FP8 one through the device's block-scaled
    FP8 GEMM where it runs and fits (`fp8_gemm_runs`), the activations quantized per token in groups
    of the block's width; otherwise dequantized into a scratch buffer of x's dtype first."""
    if isinstance(w, QStack) and all(_fp8_fits(p, x) for p in w.parts):
        y = torch.cat([quantized_linear(x, p) for p in w.parts], dim=-1)
        return y if bias is None else y + bias
    if isinstance(w, QWeight) and _fp8_fits(w, x):
        y = fp8_block_mm(x.reshape(-1, x.shape[-1]), w, x.dtype).view(*x.shape[:-1], -1)
        return y if bias is None else y + bias
    return F.linear(x, dense(w, x.dtype, scratch(w.shape, x.dtype, x.device)), bias)


FP8_MAX = 448.0  # float8_e4m3fn's largest value


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (float8_e4m3fn (M, K), float32 scales (M, K / group)): each token's groups of
    `group` columns scaled by their own absolute maximum (DeepSeek-V3's 1x128 activation blocks)."""
    m, k = x.shape
    g = x.float().view(m, k // group, group)
    scale = g.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (g / scale[..., None]).to(torch.float8_e4m3fn).view(m, k), scale


def fp8_block_mm(x: torch.Tensor, w: QWeight, out_dtype: torch.dtype) -> torch.Tensor:
    """x (M, K) @ w^T with `torch._scaled_mm`'s block-wise scaling (1 x b1 activation groups, b0 x b1
    weight blocks): one FP8 GEMM on devices whose kernels take these scales."""
    xq, sx = quantize_activations(x, w.block[1])
    return torch._scaled_mm(xq, w.data.t(), scale_a=sx, scale_b=w.scale.t(), out_dtype=out_dtype)


_FP8_GEMM: dict[torch.device, bool] = {}


def fp8_gemm_runs(device: torch.device) -> bool:
    """Whether the block-scaled FP8 GEMM runs on `device` and agrees with the dequantized product,
    found once per device on a toy problem (CUDA only: CPU kernels take only tensor- and row-wise
    scales). Any failure or disagreement keeps the dequantize path."""
    if device.type != "cuda":
        return False
    if device not in _FP8_GEMM:
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(16, 256, device=device, generator=gen, dtype=torch.bfloat16)
            w = torch.randn(256, 256, device=device, generator=gen)
            s = w.view(2, 128, 2, 128).abs().amax(dim=(1, 3)) / FP8_MAX
            q = QWeight(FP8, (w.view(2, 128, 2, 128) / s[:, None, :, None]).view(256, 256).to(torch.float8_e4m3fn),
                        s, None, (128, 128), (0, 0))
            want = F.linear(x.float(), dense(q, torch.float32))
            got = fp8_block_mm(x, q, torch.bfloat16).float()
            _FP8_GEMM[device] = bool(((got - want).norm() / want.norm()) < 0.05)
        except (RuntimeError, ValueError, NotImplementedError, TypeError):
            _FP8_GEMM[device] = False
    return _FP8_GEMM[device]


def _fp8_fits(w: QWeight | torch.Tensor, x: torch.Tensor) -> bool:
    """An FP8 weight of whole blocks (no TP slice inside one), 2-D, in a half-precision model on a
    device whose FP8 GEMM runs."""
    if not isinstance(w, QWeight) or w.kind != FP8 or w.data.dim() != 2 or w.offset != (0, 0):
        return False
    (rows, cols), (b0, b1) = w.shape, w.block
    return (x.dtype in (torch.bfloat16, torch.float16) and rows % b0 == 0 and cols % b1 == 0
            and fp8_gemm_runs(x.device))


def stored_kind(ckpt: ShardReader, name: str) -> str | None:
    """How the checkpoint stores weight `name`: FP8, NVFP4 or None (plain), by its scale tensors."""
    if name + "_scale_inv" in ckpt:
        return FP8
    if name + "_scale" in ckpt and name + "_scale_2" in ckpt:
        return NVFP4
    return None


def read_quantized(ckpt: ShardReader, alloc: Alloc, fmt: QuantFormat, name: str, dim: int | None = None,
                   start: int = 0, stop: int | None = None, *, what: str, experts: int = 0,
                   expert_name: Callable[[int], str] | None = None) -> QWeight:
    """Checkpoint weight `name`, or its [start, stop) along `dim` (0: rows, 1: columns), into new
    arena views, packed. With `experts` > 0, one weight per expert named `expert_name(e)`, stacked
    along a leading dim."""
    names = [expert_name(e) for e in range(experts)] if experts else [name]
    out_rows, in_cols = ckpt.shape(names[0])
    in_cols *= 2 if fmt.kind == NVFP4 else 1
    stop = (out_rows, in_cols)[dim] if dim is not None and stop is None else stop
    rows, cols = (start, stop) if dim == 0 else (0, out_rows), (start, stop) if dim == 1 else (0, in_cols)
    (b0, b1) = fmt.block
    if fmt.kind == NVFP4 and cols[0] % 2:
        raise CheckpointError(f"{name}: an NVFP4 column slice must start on an even column, not {cols[0]}; "
                              "choose a tp that splits the width evenly")
    s_rows, s_cols = (rows[0] // b0, math.ceil(rows[1] / b0)), (cols[0] // b1, math.ceil(cols[1] / b1))
    lead = (experts,) if experts else ()
    pack = 2 if fmt.kind == NVFP4 else 1
    w = QWeight(fmt.kind,
                alloc((*lead, rows[1] - rows[0], (cols[1] - cols[0]) // pack), what, _STORED[fmt.kind]),
                alloc((*lead, s_rows[1] - s_rows[0], s_cols[1] - s_cols[0]), what + ".scale", _SCALE[fmt.kind]),
                alloc((*lead, 1), what + ".scale_2", torch.float32) if fmt.kind == NVFP4 else None,
                fmt.block, (rows[0] - s_rows[0] * b0, cols[0] - s_cols[0] * b1))
    suffix = "_scale_inv" if fmt.kind == FP8 else "_scale"
    for e, n in enumerate(names):
        one = w[e] if experts else w
        _read_2d(ckpt, one.data, n, (rows[0], rows[1]), (cols[0] // pack, cols[1] // pack))
        _read_2d(ckpt, one.scale, n + suffix, s_rows, s_cols)
        if fmt.kind == NVFP4:
            if ckpt.shape(n + "_scale_2") not in ((), (1,)):
                raise CheckpointError(f"{n}_scale_2 has shape {list(ckpt.shape(n + '_scale_2'))}; NVFP4 keeps one")
            ckpt.read_into(one.scale2.view(ckpt.shape(n + "_scale_2")), n + "_scale_2")
    return w


def _read_2d(ckpt: ShardReader, out: torch.Tensor, name: str, rows: tuple[int, int], cols: tuple[int, int]) -> None:
    """Rows [r0, r1) and columns [c0, c1) of a 2-D checkpoint tensor into `out` (one of them whole)."""
    full = ckpt.shape(name)
    if cols == (0, full[1]):
        ckpt.read_into(out, name, 0, *rows)
    elif rows == (0, full[0]):
        ckpt.read_into(out, name, 1, *cols)
    else:
        raise CheckpointError(f"{name}: a slice of both rows and columns")


class WeightReader:
    """A rank's reads of checkpoint weights into arena views: plain weights in the model dtype, the
    ones the checkpoint stores quantized (`fmt`) packed, as `QWeight`s."""

    def __init__(self, ckpt: ShardReader, alloc: Alloc, fmt: QuantFormat | None) -> None:
        self.ckpt, self.alloc, self.fmt = ckpt, alloc, fmt

    def quantized(self, name: str) -> bool:
        return self.fmt is not None and stored_kind(self.ckpt, name) is not None

    def linear(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None, *,
               shape: Shape, what: str) -> Weight:
        """Weight `name`, or its [start, stop) along `dim`; `shape`: the plain slice's."""
        if self.quantized(name):
            return read_quantized(self.ckpt, self.alloc, self.fmt, name, dim, start, stop, what=what)
        out = self.alloc(shape, what)
        self.ckpt.read_into(out, name, dim, start, stop)
        return out

    def stacked(self, parts: list[tuple[str, int, int]], tail: Shape, what: str) -> Weight:
        """Row ranges [a, b) of several weights, one after another: a fused projection (a `QStack`
        when any part is quantized, else one plain tensor)."""
        if any(self.quantized(n) for n, _, _ in parts):
            return QStack([self.linear(n, 0, a, b, shape=(b - a, *tail), what=f"{what}.{i}")
                           for i, (n, a, b) in enumerate(parts)])
        out = self.alloc((sum(b - a for _, a, b in parts), *tail), what)
        row = 0
        for n, a, b in parts:
            self.ckpt.read_into(out[row:row + b - a], n, 0, a, b)
            row += b - a
        return out

    def experts(self, name: Callable[[int], str], count: int, dim: int, start: int, stop: int,
                what: str) -> QWeight:
        """Every expert's quantized weight `name(e)` (its [start, stop) along `dim`), stacked."""
        return read_quantized(self.ckpt, self.alloc, self.fmt, name(0), dim, start, stop, what=what, experts=count,
                              expert_name=name)
