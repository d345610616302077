"""Triton helpers that decode NVFP4 codes (E2M1 nibbles, two a byte) and their E4M3 block scales:
inlined into the linear (`kernel.py`), MoE and attention kernels. Details module of
`ft.kernels.nvfp4`; the decode's arithmetic is described in `kernel.py`'s docstring.

* byte-wise: `_e2m1_lo` / `_e2m1_hi` (a nibble -> fp32, times 2**-6) and `dequant_tile` (a scaled
  [rows, k] tile in any dtype);
* word-wise: `_lo_e4m3_word` / `_hi_e4m3_word` (four nibbles' E4M3 bits in one 32-bit operation),
  `_byte_f32` (one of them to fp32), `_split8` / `_join8` (a word's 8 element lanes apart and back)
  and `words_tile_f16` (a scaled [rows, k] fp16 tile, a word at a time: Triton runs uint8
  arithmetic one byte per instruction, so this is ~2x fewer instructions than `dequant_tile`).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["dequant_tile", "words_tile_f16"]


@triton.jit
def _e2m1_lo(b):
    """uint8 bytes -> fp32 value of the low nibble, times 2**-6 (byte-wise; the MoE kernels' scalar path)."""
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
def _lo_e4m3_word(w):
    """uint32 words of 8 E2M1 nibbles -> uint32 words whose byte i is the E4M3 bits of byte i's low nibble."""
    return ((w << 4) & 0x80808080) | ((w << 2) & 0x1C1C1C1C)


@triton.jit
def _hi_e4m3_word(w):
    """uint32 words of 8 E2M1 nibbles -> uint32 words whose byte i is the E4M3 bits of byte i's high nibble."""
    return (w & 0x80808080) | ((w >> 2) & 0x1C1C1C1C)


@triton.jit
def _byte_f32(e, I: tl.constexpr):
    """Byte I of uint32 words of E4M3 bits -> fp32."""
    return (e >> (8 * I)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _split8(t, A: tl.constexpr, B: tl.constexpr):
    """[A, B, 8] -> its 8 lanes t[:, :, 0] .. t[:, :, 7] (each [A, B])."""
    ev, od = tl.split(tl.reshape(t, (A, B, 4, 2)))  # ev: lanes 0 2 4 6; od: 1 3 5 7
    ev04, ev26 = tl.split(tl.reshape(ev, (A, B, 2, 2)))
    od15, od37 = tl.split(tl.reshape(od, (A, B, 2, 2)))
    t0, t4 = tl.split(ev04)
    t2, t6 = tl.split(ev26)
    t1, t5 = tl.split(od15)
    t3, t7 = tl.split(od37)
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def _join8(t0, t1, t2, t3, t4, t5, t6, t7, A: tl.constexpr, B: tl.constexpr):
    """8 lanes [A, B] -> [A, 8 * B] with element 8w + j = lane j's column w (`_split8` undone)."""
    ev = tl.reshape(tl.join(tl.join(t0, t4), tl.join(t2, t6)), (A, B, 4))  # lanes 0 2 4 6
    od = tl.reshape(tl.join(tl.join(t1, t5), tl.join(t3, t7)), (A, B, 4))  # lanes 1 3 5 7
    return tl.reshape(tl.join(ev, od), (A, 8 * B))


@triton.jit
def _lane_f16(e, I: tl.constexpr, b_sc):
    """Byte I of uint32 words of E4M3 bits -> fp16, times b_sc (fp16, same shape)."""
    return (e >> (8 * I)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16) * b_sc


@triton.jit
def words_tile_f16(p_w, p_s, o_row, o_srow, m_r, kb0, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Elements [2 * kb0, 2 * kb0 + BLOCK_K) of BLOCK_R NVFP4 rows -> [BLOCK_R, BLOCK_K] float16, in k
    order, exact, without the global scale: the codes read as 32-bit words (8 codes) and turned into
    E4M3 bits a word at a time (`_lo_e4m3_word`), each byte converted to fp16 and multiplied by its
    block's scale (times 64, the E4M3 placement's 2**-6) in fp16: a code (2 significant bits) times
    an E4M3 scale (4) is exact in fp16 and lies in [2**-10, 2,688] or is 0. Row r's codes start at
    byte p_w + o_row[r], its E4M3 scale bytes at p_s + o_srow[r]; p_w, o_row and kb0 multiples of 4
    (the word loads' alignment), the tile inside the row (no mask along k); masked rows give 0."""
    W: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // 16
    o_w = kb0 // 4 + tl.arange(0, W)
    b_w = tl.load(p_w.to(tl.pointer_type(tl.uint32)) + (o_row // 4)[:, None] + o_w[None, :], mask=m_r[:, None],
                  other=0)
    o_g = kb0 // 8 + tl.arange(0, G)
    b_s = tl.load(p_s + o_srow[:, None] + o_g[None, :], mask=m_r[:, None], other=0)
    b_s = b_s.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 64.0
    b_sc = tl.reshape(tl.broadcast_to(b_s[:, :, None], (BLOCK_R, G, 2)), (BLOCK_R, W))  # word w: scale w // 2
    lo = _lo_e4m3_word(b_w)
    hi = _hi_e4m3_word(b_w)
    return _join8(_lane_f16(lo, 0, b_sc), _lane_f16(hi, 0, b_sc), _lane_f16(lo, 1, b_sc), _lane_f16(hi, 1, b_sc),
                  _lane_f16(lo, 2, b_sc), _lane_f16(hi, 2, b_sc), _lane_f16(lo, 3, b_sc), _lane_f16(hi, 3, b_sc),
                  BLOCK_R, W)


@triton.jit
def dequant_tile(p_w, p_s, o_r, m_r, stride_wr, stride_sr, kb0, half_k, dtype: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr = False):
    """Rows o_r and elements [2 * kb0, 2 * kb0 + BLOCK_K) of an NVFP4 weight (uint8 packed at p_w, E4M3
    scales at p_s; half_k = bytes per row; kb0 a multiple of 8) -> the dequantized tile
    [BLOCK_R, BLOCK_K] / scale_2 in ``dtype``, in k order (exact: at most 5 significant bits).
    Masked rows and bytes past half_k give 0. EVEN: the caller knows that the tile lies inside the
    row (kb0 + BLOCK_K / 2 <= half_k): no mask along k, so that the loads vectorize (a mask
    against a runtime half_k makes every byte a load of its own)."""
    G: tl.constexpr = BLOCK_K // 16
    o_kb = kb0 + tl.arange(0, BLOCK_K // 2)
    o_g = kb0 // 8 + tl.arange(0, G)
    if EVEN:
        m_w = m_r[:, None]
        m_s = m_r[:, None]
    else:
        m_w = m_r[:, None] & (o_kb < half_k)[None, :]
        m_s = m_r[:, None] & (o_g < half_k // 8)[None, :]
    b_w = tl.load(p_w + o_r[:, None] * stride_wr + o_kb[None, :], mask=m_w, other=0)
    b_s = _e4m3(tl.load(p_s + o_r[:, None] * stride_sr + o_g[None, :], mask=m_s, other=0)) * 64.0
    b_s = tl.reshape(tl.broadcast_to(b_s[:, :, None], (BLOCK_R, G, 16)), (BLOCK_R, BLOCK_K))
    b_dec = tl.reshape(tl.join(_e2m1_lo(b_w), _e2m1_hi(b_w)), (BLOCK_R, BLOCK_K))  # even, odd interleaved
    return (b_dec * b_s).to(dtype)
