"""A probe kernel around `ft.kernels.nvfp4.decode.pair_half_sum` (shared by the interpreter test, which runs
its Triton stand-in, and tests/gpu, which runs the inline PTX too), and the sums it stands for in torch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.nvfp4.decode import f16_pair, pair_half_sum

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@triton.jit
def _probe_kernel(p_w, p_x, p_out, N: tl.constexpr, ASM: tl.constexpr):
    """Block n: words p_w[2n], p_w[2n + 1]; x p_x[16n .. 16n + 15] (fp16) -> p_out[n]."""
    o = tl.arange(0, N)
    w1 = tl.load(p_w + 2 * o).to(tl.uint32, bitcast=True)
    w2 = tl.load(p_w + 2 * o + 1).to(tl.uint32, bitcast=True)
    p = p_x + 16 * o
    x0, x1, x2, x3 = tl.load(p), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3)
    x4, x5, x6, x7 = tl.load(p + 4), tl.load(p + 5), tl.load(p + 6), tl.load(p + 7)
    y0, y1, y2, y3 = tl.load(p + 8), tl.load(p + 9), tl.load(p + 10), tl.load(p + 11)
    y4, y5, y6, y7 = tl.load(p + 12), tl.load(p + 13), tl.load(p + 14), tl.load(p + 15)
    tl.store(p_out + o, pair_half_sum(w1, w2, f16_pair(x0, x2), f16_pair(x1, x3), f16_pair(x4, x6), f16_pair(x5, x7),
                                      f16_pair(y0, y2), f16_pair(y1, y3), f16_pair(y4, y6), f16_pair(y5, y7), ASM))


def run_probe(words: torch.Tensor, x: torch.Tensor, asm: bool) -> torch.Tensor:
    """words int32 [2n], x fp16 [16n] (one device) -> pair_half_sum of each block, fp32 [n]."""
    n = words.numel() // 2
    out = torch.empty(n, device=words.device)
    _probe_kernel[(1,)](words, x, out, N=n, ASM=asm)
    return out


def block_values(words: torch.Tensor) -> torch.Tensor:
    """int32 [2n] -> each block's 16 element values, times 2**-6, fp32 [n, 16] (exact)."""
    w = words.long() & 0xFFFFFFFF
    nib = torch.stack([(w >> (4 * j)) & 0xF for j in range(8)], dim=-1).reshape(-1, 16)
    mag = torch.tensor(E2M1, device=words.device)[nib & 7]
    return mag * torch.where(nib >= 8, -1.0, 1.0) / 64


def half_sums_in_torch(words: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`pair_half_sum`'s stand-in in torch: products rounded to fp16, elements 0, 1, 4, 5 of each word
    summed in one fp16 running sum and 2, 3, 6, 7 in the other, in order, then fp32."""
    prods = block_values(words).half() * x.reshape(-1, 16)
    out = []
    for lanes in ((0, 1, 4, 5, 8, 9, 12, 13), (2, 3, 6, 7, 10, 11, 14, 15)):
        acc = prods[:, lanes[0]]
        for j in lanes[1:]:
            acc = acc + prods[:, j]
        out.append(acc.float())
    return out[0] + out[1]
