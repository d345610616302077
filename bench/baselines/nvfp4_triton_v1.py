"""Triton kernels for the NVFP4 linear ``y = x @ dequant(W)^T`` (details module of `ft.kernels.nvfp4`).

Weight layout: exactly as ModelOpt checkpoints store it, no load-time repack:
``packed`` uint8 [N, K/2] (element 2j in the low nibble of byte j), ``scale`` float8_e4m3fn
[N, K/16] (read here as its uint8 bits), ``scale_2`` float32 scalar applied in the epilogue.

E2M1 decoding in registers, plain Triton (runs in the interpreter): a nibble ``s e1 e0 m`` is
moved into an E4M3 byte ``s 0 0 e1 e0 m 0 0``, whose value is exactly ``e2m1 * 2**-6`` (code 1,
the E2M1 subnormal 0.5, lands on the E4M3 subnormal 2**-7), and converted with the fp8 cast
(one hardware conversion on Hopper). The 2**6 is folded into the block scale, so
``dec * (scale * 64)`` is the exact product ``e2m1 * scale`` (at most 5 significant bits, range
2**-10 .. 2688: exact in fp32, bf16 and fp16).

Two kernels:

* `_nvfp4_gemv_kernel` (M <= SMALL_M = 2, decode; any M <= 16 when forced): one program per
  BLOCK_N rows walks the whole K, reads each weight byte once, decodes it once for all M rows
  of x and keeps a [BLOCK_M, BLOCK_N, BLOCK_KB] fp32 partial-sum tile (FMA only in the loop,
  one reduction at the end).
* `_nvfp4_dot_kernel` (M > 2: a 16-row tile up to M = 16, larger tiles for prefill): tiles of
  x [BLOCK_M, BLOCK_K] times the dequantized weight tile [BLOCK_N, BLOCK_K] (decoded, scaled,
  cast to x's dtype, interleaved with ``tl.join``) through ``tl.dot`` with fp32 accumulation;
  fp32 x uses ``input_precision="ieee"``.

Measured on the H200 (bench/kernels_nvfp4.py, bench/RESULTS.md): correct on every shape; the
M = 1 GEMV reaches ~1 TB/s on 32768x8192 (22% of the copy ceiling), short of the 70% target.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["SMALL_M", "nvfp4_linear_triton"]

SMALL_M = 2
"""Rows of x up to which the GEMV kernel runs; above it the ``tl.dot`` kernel (with a 16-row
tile for M <= 16, the small-M decode case)."""


@triton.jit
def _e2m1_lo(b):
    """uint8 bytes -> fp32 value of the low nibble, times 2**-6."""
    e4m3 = ((b & 0x08) << 4) | ((b & 0x07) << 2)
    return e4m3.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_hi(b):
    """uint8 bytes -> fp32 value of the high nibble, times 2**-6."""
    e4m3 = (b & 0x80) | ((b >> 2) & 0x1C)
    return e4m3.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3(b):
    """uint8 bits of float8_e4m3fn -> fp32."""
    return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _nvfp4_gemv_kernel(
    p_x, p_w, p_s, p_s2, p_y,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
):
    i_n = tl.program_id(0)
    G: tl.constexpr = BLOCK_KB // 8  # block scales per tile row (8 bytes = 16 elements each)
    o_m = tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < N
    half_k = K // 2
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_KB), dtype=tl.float32)
    for kb in range(0, half_k, BLOCK_KB):
        o_kb = kb + tl.arange(0, BLOCK_KB)
        o_g = kb // 8 + tl.arange(0, G)
        m_k = o_kb < half_k
        m_w = m_n[:, None] & m_k[None, :]
        b_w = tl.load(p_w + o_n[:, None] * stride_wn + o_kb[None, :], mask=m_w, other=0)
        b_sb = tl.load(p_s + o_n[:, None] * stride_sn + o_g[None, :], mask=m_n[:, None] & (o_g < K // 16)[None, :], other=0)
        b_s = _e4m3(b_sb) * 64.0  # [BLOCK_N, G]
        b_s = tl.reshape(tl.broadcast_to(b_s[:, :, None], (BLOCK_N, G, 8)), (BLOCK_N, BLOCK_KB))
        b_lo = _e2m1_lo(b_w) * b_s
        b_hi = _e2m1_hi(b_w) * b_s
        m_x = m_m[:, None] & m_k[None, :]
        p_xk = p_x + o_m[:, None] * stride_xm + 2 * o_kb[None, :]
        b_xe = tl.load(p_xk, mask=m_x, other=0.0).to(tl.float32)
        b_xo = tl.load(p_xk + 1, mask=m_x, other=0.0).to(tl.float32)
        acc += b_lo[None, :, :] * b_xe[:, None, :] + b_hi[None, :, :] * b_xo[:, None, :]
    b_y = tl.sum(acc, axis=2) * tl.load(p_s2)
    p_yt = p_y + o_m[:, None] * stride_ym + o_n[None, :]
    tl.store(p_yt, b_y.to(p_y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _nvfp4_dot_kernel(
    p_x, p_w, p_s, p_s2, p_y,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles share the weight tiles they read while those sit in L2
    i_group = i_pid // (GROUP_M * n_n)
    first_m = i_group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    i_m = first_m + (i_pid % (GROUP_M * n_n)) % size_m
    i_n = (i_pid % (GROUP_M * n_n)) // size_m

    KB: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // 16
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        o_k = k + tl.arange(0, BLOCK_K)
        o_kb = k // 2 + tl.arange(0, KB)
        o_g = k // 16 + tl.arange(0, G)
        b_x = tl.load(p_x + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & (o_k < K)[None, :], other=0.0)
        b_w = tl.load(p_w + o_n[:, None] * stride_wn + o_kb[None, :], mask=m_n[:, None] & (o_kb < K // 2)[None, :], other=0)
        b_sb = tl.load(p_s + o_n[:, None] * stride_sn + o_g[None, :], mask=m_n[:, None] & (o_g < K // 16)[None, :], other=0)
        b_s = _e4m3(b_sb) * 64.0  # [BLOCK_N, G]
        b_s = tl.reshape(tl.broadcast_to(b_s[:, :, None], (BLOCK_N, G, 16)), (BLOCK_N, BLOCK_K))
        b_dec = tl.reshape(tl.join(_e2m1_lo(b_w), _e2m1_hi(b_w)), (BLOCK_N, BLOCK_K))  # even, odd interleaved
        b_wt = (b_dec * b_s).to(b_x.dtype)  # exact in bf16 / fp16
        acc = tl.dot(b_x, tl.trans(b_wt), acc, input_precision=PRECISION)
    b_y = acc * tl.load(p_s2)
    p_yt = p_y + o_m[:, None] * stride_ym + o_n[None, :]
    tl.store(p_yt, b_y.to(p_y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def _gemv_config(m: int, n: int, k: int) -> dict:
    # H200 sweep at M = 1 (bench/kernels_nvfp4.py --sweep): 256-byte K tiles won on every shape;
    # 4 rows per program for K <= 2048 with N >= 4096, 8 rows otherwise.
    block_m = triton.next_power_of_2(max(m, 1))
    block_kb = min(256 // block_m, max(16, triton.next_power_of_2(k // 2)))
    block_n = 4 if (k <= 2048 and n >= 4096) else 8
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_KB": block_kb, "num_warps": 4}


def _dot_config(m: int, n: int, k: int) -> dict:
    # H200: at M = 8 a 16-row tl.dot tile beat the 3-D GEMV tile on every decode shape (up to
    # 3x); at M = 4096 on 8192x2048, 256x128x64 with 8 warps was the best of five tiles.
    if m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    if m <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


def nvfp4_linear_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    scale_2: torch.Tensor | float,
    *,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """y = x @ dequantize(W).T on Triton: x [M, K] fp32/bf16/fp16, W NVFP4 [N, K] -> y [M, N] in x's dtype.

    Args:
        packed: uint8 [N, K/2]; scale: float8_e4m3fn [N, K/16]; scale_2: scalar (tensor or float).
        out: optional [M, N] output in x's dtype (written entirely).
        config: block sizes and launch options overriding the heuristics (benchmarks).
        path: "gemv" or "dot" to force a kernel; default: gemv for M <= SMALL_M, dot above.
    Raises:
        ValueError: on shapes or dtypes the kernels do not take.
    """
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be [M, K] fp32/bf16/fp16, got {x.dtype} {tuple(x.shape)}")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    m, k = x.shape
    n = packed.shape[0]
    if k % 16 or packed.shape[1] * 2 != k or tuple(scale.shape) != (n, k // 16):
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, packed {tuple(packed.shape)}, scale {tuple(scale.shape)}")
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"scale must be float8_e4m3fn, got {scale.dtype}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    packed = packed if packed.stride(-1) == 1 else packed.contiguous()
    scale_u8 = (scale if scale.stride(-1) == 1 else scale.contiguous()).view(torch.uint8)
    s2 = torch.as_tensor(scale_2, dtype=torch.float32, device=x.device).reshape(1)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0 or n == 0:
        return y
    path = path or ("gemv" if m <= SMALL_M else "dot")
    args = (x, packed, scale_u8, s2, y, m, n, k, x.stride(0), packed.stride(0), scale_u8.stride(0), y.stride(0))
    if path == "gemv":
        cfg = config or _gemv_config(m, n, k)
        _nvfp4_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](*args, **cfg)
    elif path == "dot":
        cfg = config or _dot_config(m, n, k)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        _nvfp4_dot_kernel[grid](*args, PRECISION=precision, **cfg)
    else:
        raise ValueError(f"path must be 'gemv' or 'dot', got {path!r}")
    return y
