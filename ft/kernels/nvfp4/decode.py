"""Triton helpers that decode NVFP4 codes (E2M1 nibbles, two a byte) and their E4M3 block scales:
inlined into the linear (`kernel.py`), MoE and attention kernels. Details module of
`ft.kernels.nvfp4`; the decode's arithmetic is described in `kernel.py`'s docstring.

* byte-wise: `e2m1_lo` / `e2m1_hi` (a nibble -> fp32, times 2**-6) and `dequant_tile` (a scaled
  [rows, k] tile in any dtype);
* word-wise: `lo_e4m3_word` / `hi_e4m3_word` (four nibbles' E4M3 bits in one 32-bit operation),
  `byte_f32` (one of them to fp32), `split8` / `join8` (a word's 8 element lanes apart and back)
  and `words_tile_f16` (a scaled [rows, k] fp16 tile, a word at a time: Triton runs uint8
  arithmetic one byte per instruction, so this is ~2x fewer instructions than `dequant_tile`);
* `e2m1_halves_f16`: code bytes and their scale bytes -> the scaled low and high nibbles in fp16,
  on the GPU by inline PTX (byte permutes from a table, ~3 instructions per element; Hopper has
  no E2M1 conversion), elsewhere (the interpreter) by the byte-wise helpers, to the same values;
  `e2m1_halves_bf16` the same in bf16 (two tables: a bf16 value's high and low bytes), against
  bf16 block scales; `e2m1_halves_f16_scaled`, the same fp16 halves times 2**-6 (`HALVES_SCALED_EXPONENT`),
  the nibbles turned into E4M3 bytes and converted two at a time (the decode attention's form: it
  beat the byte permutes there, bench/RESULTS.md session 16; a third form, the nibbles' bits placed
  straight into fp16's exponent and mantissa, lost to it and left the tree after commit d98949c).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["HALVES_SCALED_EXPONENT", "HALF_SUM_LIMIT", "HALF_SUM_LIMIT_EXPONENT", "dequant_tile", "e2m1_halves_bf16", "e2m1_halves_f16",
           "e2m1_halves_f16_scaled", "f16_pair", "pair_half_sum", "words_tile_f16"]

E2M1_F16_TABLE = (0x3E3C3800, 0x46444240)
"""The high bytes of the fp16 values of the E2M1 magnitudes 0, 0.5, 1, 1.5 | 2, 3, 4, 6 (the low
bytes are 0), byte i of the pair = magnitude code i: `prmt`'s 8-byte table."""
E2M1_BF16_HIGH = (0x3F3F3F00, 0x40404040)
E2M1_BF16_LOW = (0xC0800000, 0xC0804000)
"""The high and the low bytes of the bf16 values of the E2M1 magnitudes (0x0000, 0x3F00, 0x3F80,
0x3FC0 | 0x4000, 0x4040, 0x4080, 0x40C0), `prmt` tables as `E2M1_F16_TABLE`."""


@triton.jit
def e2m1_lo(b):
    """uint8 bytes -> fp32 value of the low nibble, times 2**-6 (byte-wise; the MoE kernels' scalar path)."""
    e4m3 = ((b & 0x08) << 4) | ((b & 0x07) << 2)
    return e4m3.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_hi(b):
    """uint8 bytes -> fp32 value of the high nibble, times 2**-6."""
    e4m3 = (b & 0x80) | ((b >> 2) & 0x1C)
    return e4m3.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e4m3_f32(b):
    """uint8 bits of float8_e4m3fn -> fp32."""
    return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def lo_e4m3_word(w):
    """uint32 words of 8 E2M1 nibbles -> uint32 words whose byte i is the E4M3 bits of byte i's low nibble."""
    return ((w << 4) & 0x80808080) | ((w << 2) & 0x1C1C1C1C)


@triton.jit
def hi_e4m3_word(w):
    """uint32 words of 8 E2M1 nibbles -> uint32 words whose byte i is the E4M3 bits of byte i's high nibble."""
    return (w & 0x80808080) | ((w >> 2) & 0x1C1C1C1C)


def _word_lanes_ptx() -> str:
    """PTX of `e2m1_word_lanes_f32`: a word's four low nibbles (then its four high) made E4M3 bytes
    in one 32-bit operation each (as `lo_e4m3_word`, `hi_e4m3_word`), converted two bytes at a
    time (`cvt.rn.f16x2.e4m3x2`, exact), each half widened to fp32 (exact). $8: the word; $0 .. $7:
    elements 0 .. 7, times 2**-6."""
    body = (".reg .b32 a, b, lo, hi, p;\n.reg .b16 l0, l1, h0, h1, e0, e1;\n"
            "shl.b32 a, $8, 4;\nand.b32 a, a, 0x80808080;\nshl.b32 b, $8, 2;\nand.b32 b, b, 0x1C1C1C1C;\n"
            "or.b32 lo, a, b;\n"
            "and.b32 a, $8, 0x80808080;\nshr.b32 b, $8, 2;\nand.b32 b, b, 0x1C1C1C1C;\nor.b32 hi, a, b;\n"
            "mov.b32 {l0, l1}, lo;\nmov.b32 {h0, h1}, hi;\n")
    # byte pair (0, 1) of the low word: elements 0 and 2; of the high word: 1 and 3; bytes 2, 3: 4, 6 / 5, 7
    for src, even, odd in (("l0", 0, 2), ("h0", 1, 3), ("l1", 4, 6), ("h1", 5, 7)):
        body += (f"cvt.rn.f16x2.e4m3x2 p, {src};\nmov.b32 {{e0, e1}}, p;\n"
                 f"cvt.f32.f16 ${even}, e0;\ncvt.f32.f16 ${odd}, e1;\n")
    return "\n{\n" + body + "}\n"


_E2M1_WORD_LANES_PTX = tl.constexpr(_word_lanes_ptx())


@triton.jit
def e2m1_word_lanes_f32(w, ASM: tl.constexpr):
    """uint32 words of 8 E2M1 nibbles (element 2i in byte i's low nibble, 2i + 1 in its high) -> the
    8 element lanes as fp32 (lane j: element j of each word, shape of w), times 2**-6, exact.
    ASM (a CUDA device): `_E2M1_WORD_LANES_PTX`, about 2.5 instructions an element where the
    Triton form takes about 4.5 (bytes extracted one at a time); the same values either way."""
    if ASM:
        d0, d1, d2, d3, d4, d5, d6, d7 = tl.inline_asm_elementwise(
            _E2M1_WORD_LANES_PTX, "=f,=f,=f,=f,=f,=f,=f,=f,r", [w], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        lo = lo_e4m3_word(w)
        hi = hi_e4m3_word(w)
        d0, d1, d2, d3 = byte_f32(lo, 0), byte_f32(hi, 0), byte_f32(lo, 1), byte_f32(hi, 1)
        d4, d5, d6, d7 = byte_f32(lo, 2), byte_f32(hi, 2), byte_f32(lo, 3), byte_f32(hi, 3)
    return d0, d1, d2, d3, d4, d5, d6, d7


HALF_SUM_LIMIT_EXPONENT = tl.constexpr(15)
HALF_SUM_LIMIT = 2.0 ** HALF_SUM_LIMIT_EXPONENT.value
"""`pair_half_sum` takes x below this magnitude (2**HALF_SUM_LIMIT_EXPONENT) (fp16's largest is 65,504; a block's running sum is at
most 0.75 x its largest |x|): `rows.dot_words_half` scales an x row with an element at or above it."""


def _pair_half_sum_ptx() -> str:
    """PTX of `pair_half_sum`: two words ($1, $2: one block of 16 elements) and x's fp16 pairs ($3 ..
    $10: word 1's (x0, x2), (x1, x3), (x4, x6), (x5, x7), then word 2's) -> $0, fp32. Each word's
    nibbles made E4M3 bytes as `_word_lanes_ptx` does, converted two at a time to fp16 pairs (elements
    (0, 2), (1, 3), (4, 6), (5, 7)) and multiplied into one fp16 pair of running sums by `fma.rn.f16x2`;
    the pair's halves widened to fp32 and added last."""
    body = ".reg .b32 a, b, lo, hi, d, acc;\n.reg .b16 l0, l1, h0, h1, s0, s1;\n.reg .f32 f0, f1;\n"
    first = True
    for word, xs in (("$1", (3, 4, 5, 6)), ("$2", (7, 8, 9, 10))):
        body += (f"shl.b32 a, {word}, 4;\nand.b32 a, a, 0x80808080;\nshl.b32 b, {word}, 2;\nand.b32 b, b, 0x1C1C1C1C;\n"
                 "or.b32 lo, a, b;\n"
                 f"and.b32 a, {word}, 0x80808080;\nshr.b32 b, {word}, 2;\nand.b32 b, b, 0x1C1C1C1C;\nor.b32 hi, a, b;\n"
                 "mov.b32 {l0, l1}, lo;\nmov.b32 {h0, h1}, hi;\n")
        for src, x in zip(("l0", "h0", "l1", "h1"), xs):
            body += f"cvt.rn.f16x2.e4m3x2 d, {src};\n"
            body += f"mul.rn.f16x2 acc, d, ${x};\n" if first else f"fma.rn.f16x2 acc, d, ${x}, acc;\n"
            first = False
    body += "mov.b32 {s0, s1}, acc;\ncvt.f32.f16 f0, s0;\ncvt.f32.f16 f1, s1;\nadd.f32 $0, f0, f1;\n"
    return "\n{\n" + body + "}\n"


_PAIR_HALF_SUM_PTX = tl.constexpr(_pair_half_sum_ptx())


@triton.jit
def f16_pair(a, b):
    """fp16 a and b -> uint32 words holding a in the low half and b in the high half (`pair_half_sum`'s x)."""
    return a.to(tl.uint16, bitcast=True).to(tl.uint32) | (b.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)


@triton.jit
def _lane_f16_of(e, I: tl.constexpr):
    """Byte I of uint32 words of E4M3 bits -> fp16 (exact)."""
    return (e >> (8 * I)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def pair_half_sum(w1, w2, x02, x13, x46, x57, y02, y13, y46, y57, ASM: tl.constexpr):
    """One block of 16 NVFP4 elements (uint32 words w1, w2: 8 E2M1 codes each) dotted with x -> fp32,
    times 2**-6, before the block scale: the products in fp16 (exact for an x that was bf16: a code
    has 2 significant bits, bf16 8; an x with more bits rounds in the FMA), summed in an fp16 pair of running sums (elements 0, 1, 4, 5 of
    each word in one, 2, 3, 6, 7 in the other, in that order), the two added in fp32. x02 .. x57 (word
    1) and y02 .. y57 (word 2): uint32 words of fp16 pairs of x (`f16_pair`: (x0, x2) and so on, x
    below `HALF_SUM_LIMIT`). Any shape, all alike (x broadcast). ASM: `_PAIR_HALF_SUM_PTX` (four
    `fma.rn.f16x2` a word where the fp32 form takes eight conversions and eight FMAs); otherwise the
    same sums in Triton's fp16 arithmetic, in the same order (the product rounded apart from the sum
    where it is not exact: within fp16's rounding of the PTX's)."""
    if ASM:
        r = tl.inline_asm_elementwise(_PAIR_HALF_SUM_PTX, "=f,r,r,r,r,r,r,r,r,r,r",
                                      [w1, w2, x02, x13, x46, x57, y02, y13, y46, y57], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        lo = lo_e4m3_word(w1)
        hi = hi_e4m3_word(w1)
        xl = x02.to(tl.uint16).to(tl.float16, bitcast=True)
        xh = (x02 >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        a = _lane_f16_of(lo, 0) * xl  # elements 0 | 2
        b = _lane_f16_of(lo, 1) * xh
        a = a + _lane_f16_of(hi, 0) * x13.to(tl.uint16).to(tl.float16, bitcast=True)  # 1 | 3
        b = b + _lane_f16_of(hi, 1) * (x13 >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        a = a + _lane_f16_of(lo, 2) * x46.to(tl.uint16).to(tl.float16, bitcast=True)  # 4 | 6
        b = b + _lane_f16_of(lo, 3) * (x46 >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        a = a + _lane_f16_of(hi, 2) * x57.to(tl.uint16).to(tl.float16, bitcast=True)  # 5 | 7
        b = b + _lane_f16_of(hi, 3) * (x57 >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        lo = lo_e4m3_word(w2)
        hi = hi_e4m3_word(w2)
        a = a + _lane_f16_of(lo, 0) * y02.to(tl.uint16).to(tl.float16, bitcast=True)
        b = b + _lane_f16_of(lo, 1) * (y02 >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        a = a + _lane_f16_of(hi, 0) * y13.to(tl.uint16).to(tl.float16, bitcast=True)
        b = b + _lane_f16_of(hi, 1) * (y13 >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        a = a + _lane_f16_of(lo, 2) * y46.to(tl.uint16).to(tl.float16, bitcast=True)
        b = b + _lane_f16_of(lo, 3) * (y46 >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        a = a + _lane_f16_of(hi, 2) * y57.to(tl.uint16).to(tl.float16, bitcast=True)
        b = b + _lane_f16_of(hi, 3) * (y57 >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        r = a.to(tl.float32) + b.to(tl.float32)
    return r


@triton.jit
def byte_f32(e, I: tl.constexpr):
    """Byte I of uint32 words of E4M3 bits -> fp32."""
    return (e >> (8 * I)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def split8(t, A: tl.constexpr, B: tl.constexpr):
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
def join8(t0, t1, t2, t3, t4, t5, t6, t7, A: tl.constexpr, B: tl.constexpr):
    """8 lanes [A, B] -> [A, 8 * B] with element 8w + j = lane j's column w (`split8` undone)."""
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
    E4M3 bits a word at a time (`lo_e4m3_word`), each byte converted to fp16 and multiplied by its
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
    lo = lo_e4m3_word(b_w)
    hi = hi_e4m3_word(b_w)
    return join8(_lane_f16(lo, 0, b_sc), _lane_f16(hi, 0, b_sc), _lane_f16(lo, 1, b_sc), _lane_f16(hi, 1, b_sc),
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
    b_s = e4m3_f32(tl.load(p_s + o_r[:, None] * stride_sr + o_g[None, :], mask=m_s, other=0)) * 64.0
    b_s = tl.reshape(tl.broadcast_to(b_s[:, :, None], (BLOCK_R, G, 16)), (BLOCK_R, BLOCK_K))
    b_dec = tl.reshape(tl.join(e2m1_lo(b_w), e2m1_hi(b_w)), (BLOCK_R, BLOCK_K))  # even, odd interleaved
    return (b_dec * b_s).to(dtype)


def _select(shift: int, mask: str) -> str:
    """PTX: s = (the code bytes >> shift) & mask (`shift` 0: the bytes as they are; -4: w4)."""
    if shift == -4:
        return f"and.b32 s, w4, {mask};\n"
    if shift == 0:
        return f"and.b32 s, $4, {mask};\n"
    return f"shr.b32 s, $4, {shift};\nand.b32 s, s, {mask};\n"


# per output pair ($0 .. $3): the high-byte selector's shift (-4: the bytes shifted left by 4), the
# low-byte selector's shift (bf16), the register whose byte tops hold the signs, their selector
_PAIRS = ((-4, 0, "w4", "0x9484"), (12, 16, "w4", "0xB4A4"), (0, 4, "$4", "0x9484"), (16, 20, "$4", "0xB4A4"))


def _halves_ptx(bf16: bool) -> str:
    """The PTX of `e2m1_halves_f16` (bf16 False) or `e2m1_halves_bf16` (True): see their constants' notes."""
    if bf16:
        head = (".reg .b32 h0, h1, l0, l1, z, m, w4, s, t, v, g;\n"
                + "".join(f"mov.b32 {r}, {v};\n" for r, v in zip(("h0", "h1", "l0", "l1"), E2M1_BF16_HIGH + E2M1_BF16_LOW))
                + "mov.b32 z, 0;\nmov.b32 m, 0x80008000;\n")
        table, scales = "h0, h1", ("$5", "$6", "$5", "$6")
    else:
        head = (".reg .b32 t0, t1, z, m, w4, s, v, g, c01, c23;\n.reg .b16 sa, sb;\n"
                + "".join(f"mov.b32 {r}, {v};\n" for r, v in zip(("t0", "t1"), E2M1_F16_TABLE))
                + "mov.b32 z, 0;\nmov.b32 m, 0x80008000;\nmov.b32 {sa, sb}, $5;\n"
                + "cvt.rn.f16x2.e4m3x2 c01, sa;\ncvt.rn.f16x2.e4m3x2 c23, sb;\n")
        table, scales = "t0, t1", ("c01", "c23", "c01", "c23")
    body = "shl.b32 w4, $4, 4;\n"
    for i, ((hi, lo, sign, sel), sc) in enumerate(zip(_PAIRS, scales)):
        body += _select(hi, "0x7070") + f"prmt.b32 v, {table}, s;\n"
        if bf16:
            body += _select(lo, "0x0707") + "prmt.b32 t, l0, l1, s;\n"
        body += f"prmt.b32 g, {sign}, z, {sel};\n"
        if bf16:
            body += "or.b32 v, v, t;\n"
        body += f"lop3.b32 v, v, g, m, 0xF8;\nmul.rn.{'bf16x2' if bf16 else 'f16x2'} ${i}, v, {sc};\n"
    return "\n{\n" + head + body + "}\n"


_E2M1_HALVES_PTX = tl.constexpr(_halves_ptx(bf16=False))
"""Four code bytes ($4) and their four E4M3 scale bytes ($5) -> the low nibbles' values ($0: bytes 0
and 1, $1: bytes 2 and 3, fp16 pairs) and the high nibbles' ($2, $3), each times its byte's scale.
A pair's magnitudes: `prmt` over the table with the two 3-bit codes as the selectors of the high
bytes (selector 0 picks the table's 0 for the low bytes); its signs: `prmt` in sign-replicate
mode (a selector's bit 3) copies each code's sign bit, moved to its byte's top bit (the low
nibbles shifted by 4 first), over the high byte, and `lop3` keeps bit 15 of each half (a | (b & c),
LUT 0xF8); then one `mul.f16x2` by the scales, exact (a code times an E4M3 scale has at most 6
significant bits and lies in [2**-10, 2,688]). Each pair takes its own two scale bytes, so the
result does not depend on which four elements Triton packs together."""


@triton.jit
def e2m1_halves_f16(b_w, b_s, ASM: tl.constexpr):
    """uint8 code bytes b_w and uint8 E4M3 scale bytes b_s (same shape: each byte's block scale) ->
    (low nibble x scale, high nibble x scale) as float16, exact, without the global scale.
    ASM (a CUDA device, not the interpreter): `_E2M1_HALVES_PTX`, four bytes per instance;
    otherwise the byte-wise decode (`e2m1_lo` / `e2m1_hi`, times 2**-6) to the same values."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_E2M1_HALVES_PTX, "=r,=r,=r,=r,r,r", [b_w, b_s],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        sc = e4m3_f32(b_s) * 64.0  # (the nibble decode gives values times 2**-6)
        lo = (e2m1_lo(b_w) * sc).to(tl.float16)
        hi = (e2m1_hi(b_w) * sc).to(tl.float16)
    return lo, hi


_E2M1_HALVES_BF16_PTX = tl.constexpr(_halves_ptx(bf16=True))
"""`_E2M1_HALVES_PTX` in bf16: four code bytes ($4) and the bf16 block scales of their elements ($5:
bytes 0 and 1, $6: bytes 2 and 3) -> the low nibbles' values ($0, $1) and the high nibbles' ($2,
$3), bf16 pairs. A pair's high bytes come from one `prmt` (the codes as the selectors of bytes 1
and 3), its low bytes from another (selectors of bytes 0 and 2), the signs as in the fp16 form;
then `mul.bf16x2` by the scales, exact (at most 6 significant bits, within bf16's 8)."""


@triton.jit
def e2m1_halves_bf16(b_w, b_sc, ASM: tl.constexpr):
    """uint8 code bytes b_w and bf16 block scales b_sc (same shape: each byte's block scale, an E4M3
    value, exact in bf16) -> (low nibble x scale, high nibble x scale) as bfloat16, exact, without
    the global scale. ASM: `_E2M1_HALVES_BF16_PTX`; otherwise the byte-wise decode to the same values."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_E2M1_HALVES_BF16_PTX, "=r,=r,=r,=r,r,r,r", [b_w, b_sc],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        sc = b_sc.to(tl.float32) * 64.0  # (the nibble decode gives values times 2**-6)
        lo = (e2m1_lo(b_w) * sc).to(tl.bfloat16)
        hi = (e2m1_hi(b_w) * sc).to(tl.bfloat16)
    return lo, hi


HALVES_SCALED_EXPONENT = 6
"""`e2m1_halves_f16_scaled` gives the values times 2**-HALVES_SCALED_EXPONENT."""


def _cvt_ptx() -> str:
    """PTX of `e2m1_halves_f16_scaled`: the four low nibbles (then the four high) made E4M3 bytes in one
    32-bit operation each (sign to bit 7, e1 e0 m to bits 4..2: the value times 2**-6, the
    subnormal code included), converted two bytes at a time (`cvt.rn.f16x2.e4m3x2`), exact; the
    block scales converted alike, a pair per code-byte pair."""
    body = (".reg .b32 e, f, t, c01, c23;\n.reg .b16 sa, sb, e0, e1;\nmov.b32 {sa, sb}, $5;\n"
            "cvt.rn.f16x2.e4m3x2 c01, sa;\ncvt.rn.f16x2.e4m3x2 c23, sb;\n"
            "shl.b32 e, $4, 4;\nand.b32 e, e, 0x80808080;\nshl.b32 f, $4, 2;\nand.b32 f, f, 0x1C1C1C1C;\n"
            "or.b32 e, e, f;\nmov.b32 {e0, e1}, e;\n"
            "cvt.rn.f16x2.e4m3x2 t, e0;\nmul.rn.f16x2 $0, t, C01;\ncvt.rn.f16x2.e4m3x2 t, e1;\nmul.rn.f16x2 $1, t, C23;\n"
            "and.b32 e, $4, 0x80808080;\nshr.b32 f, $4, 2;\nand.b32 f, f, 0x1C1C1C1C;\nor.b32 e, e, f;\n"
            "mov.b32 {e0, e1}, e;\n"
            "cvt.rn.f16x2.e4m3x2 t, e0;\nmul.rn.f16x2 $2, t, C01;\ncvt.rn.f16x2.e4m3x2 t, e1;\nmul.rn.f16x2 $3, t, C23;\n")
    return "\n{\n" + body.replace("C01", "c01").replace("C23", "c23") + "}\n"


_E2M1_CVT_PTX = tl.constexpr(_cvt_ptx())


@triton.jit
def e2m1_halves_f16_scaled(b_w, b_s, ASM: tl.constexpr):
    """`e2m1_halves_f16` times 2**-6 (`HALVES_SCALED_EXPONENT`): (low nibble x scale, high nibble x
    scale) x 2**-6 in float16, exact (a product has at most 6 significant bits and is a multiple of
    2**-24 at the smallest, fp16's subnormal step). The caller undoes the power of two in fp32 (the
    dots' products stay exact and their sums scale exactly). ASM: `_E2M1_CVT_PTX` (E4M3 bytes
    converted two at a time); otherwise the byte-wise stand-in to the same values."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_E2M1_CVT_PTX, "=r,=r,=r,=r,r,r", [b_w, b_s],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        sc = e4m3_f32(b_s)  # (the nibble decode gives values times 2**-6)
        lo = (e2m1_lo(b_w) * sc).to(tl.float16)
        hi = (e2m1_hi(b_w) * sc).to(tl.float16)
    return lo, hi
