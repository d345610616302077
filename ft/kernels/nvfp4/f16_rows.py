"""x as fp16 rows, each scaled by a power of two: the operand of the NVFP4 tile's fp16 form (details module of
`ft.kernels.nvfp4`; `Nvfp4Options.dot_f16_x_max_m`).

A bf16 activation row [K] becomes x16 = x * 2**shift in fp16 with its factor back, 2**-shift, in fp32: shift
brings the row's largest |x| into [2**F16_ROW_TOP, 2**(F16_ROW_TOP + 1)), under fp16's largest finite value
(65,504) and far above its smallest normal (2**-14). So every element within 2**-28 of the row's largest is
exact in fp16 (bf16's 8 significant bits fit fp16's 11), and the smaller ones, rounded in fp16's subnormal
range, weigh less than 2**-28 of the row's largest term in any dot product: below the bf16 output's rounding.
A row of zeros (or of bf16 subnormals, which become zeros) or with an inf keeps shift 0 (its values as they are,
so an inf propagates as in bf16); a NaN stays a NaN whatever shift its row takes (the kernel's maximum may skip it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait

__all__ = ["F16_ROW_TOP", "f16_rows", "f16_rows_ref"]

F16_ROW_TOP = 14
"""A row's largest |x| lands in [2**14, 2**15) after its scaling."""
_MAX_SHIFT = 126  # 2**-shift stays a normal fp32 (its exponent field >= 1)


@triton.jit
def _f16_rows_kernel(p_x, p_y, p_s, K, stride_xm, stride_ym, TOP: tl.constexpr, MAX_SHIFT: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (M,): row i of x -> y[i] = x[i] * 2**shift in y's dtype (fp16), s[i] = 2**-shift (fp32)."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_m = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        o_k = k + tl.arange(0, BLOCK_K)
        b_x = tl.load(p_x + i_m * stride_xm + o_k, mask=o_k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(b_x), axis=0))  # (a NaN may be dropped here: see below)
    field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # the biased exponent of the largest |x|
    # zero (or subnormal) and inf rows keep their values (a NaN row: its amax is NaN, or what the maximum kept)
    keep = (field == 0) | (field == 255)
    shift = tl.where(keep, 0, tl.minimum(127 + TOP - field, MAX_SHIFT))
    up = ((shift + 127) << 23).to(tl.float32, bitcast=True)  # 2**shift, exact
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)  # 2**-shift, exact
    for k in range(0, K, BLOCK_K):
        o_k = k + tl.arange(0, BLOCK_K)
        b_x = tl.load(p_x + i_m * stride_xm + o_k, mask=o_k < K, other=0.0).to(tl.float32)
        tl.store(p_y + i_m * stride_ym + o_k, (b_x * up).to(p_y.dtype.element_ty), mask=o_k < K)
    tl.store(p_s + i_m, down)


def f16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16, unit column stride) -> (x16 [M, K] fp16, factors [M] fp32) with x16[i] = x[i] *
    2**shift_i rounded to fp16 and factors[i] = 2**-shift_i (the module's note says how shift is chosen)."""
    m, k = x.shape
    y = torch.empty((m, k), dtype=torch.float16, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m and k:
        _f16_rows_kernel[(m,)](x, y, s, k, x.stride(0), y.stride(0), TOP=F16_ROW_TOP, MAX_SHIFT=_MAX_SHIFT,
                               BLOCK_K=min(4096, triton.next_power_of_2(k)), num_warps=4, **pdl_args(x.device))
    return y, s


def f16_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`f16_rows` in torch: the same shifts and roundings (the reference of its tests)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1) if x.shape[1] else torch.zeros(x.shape[0])
    field = (amax.view(torch.int32) >> 23) & 0xFF
    keep = (field == 0) | (field == 255)
    shift = torch.where(keep, 0, torch.clamp(127 + F16_ROW_TOP - field, max=_MAX_SHIFT)).to(torch.int32)
    up = ((shift + 127) << 23).view(torch.float32)
    down = ((127 - shift) << 23).view(torch.float32)
    return (xf * up[:, None]).to(torch.float16), down
