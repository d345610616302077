"""A probe kernel around `ft.kernels.nvfp4.decode.e2m1_halves_f16` / `e2m1_halves_bf16` /
`e2m1_halves_f16_scaled` and `e2m1_word_lanes_f32` (shared by the interpreter test, which runs their byte-wise stand-in, and
tests/gpu, which runs the inline PTX): every code byte against every E4M3 scale of a set, decoded
to (low, high) and compared exactly with the dequantization by the torch reference (times the
scaled form's power of two)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.nvfp4.decode import (HALVES_SCALED_EXPONENT, e2m1_halves_bf16, e2m1_halves_f16, e2m1_halves_f16_scaled,
                                     e2m1_word_lanes_f32)
from ft.kernels.nvfp4.reference import dequantize_nvfp4

ROWS, COLS = 64, 256
"""The probe's tile: byte (r, c) = (r * COLS + c) % 256 paired with scale byte row r (one per row)."""


@triton.jit
def _probe_kernel(p_w, p_s, p_lo, p_hi, BF16: tl.constexpr, ASM: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                  SCALED: tl.constexpr = False):
    o = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    b_w = tl.load(p_w + o)
    b_s = tl.load(p_s + o)
    if BF16:
        lo, hi = e2m1_halves_bf16(b_w, b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.bfloat16), ASM)
    elif SCALED:
        lo, hi = e2m1_halves_f16_scaled(b_w, b_s, ASM)
    else:
        lo, hi = e2m1_halves_f16(b_w, b_s, ASM)
    tl.store(p_lo + o, lo)
    tl.store(p_hi + o, hi)


def probe_inputs(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(code bytes uint8 [ROWS, COLS], scale bytes uint8 [ROWS, COLS]): every byte value in every row;
    per row one E4M3 scale among subnormals, small and large normals, 448 (the largest) and 0."""
    codes = (torch.arange(ROWS * COLS, device=device) % 256).to(torch.uint8).reshape(ROWS, COLS)
    picks = torch.tensor([0x00, 0x01, 0x07, 0x08, 0x30, 0x38, 0x40, 0x55, 0x66, 0x7E], dtype=torch.int32)
    rows = picks[torch.arange(ROWS) % len(picks)].to(torch.uint8).to(device)
    return codes, rows[:, None].expand(ROWS, COLS).contiguous()


def run_probe(device, dtype: torch.dtype, asm: bool, scaled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's (low, high) tiles in `dtype` (fp16 or bf16; fp16 `scaled`: `e2m1_halves_f16_scaled`)
    against the reference's (times 2**-HALVES_SCALED_EXPONENT when scaled), float32."""
    codes, scales = probe_inputs(device)
    lo = torch.empty(ROWS, COLS, dtype=dtype, device=device)
    hi = torch.empty_like(lo)
    _probe_kernel[(1,)](codes, scales, lo, hi, BF16=dtype == torch.bfloat16, ASM=asm, R=ROWS, C=COLS, SCALED=scaled)
    # reference: row r's bytes as one NVFP4 row of 2 * COLS elements with the row's scale in each block
    ref = dequantize_nvfp4(codes.cpu(), scales.cpu()[:, ::8].view(torch.float8_e4m3fn), 1.0)  # [ROWS, 2 * COLS]
    ref = ref * 2.0 ** -(HALVES_SCALED_EXPONENT if scaled else 0)  # exact: a power of two, inside fp32's normal range
    return torch.stack([lo.float().cpu(), hi.float().cpu()]), torch.stack([ref[:, 0::2], ref[:, 1::2]])


WORDS = 4096
"""The word-lanes probe: word n's byte i = (n * (2i + 1) + 61 i) % 256, every byte value at every
position (an odd multiplier is a bijection mod 256)."""


@triton.jit
def _lanes_probe_kernel(p_w, p_out, ASM: tl.constexpr, N: tl.constexpr):
    o = tl.arange(0, N)
    d0, d1, d2, d3, d4, d5, d6, d7 = e2m1_word_lanes_f32(tl.load(p_w + o).to(tl.uint32, bitcast=True), ASM)
    tl.store(p_out + o * 8, d0)
    tl.store(p_out + o * 8 + 1, d1)
    tl.store(p_out + o * 8 + 2, d2)
    tl.store(p_out + o * 8 + 3, d3)
    tl.store(p_out + o * 8 + 4, d4)
    tl.store(p_out + o * 8 + 5, d5)
    tl.store(p_out + o * 8 + 6, d6)
    tl.store(p_out + o * 8 + 7, d7)


def run_lanes_probe(device, asm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(`e2m1_word_lanes_f32`'s elements of the probe words, fp32 [WORDS * 8], element 8n + j = lane j
    of word n; the reference's dequantized values times 2**-6), both on the CPU."""
    n = torch.arange(WORDS, dtype=torch.int64)[:, None]
    i = torch.arange(4, dtype=torch.int64)[None, :]
    codes = ((n * (2 * i + 1) + 61 * i) % 256).to(torch.uint8)  # [WORDS, 4]: the words' bytes in memory order
    words = codes.reshape(-1).view(torch.int32).to(device)
    out = torch.empty(WORDS * 8, dtype=torch.float32, device=device)
    _lanes_probe_kernel[(1,)](words, out, ASM=asm, N=WORDS)
    ones = torch.full((1, WORDS * 8 // 16), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)  # E4M3 1.0
    ref = dequantize_nvfp4(codes.reshape(1, -1), ones, 1.0).reshape(-1) * 2.0 ** -6
    return out.cpu(), ref
