"""Tensor-core NVFP4 linear for a few rows of x (details module of `ft.kernels.nvfp4`): batched decode.

At M = 3..16 (a decode batch) the GEMV's CUDA-core FMAs grow with M while the weight bytes do
not; this kernel decodes each weight element once and lets the MMA multiply it by every row of x.
The weight is the MMA's left operand (``y^T = W x^T``: the batch is the MMA's narrow N side, padded
to 16), so a program owns BLOCK_N weight rows and walks K.

The decode is elementwise only (no join / reshape of the tile, which would move it through shared
memory): byte j of a row holds elements 2j (low nibble) and 2j + 1 (high nibble), so the low
nibbles form one operand tile against x's even columns and the high nibbles another against its
odd columns: two MMAs per step. A nibble ``s e1 e0 m`` becomes the E4M3 byte ``s 0 0 e1 e0 m 0 0``
(value e2m1 * 2**-6, exact), converted to fp16 and multiplied by its block scale (E4M3 -> fp16,
exact): the product has at most 6 significant bits and lies in [2**-16, 42], so it is exact in
fp16 (and in bf16, to which it converts exactly). The block scale is read per byte (eight bytes
share one: cached loads) so that no broadcast reshape is needed. The 2**6 and the global scale
are applied in the epilogue, with fp32 accumulation throughout.

The operand dtype (`OPERAND`): fp16 weights with x converted to fp16 (``"f16"``: x outside
[2**-14, 65504] in magnitude loses bits or overflows), or x's own dtype (bf16: the decoded weights
convert exactly; fp32: ``input_precision="ieee"``, for the CPU tests).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["MMA_BLOCK_M", "mma_config"]

MMA_BLOCK_M = 16
"""Rows of x per program (the MMA's narrow side; tl.dot needs 16): the kernel takes M <= 16."""


@triton.jit
def _nibble_f16(e4m3_bits):
    """uint8 E4M3 bit patterns -> fp16 (exact)."""
    return e4m3_bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _mma_step(acc, kb0, p_x, p_w, p_s, o_n, m_n, o_m, m_m, o_j, half_k, stride_xm, stride_wn, stride_sn,
              OPERAND: tl.constexpr):
    """One K step of `_nvfp4_mma_kernel`: packed bytes [kb0, kb0 + BLOCK_KB) of rows o_n -> acc += W x^T."""
    o_kb = kb0 + o_j
    m_k = o_kb < half_k
    m_w = m_n[:, None] & m_k[None, :]
    b_w = tl.load(p_w + o_n[:, None] * stride_wn + o_kb[None, :], mask=m_w, other=0)
    b_s = _nibble_f16(tl.load(p_s + o_n[:, None] * stride_sn + (o_kb // 8)[None, :], mask=m_w, other=0))
    w_lo = _nibble_f16(((b_w & 0x08) << 4) | ((b_w & 0x07) << 2)) * b_s  # elements 2j
    w_hi = _nibble_f16((b_w & 0x80) | ((b_w >> 2) & 0x1C)) * b_s  # elements 2j + 1
    p_xt = p_x + o_m[None, :] * stride_xm + (2 * o_kb)[:, None]
    m_x = m_k[:, None] & m_m[None, :]
    x_ev = tl.load(p_xt, mask=m_x, other=0.0)
    x_od = tl.load(p_xt + 1, mask=m_x, other=0.0)
    if OPERAND == "f16":
        acc = tl.dot(w_lo, x_ev.to(tl.float16), acc)
        acc = tl.dot(w_hi, x_od.to(tl.float16), acc)
    elif p_x.dtype.element_ty == tl.float32:
        acc = tl.dot(w_lo.to(tl.float32), x_ev, acc, input_precision="ieee")
        acc = tl.dot(w_hi.to(tl.float32), x_od, acc, input_precision="ieee")
    else:
        acc = tl.dot(w_lo.to(x_ev.dtype), x_ev, acc)
        acc = tl.dot(w_hi.to(x_od.dtype), x_od, acc)
    return acc


@triton.jit
def _nvfp4_mma_kernel(
    p_x, p_w, p_s, p_s2, p_y,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr, OPERAND: tl.constexpr, BLOCK_M: tl.constexpr = 16,
    UNROLL_KB: tl.constexpr = 0,
):
    """Grid (N / BLOCK_N,): y[m, n] = sum_k x[m, k] * dequant(W)[n, k] for m < M <= BLOCK_M.

    p_w: uint8 packed [N, K/2] (row stride stride_wn); p_s: uint8 E4M3 block scales [N, K/16];
    p_s2: fp32 global scale; BLOCK_KB packed bytes (2 * BLOCK_KB elements) per step, a multiple of 8.
    OPERAND: "f16" (weights and x as fp16), "x" (x's dtype: bf16, or fp32 with ieee precision).
    UNROLL_KB: K / 2 as a constant (the loop unrolled, every step's loads free to issue at once), or 0."""
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_j = tl.arange(0, BLOCK_KB)
    half_k = K // 2
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if UNROLL_KB > 0:
        for kb0 in tl.static_range(0, UNROLL_KB, BLOCK_KB):
            acc = _mma_step(acc, kb0, p_x, p_w, p_s, o_n, m_n, o_m, m_m, o_j, half_k, stride_xm, stride_wn, stride_sn,
                            OPERAND)
    else:
        for kb0 in range(0, half_k, BLOCK_KB):
            acc = _mma_step(acc, kb0, p_x, p_w, p_s, o_n, m_n, o_m, m_m, o_j, half_k, stride_xm, stride_wn, stride_sn,
                            OPERAND)
    b_y = acc * (64.0 * tl.load(p_s2))
    tl.store(p_y + o_m[None, :] * stride_ym + o_n[:, None], b_y.to(p_y.dtype.element_ty),
             mask=m_n[:, None] & m_m[None, :])


def mma_config(m: int, n: int, k: int) -> dict:
    """Block sizes of `_nvfp4_mma_kernel` for x [m, k] and W [n, k] (tuned on the H200:
    bench/small_m_gemm.py --sweep, bench/RESULTS.md)."""
    block_kb = max(8, min(128, triton.next_power_of_2(k // 2)))
    block_n = 64 if n >= 8192 else 32 if n >= 2048 else 16
    return {"BLOCK_N": block_n, "BLOCK_KB": block_kb, "OPERAND": "x", "num_warps": 4, "num_stages": 3}
