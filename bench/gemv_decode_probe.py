"""How much faster would the M = 1 NVFP4 GEMV be with the E2M1 decode in inline PTX? (kernels issue). Not a test.

    PYTHONPATH=. python3 bench/gemv_decode_probe.py

The product's GEMV (`ft.kernels.nvfp4_triton`) decodes in plain Triton, as the issue asks (the
interpreter runs it on CPU). Its SASS costs ~6.5 instructions per weight element, most of them
in moving each E4M3 byte to its own register before the fp8x2 -> f16x2 conversion. This probe is
the same kernel with the decode of one 32-bit word (8 elements) written in PTX: 8 integer
operations for the E4M3 bits of all 8 nibbles, 4 ``cvt.rn.f16x2.e4m3x2`` on the word's halves,
8 ``cvt.f32.f16``. It runs on the GPU only; correctness is checked against the reference here.
Also a plain-Triton restructuring, `_gemv_rowloop_kernel`: the whole K in one tile, x split into its
lanes once per program, a loop over row blocks (no per-step shared-memory trip for x).
Prints a table last: plain vs PTX decode vs row loop, CUDA-graph timing with rotated weights.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from bench.gpu_timing import COPY_CEILING_GBS, copies_for, graph_us, rel_rms
from bench.kernels_nvfp4 import random_nvfp4
from ft.kernels.nvfp4 import nvfp4_linear_ref
from ft.kernels.nvfp4_triton import _byte_f32, _e4m3, _hi_e4m3_word, _lo_e4m3_word, _split8, as_words, nvfp4_linear_triton

_DECODE_PTX = tl.constexpr("""
{
.reg .b32 t0, t1, lo, hi, f01, f23, g01, g23;
.reg .b16 l01, l23, h01, h23, a, b;
shl.b32 t0, $8, 4;
and.b32 t0, t0, 0x80808080;
shl.b32 t1, $8, 2;
and.b32 t1, t1, 0x1C1C1C1C;
or.b32 lo, t0, t1;
and.b32 t0, $8, 0x80808080;
shr.b32 t1, $8, 2;
and.b32 t1, t1, 0x1C1C1C1C;
or.b32 hi, t0, t1;
mov.b32 {l01, l23}, lo;
mov.b32 {h01, h23}, hi;
cvt.rn.f16x2.e4m3x2 f01, l01;
cvt.rn.f16x2.e4m3x2 f23, l23;
cvt.rn.f16x2.e4m3x2 g01, h01;
cvt.rn.f16x2.e4m3x2 g23, h23;
mov.b32 {a, b}, f01;
cvt.f32.f16 $0, a;
cvt.f32.f16 $2, b;
mov.b32 {a, b}, g01;
cvt.f32.f16 $1, a;
cvt.f32.f16 $3, b;
mov.b32 {a, b}, f23;
cvt.f32.f16 $4, a;
cvt.f32.f16 $6, b;
mov.b32 {a, b}, g23;
cvt.f32.f16 $5, a;
cvt.f32.f16 $7, b;
}
""")


@triton.jit
def _gemv_ptx_kernel(p_x, p_w, p_s, p_s2, p_y, N, K, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    i_n = tl.program_id(0)
    o_r = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_r = o_r < N
    BG: tl.constexpr = BLOCK_W // 2
    acc = tl.zeros((BLOCK_N, BG), dtype=tl.float32)
    o_8 = tl.arange(0, 8)
    w_hi = K // 8
    for w0 in range(0, w_hi, BLOCK_W):
        o_w = w0 + tl.arange(0, BLOCK_W)
        o_g = w0 // 2 + tl.arange(0, BG)
        m_w = o_w < w_hi
        b_w = tl.load(p_w + o_r[:, None] * stride_wn + o_w[None, :], mask=m_r[:, None] & m_w[None, :], other=0)
        b_s = _e4m3(tl.load(p_s + o_r[:, None] * stride_sn + o_g[None, :], mask=m_r[:, None] & (o_g * 2 < w_hi)[None, :], other=0))
        b_x = tl.load(p_x + (8 * o_w)[:, None] + o_8[None, :], mask=m_w[:, None], other=0.0).to(tl.float32)
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(tl.reshape(b_x, (1, BLOCK_W, 8)), 1, BLOCK_W)
        d0, d1, d2, d3, d4, d5, d6, d7 = tl.inline_asm_elementwise(
            _DECODE_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [b_w], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        part = d0 * tl.reshape(x0, (1, BLOCK_W))
        part += d1 * tl.reshape(x1, (1, BLOCK_W))
        part += d2 * tl.reshape(x2, (1, BLOCK_W))
        part += d3 * tl.reshape(x3, (1, BLOCK_W))
        part += d4 * tl.reshape(x4, (1, BLOCK_W))
        part += d5 * tl.reshape(x5, (1, BLOCK_W))
        part += d6 * tl.reshape(x6, (1, BLOCK_W))
        part += d7 * tl.reshape(x7, (1, BLOCK_W))
        acc += tl.sum(tl.reshape(part, (BLOCK_N, BG, 2)), axis=2) * b_s
    b_y = tl.sum(acc, axis=1) * 64.0 * tl.load(p_s2)
    tl.store(p_y + o_r, b_y.to(p_y.dtype.element_ty), mask=m_r)


def gemv_ptx(x, packed, scale, scale_2, *, out, block_n=32, block_w=64, num_warps=4):
    words = as_words(packed)
    s_u8 = scale.view(torch.uint8)
    s2 = scale_2.reshape(1).float()
    n = packed.shape[0]
    _gemv_ptx_kernel[(triton.cdiv(n, block_n),)](x, words, s_u8, s2, out, n, x.shape[1], words.stride(0), s_u8.stride(0),
                                                  BLOCK_N=block_n, BLOCK_W=block_w, num_warps=num_warps)
    return out


SHAPES = [("in_proj_qkvz", 12288, 2048), ("attn_q", 8192, 2048), ("out_proj", 2048, 4096), ("expert_gate_up", 1024, 2048),
          ("expert_down", 2048, 512), ("large", 32768, 8192)]
TILES = [(32, 64, 4), (16, 64, 4), (8, 64, 4), (4, 128, 4), (64, 32, 4), (32, 128, 8)]


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rows = []
    for name, n, k in SHAPES:
        q = [random_nvfp4(n, k) for _ in range(copies_for(n * k // 2))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        ref = nvfp4_linear_ref(x, *q[0])
        t_plain = graph_us([partial(nvfp4_linear_triton, x, *w, out=y) for w in q])
        best = (float("inf"), None, float("nan"))
        for bn, bw, nw in TILES:
            if k // 8 < bw:
                continue
            out = torch.full_like(y, float("nan"))
            err = rel_rms(gemv_ptx(x, *q[0], out=out, block_n=bn, block_w=bw, num_warps=nw), ref)
            t = graph_us([partial(gemv_ptx, x, *w, out=y, block_n=bn, block_w=bw, num_warps=nw) for w in q])
            print(f"  {name} ptx bn{bn} bw{bw} w{nw}: {t:.2f} us err {err:.1e}", flush=True)
            if err < 1e-2 and t < best[0]:
                best = (t, (bn, bw, nw), err)
        kw = k // 8
        best_rl = (float("inf"), None, float("nan"))
        for bn in (1, 2, 4, 8, 16, 32, 64):
            if bn * kw not in (2048, 4096):
                continue
            for steps in (1, 2, 4, 8, 16):
                if not 128 <= n // (bn * steps) <= 4096:
                    continue
                out = torch.full_like(y, float("nan"))
                err = rel_rms(gemv_rowloop(x, *q[0], out=out, block_n=bn, steps=steps), ref)
                t = graph_us([partial(gemv_rowloop, x, *w, out=y, block_n=bn, steps=steps) for w in q])
                print(f"  {name} rowloop bn{bn} steps{steps}: {t:.2f} us err {err:.1e}", flush=True)
                if err < 1e-2 and t < best_rl[0]:
                    best_rl = (t, (bn, steps), err)
        nbytes = n * k // 2 + n * k // 16 + 2 * k + 2 * n
        rows.append((name, f"{n}x{k}", t_plain, best[0], best[1], best[2], nbytes, best_rl))
        del q
        torch.cuda.empty_cache()
    print("\n| shape | N x K | plain Triton us | of 4.3 TB/s | PTX decode us | of 4.3 TB/s | PTX tile | PTX rel RMS | speedup "
          "| row-loop us | of 4.3 TB/s | row-loop (rows, steps) | rel RMS | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, nk, tp, tx, tile, err, nb, (tr, tile_r, err_r) in rows:
        frac = lambda t: f"{nb / t / 1e3 / COPY_CEILING_GBS:.0%}"  # noqa: E731
        print(f"| {name} | {nk} | {tp:.2f} | {frac(tp)} | {tx:.2f} | {frac(tx)} | {tile} | {err:.1e} | {tp / tx:.2f}x "
              f"| {tr:.2f} | {frac(tr)} | {tile_r} | {err_r:.1e} | {tp / tr:.2f}x |")



@triton.jit
def _gemv_rowloop_kernel(p_x, p_w, p_s, p_s2, p_y, N, K, stride_wn, stride_sn,
                         KW: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr):
    """Plain-Triton decode, the whole K in one tile ([BLOCK_N rows, KW = K/8 words]), x split into
    its 8 lanes once per program, the loop over row blocks (STEPS of them) instead of over K."""
    from_row = tl.program_id(0) * BLOCK_N * STEPS
    o_w = tl.arange(0, KW)
    o_g = tl.arange(0, KW // 2)
    b_x = tl.load(p_x + (8 * o_w)[:, None] + tl.arange(0, 8)[None, :]).to(tl.float32)
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(tl.reshape(b_x, (1, KW, 8)), 1, KW)
    x0 = tl.reshape(x0, (1, KW))
    x1 = tl.reshape(x1, (1, KW))
    x2 = tl.reshape(x2, (1, KW))
    x3 = tl.reshape(x3, (1, KW))
    x4 = tl.reshape(x4, (1, KW))
    x5 = tl.reshape(x5, (1, KW))
    x6 = tl.reshape(x6, (1, KW))
    x7 = tl.reshape(x7, (1, KW))
    s2 = tl.load(p_s2) * 64.0
    for i in range(STEPS):
        o_r = from_row + i * BLOCK_N + tl.arange(0, BLOCK_N)
        m_r = o_r < N
        b_w = tl.load(p_w + o_r[:, None] * stride_wn + o_w[None, :], mask=m_r[:, None], other=0).to(tl.uint32, bitcast=True)
        b_s = _e4m3(tl.load(p_s + o_r[:, None] * stride_sn + o_g[None, :], mask=m_r[:, None], other=0))
        lo = _lo_e4m3_word(b_w)
        hi = _hi_e4m3_word(b_w)
        part = _byte_f32(lo, 0) * x0
        part += _byte_f32(hi, 0) * x1
        part += _byte_f32(lo, 1) * x2
        part += _byte_f32(hi, 1) * x3
        part += _byte_f32(lo, 2) * x4
        part += _byte_f32(hi, 2) * x5
        part += _byte_f32(lo, 3) * x6
        part += _byte_f32(hi, 3) * x7
        b_y = tl.sum(tl.sum(tl.reshape(part, (BLOCK_N, KW // 2, 2)), axis=2) * b_s, axis=1) * s2
        tl.store(p_y + o_r, b_y.to(p_y.dtype.element_ty), mask=m_r)


def gemv_rowloop(x, packed, scale, scale_2, *, out, block_n=4, steps=8, num_warps=4):
    words = as_words(packed)
    s_u8 = scale.view(torch.uint8)
    n, k = packed.shape[0], x.shape[1]
    _gemv_rowloop_kernel[(triton.cdiv(n, block_n * steps),)](
        x, words, s_u8, scale_2.reshape(1).float(), out, n, k, words.stride(0), s_u8.stride(0),
        KW=k // 8, BLOCK_N=block_n, STEPS=steps, num_warps=num_warps)
    return out


if __name__ == "__main__":
    main()
