"""NVFP4 prefill linear through a dense GEMM (details module of `ft.kernels.nvfp4`).

For a prefill chunk (M in the thousands) the `tl.dot` kernel re-decodes every weight tile once per
row tile of x (M / BLOCK_M times), and its tiles run at about half of cuBLAS's bf16 rate
(bench/RESULTS.md). Here the weight is decoded once, by `_dequant_kernel` (a pass over the packed
bytes at HBM speed: a [8192, 2048] weight writes 32 MB of bf16), into a transient buffer, and the
GEMM is cuBLAS's (`torch.addmm` with alpha = the weight's global scale, so that the fp32
accumulator is scaled before its one rounding, as the Triton kernels do). The decoded buffer holds
e2m1 value x e4m3 block scale, exact in bf16/fp16/fp32 (at most 6 significant bits); the global
scale needs its value on the host (`NVFP4Weight.scale_2_host`, read once when the weight loads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.nvfp4.decode import dequant_tile

__all__ = ["dequantize_nvfp4_triton", "nvfp4_linear_dequant_mm"]

DEQUANT_BLOCK = (32, 256)
"""(rows, elements) per program of the decode pass: 4 KiB of codes in, 16 KiB of bf16 out."""


@triton.jit
def _dequant_kernel(p_w, p_s, p_y, N, K, stride_wn, stride_sn, stride_yn,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """y [N, K] = e2m1(code) * e4m3(block scale) of rows [i * BLOCK_R, ...) and elements
    [j * BLOCK_K, ...); EVEN_K: K % BLOCK_K == 0 (no mask along K: vectorized loads and stores)."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < N
    k0 = tl.program_id(1) * BLOCK_K
    b_y = dequant_tile(p_w, p_s, o_r, m_r, stride_wn, stride_sn, k0 // 2, K // 2, p_y.dtype.element_ty, BLOCK_R,
                       BLOCK_K, EVEN_K)
    o_k = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        m_y = m_r[:, None]
    else:
        m_y = m_r[:, None] & (o_k < K)[None, :]
    tl.store(p_y + o_r[:, None].to(tl.int64) * stride_yn + o_k[None, :], b_y, mask=m_y)


def dequantize_nvfp4_triton(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """packed uint8 [N, K/2], scale float8_e4m3fn [N, K/16] -> [N, K] in `dtype` WITHOUT the global
    scale: `dequantize_nvfp4(packed, scale, 1.0, dtype)`, bit for bit. out: an optional [N, K]
    buffer in `dtype`, contiguous along K.

    Raises: ValueError on shapes or dtypes that do not match."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"packed must be uint8 [N, K/2] and scale float8_e4m3fn, got {packed.dtype} "
                         f"{tuple(packed.shape)}, {scale.dtype}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if k % 16 or tuple(scale.shape) != (n, k // 16):
        raise ValueError(f"scale {tuple(scale.shape)} does not match packed {tuple(packed.shape)}")
    packed = packed if packed.stride(-1) == 1 else packed.contiguous()
    scale_u8 = (scale if scale.stride(-1) == 1 else scale.contiguous()).view(torch.uint8)
    y = torch.empty((n, k), dtype=dtype, device=packed.device) if out is None else out
    if y.shape != (n, k) or y.dtype != dtype or y.stride(-1) != 1:
        raise ValueError(f"out must be [{n}, {k}] {dtype} contiguous along K, got {tuple(y.shape)} {y.dtype}")
    if n and k:
        block_r, block_k = DEQUANT_BLOCK
        block_k = min(block_k, triton.next_power_of_2(k))
        _dequant_kernel[(triton.cdiv(n, block_r), triton.cdiv(k, block_k))](
            packed, scale_u8, y, n, k, packed.stride(0), scale_u8.stride(0), y.stride(0),
            BLOCK_R=block_r, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=4)
    return y


def nvfp4_linear_dequant_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, scale_2: float,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = scale_2 * (x [M, K] @ W^T) in x's dtype, W decoded once into a transient [N, K]
    buffer in x's dtype, the GEMM cuBLAS's (alpha = scale_2: one rounding of the fp32 sum).
    scale_2: the weight's global scale as a Python float."""
    w = dequantize_nvfp4_triton(packed, scale, x.dtype)
    y = torch.empty((x.shape[0], packed.shape[0]), dtype=x.dtype, device=x.device) if out is None else out
    return y.addmm_(x, w.t(), beta=0, alpha=scale_2)  # beta 0: y's contents are never read
