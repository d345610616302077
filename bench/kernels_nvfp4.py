"""NVFP4 linear on the GPU: correctness against the reference, then timings (table printed last).

Usage (device): ``PYTHONPATH=. python3 bench/kernels_nvfp4.py [--sweep] [--log FILE]``

Shapes (N x K) from Qwen3-Next-80B-A3B: in_proj_qkvz 12288x2048, attention q 8192x2048,
out_proj 2048x4096, expert gate_up 1024x2048, expert down 2048x512, and 32768x8192 for the
bandwidth ceiling; decode at M = 1 and 8, prefill GEMM at M = 4096 on 8192x2048.
Times: medians of ``triton.testing.do_bench`` (it clears L2 before each run). Effective GB/s
counts weights + block scales + x read and y written once; the ceiling is the measured 4.3 TB/s
device copy (shared/reference/h200-ceilings.md). Baseline: torch bf16 ``F.linear`` on a dense
[N, K] weight.

NOTE: ``do_bench`` times with events around one eager launch, so kernels shorter than the
Python launch path (~25 us for these launchers with triton 3.6) read as launch-bound; the
engine replays decode in CUDA graphs, where only the GPU time counts. Timing the decode shapes
under ``triton.testing.do_bench_cudagraph`` (with weight copies rotated past L2) is still to do.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from ft.kernels.nvfp4 import nvfp4_linear, nvfp4_linear_ref, quantize_nvfp4
from ft.kernels.nvfp4_triton import nvfp4_linear_triton

COPY_CEILING_GBS = 4300.0
TOL_BF16 = 1e-2  # relative RMS vs the fp32-matmul reference, y rounded to bf16

DECODE_SHAPES = [
    ("in_proj_qkvz", 12288, 2048),
    ("attn_q", 8192, 2048),
    ("out_proj", 2048, 4096),
    ("expert_gate_up", 1024, 2048),
    ("expert_down", 2048, 512),
    ("large", 32768, 8192),
]
PREFILL = ("attn_q", 8192, 2048, 4096)

GEMV_SWEEP = [{"BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_KB": kb, "num_warps": w} for bn in (4, 8, 16, 32) for kb in (64, 128, 256) for w in (4,)]
DOT_SWEEP = [
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
]


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_weight(n: int, k: int):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, scale, scale_2 = quantize_nvfp4(w)
    return w, packed, scale, scale_2


def check(m: int, packed, scale, scale_2, **kw) -> float:
    """Relative RMS of the Triton kernel against the reference on fresh x, output NaN-poisoned."""
    x = torch.randn(m, packed.shape[1] * 2, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, packed.shape[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = nvfp4_linear_triton(x, packed, scale, scale_2, out=out, **kw)
    return rel_rms(y, nvfp4_linear_ref(x, packed, scale, scale_2))


def nbytes(m: int, n: int, k: int) -> int:
    return n * k // 2 + n * k // 16 + m * k * 2 + m * n * 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time a few block configurations")
    ap.add_argument("--log", default=None)
    args = ap.parse_args()
    log = open(args.log, "w") if args.log else None  # noqa: SIM115 (open for the whole run)

    def say(*a):
        print(*a, flush=True)
        if log:
            print(*a, file=log, flush=True)

    say(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rows, failures = [], []
    for name, n, k in DECODE_SHAPES:
        w, packed, scale, scale_2 = make_weight(n, k)
        for m in (1, 8):
            err = check(m, packed, scale, scale_2)
            x_d = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)  # through the dispatcher
            err_disp = rel_rms(nvfp4_linear(x_d, packed, scale, scale_2), nvfp4_linear_ref(x_d, packed, scale, scale_2))
            if not (err < TOL_BF16 and err_disp < TOL_BF16):
                failures.append((name, m, err, err_disp))
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            t = do_bench(partial(nvfp4_linear_triton, x, packed, scale, scale_2, out=y), return_mode="median")
            t_ref = do_bench(partial(F.linear, x, w), return_mode="median")
            best = ("default", t)
            if args.sweep and m == 1:
                for cfg in GEMV_SWEEP:
                    if check(m, packed, scale, scale_2, config=cfg, path="gemv") >= TOL_BF16:
                        say("sweep config wrong:", name, cfg)
                        continue
                    tc = do_bench(partial(nvfp4_linear_triton, x, packed, scale, scale_2, out=y, config=cfg, path="gemv"),
                                  return_mode="median")
                    say(f"  sweep {name} M{m} {cfg}: {tc * 1e3:.1f} us")
                    if tc < best[1]:
                        best = (f"bn{cfg['BLOCK_N']}-kb{cfg['BLOCK_KB']}", tc)
            if args.sweep and m == 8:
                cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
                tc = do_bench(partial(nvfp4_linear_triton, x, packed, scale, scale_2, out=y, config=cfg, path="dot"),
                              return_mode="median")
                say(f"  sweep {name} M{m} dot16x64x128: {tc * 1e3:.1f} us")
                if tc < best[1]:
                    best = ("dot16", tc)
            gbs = nbytes(m, n, k) / (t * 1e-3) / 1e9
            rows.append((name, f"{n}x{k}", m, t * 1e3, gbs, gbs / COPY_CEILING_GBS, t_ref * 1e3, t_ref / t, err, best))
            say(f"{name} M{m}: {t * 1e3:.1f} us, {gbs:.0f} GB/s, torch bf16 {t_ref * 1e3:.1f} us, err {err:.2e}")
        del w, packed, scale
        torch.cuda.empty_cache()

    name, n, k, m = PREFILL
    w, packed, scale, scale_2 = make_weight(n, k)
    err = check(m, packed, scale, scale_2)
    if not err < TOL_BF16:
        failures.append((name, m, err, err))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    t = do_bench(partial(nvfp4_linear_triton, x, packed, scale, scale_2, out=y), return_mode="median")
    t_ref = do_bench(partial(F.linear, x, w), return_mode="median")
    sweep = []
    if args.sweep:
        for cfg in DOT_SWEEP:
            try:
                e = check(m, packed, scale, scale_2, config=cfg, path="dot")
                tc = do_bench(partial(nvfp4_linear_triton, x, packed, scale, scale_2, out=y, config=cfg, path="dot"),
                              return_mode="median")
            except Exception as exc:  # noqa: BLE001 (out of shared memory etc.)
                say("  sweep dot failed:", cfg, type(exc).__name__, str(exc)[:200])
                continue
            say(f"  sweep prefill {cfg}: {tc * 1e3:.1f} us, {2 * m * n * k / tc / 1e9:.0f} TFLOP/s, err {e:.2e}")
            sweep.append((tc, cfg))
    flops = 2 * m * n * k

    say("")
    say("| shape | N x K | M | us | GB/s | of 4.3 TB/s | torch bf16 us | speedup | rel RMS | best swept (us) |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    for name_, nk, m_, us, gbs, frac, us_ref, sp, e, best in rows:
        say(f"| {name_} | {nk} | {m_} | {us:.1f} | {gbs:.0f} | {frac:.0%} | {us_ref:.1f} | {sp:.2f}x | {e:.1e} | {best[0]} ({best[1] * 1e3:.1f}) |")
    say("")
    say("| prefill GEMM | N x K | M | us | TFLOP/s | torch bf16 us | torch TFLOP/s | ratio | rel RMS | best swept |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    best = min(sweep, key=lambda s: s[0]) if sweep else None
    best_s = f"{best[1]['BLOCK_M']}x{best[1]['BLOCK_N']}x{best[1]['BLOCK_K']} w{best[1]['num_warps']} ({best[0] * 1e3:.1f} us)" if best else "-"
    say(f"| {name} | {n}x{k} | {m} | {t * 1e3:.1f} | {flops / t / 1e9:.0f} | {t_ref * 1e3:.1f} | {flops / t_ref / 1e9:.0f} | "
        f"{t_ref / t:.2f} | {err:.1e} | {best_s} |")
    if failures:
        say("FAILURES (name, M, kernel err, dispatcher err):", failures)
        sys.exit(1)
    say(f"all correctness checks passed (rel RMS < {TOL_BF16:g})")


if __name__ == "__main__":
    main()
