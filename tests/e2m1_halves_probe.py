"""A probe kernel around `ft.kernels.nvfp4.decode.e2m1_halves_f16` / `e2m1_halves_bf16` (shared by the
interpreter test, which runs their byte-wise stand-in, and tests/gpu, which runs the inline PTX):
every code byte against every E4M3 scale of a set, decoded to (low, high) and compared exactly with
the dequantization by the torch reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.nvfp4.decode import e2m1_halves_bf16, e2m1_halves_f16
from ft.kernels.nvfp4.reference import dequantize_nvfp4

ROWS, COLS = 64, 256
"""The probe's tile: byte (r, c) = (r * COLS + c) % 256 paired with scale byte row r (one per row)."""


@triton.jit
def _probe_kernel(p_w, p_s, p_lo, p_hi, BF16: tl.constexpr, ASM: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    o = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    b_w = tl.load(p_w + o)
    b_s = tl.load(p_s + o)
    if BF16:
        lo, hi = e2m1_halves_bf16(b_w, b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.bfloat16), ASM)
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


def run_probe(device, dtype: torch.dtype, asm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's (low, high) tiles in `dtype` (fp16 or bf16) against the reference's, float32."""
    codes, scales = probe_inputs(device)
    lo = torch.empty(ROWS, COLS, dtype=dtype, device=device)
    hi = torch.empty_like(lo)
    _probe_kernel[(1,)](codes, scales, lo, hi, BF16=dtype == torch.bfloat16, ASM=asm, R=ROWS, C=COLS)
    # reference: row r's bytes as one NVFP4 row of 2 * COLS elements with the row's scale in each block
    ref = dequantize_nvfp4(codes.cpu(), scales.cpu()[:, ::8].view(torch.float8_e4m3fn), 1.0)  # [ROWS, 2 * COLS]
    return torch.stack([lo.float().cpu(), hi.float().cpu()]), torch.stack([ref[:, 0::2], ref[:, 1::2]])
