"""Packed weights in the product: dequantization (whole blocks in place, slices that start inside a
block, NVFP4's nibbles), the scratch buffers it reuses, and the FP8 GEMM dispatch, which on a CPU
keeps the dequantize path. The block-scaled FP8 GEMM itself runs only on CUDA: its activation
quantization and scale layout are checked here by building the same product from row-wise scaled
FP8 GEMMs, one per block of the input, which CPU kernels run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from talaria.executor.quant import (
    E2M1,
    FP8,
    FP8_MAX,
    NVFP4,
    QStack,
    QWeight,
    dense,
    fp8_gemm_runs,
    quantize_activations,
    quantized_linear,
    scratch,
)


def fp8_weight(rows: int, cols: int, block: tuple[int, int], seed: int = 0) -> tuple[QWeight, torch.Tensor]:
    """A packed FP8 weight and the float64 matrix it stands for (by the format's formula)."""
    g = torch.Generator().manual_seed(seed)
    sr, sc = -(-rows // block[0]), -(-cols // block[1])
    scale = torch.rand(sr, sc, generator=g) + 0.5
    data = (torch.randn(rows, cols, generator=g) * 50).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    full = data.double() * scale.double().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return QWeight(FP8, data, scale, None, block, (0, 0)), full


def test_fp8_dequantizes_whole_blocks_and_slices_that_start_inside_one():
    w, full = fp8_weight(48, 64, (16, 16))
    assert torch.equal(dense(w, torch.float64), full)  # whole blocks: scaled in place
    # a TP slice of rows 20..44 and one of columns 8..40: the blocks they touch, offset inside the first
    rows = QWeight(FP8, w.data[20:44], w.scale[1:3], None, (16, 16), (4, 0))
    cols = QWeight(FP8, w.data[:, 8:40], w.scale[:, 0:3], None, (16, 16), (0, 8))
    assert torch.equal(dense(rows, torch.float64), full[20:44]) and torch.equal(dense(cols, torch.float64), full[:, 8:40])


def test_nvfp4_reads_the_low_nibble_first_and_scales_by_group_and_globally():
    codes = torch.tensor([[0x2F, 0x71]], dtype=torch.uint8)  # columns: -6, 1 | 0.5, 6
    w = QWeight(NVFP4, codes, torch.tensor([[2.0]]).to(torch.float8_e4m3fn), torch.tensor([0.25]), (1, 16), (0, 0))
    assert dense(w, torch.float64).tolist() == [[-6 * 0.5, 1 * 0.5, 0.5 * 0.5, 6 * 0.5]]
    assert E2M1[0xF] == -6.0 and E2M1[0x7] == 6.0


def test_a_stack_dequantizes_each_part_into_its_rows_and_plain_parts_are_copied():
    a, fa = fp8_weight(16, 32, (16, 16), seed=1)
    plain = torch.randn(8, 32, dtype=torch.float64)
    assert torch.equal(dense(QStack([a, plain]), torch.float64), torch.cat((fa, plain)))


def test_products_dequantize_into_one_reused_buffer_per_shape():
    w, full = fp8_weight(48, 64, (16, 16))
    x = torch.randn(5, 64, dtype=torch.float64)
    buffer = scratch((48, 64), torch.float64, x.device)
    assert scratch((48, 64), torch.float64, x.device) is buffer
    y = quantized_linear(x, w)
    assert torch.equal(buffer, full) and torch.equal(y, F.linear(x, full))


def test_on_a_cpu_the_fp8_gemm_is_not_used():
    assert not fp8_gemm_runs(torch.device("cpu"))
    w, full = fp8_weight(128, 256, (128, 128))
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    assert torch.equal(quantized_linear(x, w), F.linear(x, dense(w, torch.bfloat16)))


def test_the_activation_blocks_and_weight_scales_make_the_product_within_fp8_rounding():
    """The FP8 GEMM's operands (activations in 1 x 128 groups, the weight's 128 x 128 blocks) as one
    row-wise scaled FP8 GEMM per input block, summed: within FP8 rounding of the dequantized product,
    and far from it when a block's scales are taken in the wrong order."""
    w, full = fp8_weight(256, 384, (128, 128), seed=2)
    x = torch.randn(8, 384, generator=torch.Generator().manual_seed(3))
    xq, sx = quantize_activations(x, 128)
    assert xq.dtype == torch.float8_e4m3fn and sx.shape == (8, 3)

    def product(weight_scale: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(8, 256)
        for kb in range(3):
            cols = slice(128 * kb, 128 * (kb + 1))
            per_row = weight_scale[:, kb].repeat_interleave(128)[None, :].contiguous()  # (1, N)
            out += torch._scaled_mm(xq[:, cols].contiguous(), w.data[:, cols].t(), scale_a=sx[:, kb:kb + 1].contiguous(),
                                    scale_b=per_row, out_dtype=torch.float32)
        return out

    want = F.linear(x.double(), full).float()
    error = (product(w.scale) - want).norm() / want.norm()
    assert error < 0.05
    assert (product(w.scale.flip(0)) - want).norm() / want.norm() > 5 * error
