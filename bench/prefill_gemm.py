"""The NVFP4 dense linear at prefill sizes: the Triton `tl.dot` kernel against one decode pass of the
weight plus cuBLAS (`ft.kernels.nvfp4.dequant_kernel`), and torch bf16 on a pre-decoded weight. Not a test.

    PYTHONPATH=. python3 bench/prefill_gemm.py [--m 256,1024,4096]

Shapes: the flagship's NVFP4 projections (attention q with its gate 8192 x 2048, the Gated
DeltaNet's in_proj 12288 x 2048, out/o_proj 2048 x 4096, the shared expert's 512 x 2048 and
2048 x 512). `triton.testing.do_bench` medians; "decode pass" is the weight's decode alone (its
GB/s counts packed bytes in and bf16 out); "of torch" = torch bf16 time / variant time. Prints the
rel RMS of each variant against the torch reference on the decoded weight (with the global scale).
Table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ft.kernels.nvfp4 import DEQUANT_MM_MIN_M, dequantize_nvfp4  # noqa: E402
from ft.kernels.nvfp4.dequant_kernel import dequantize_nvfp4_triton, nvfp4_linear_dequant_mm  # noqa: E402
from ft.kernels.nvfp4.kernel import nvfp4_linear_triton  # noqa: E402
from ft.tools.nvfp4_quantize import quantize_nvfp4  # noqa: E402

SHAPES = [("attn_q+gate", 8192, 2048), ("gdn in_proj", 12288, 2048), ("o_proj/out_proj", 2048, 4096),
          ("shared gate/up", 512, 2048), ("shared down", 2048, 512)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="256,1024,4096", help="rows of x (prefill chunk tokens)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, n, k in SHAPES:
        packed, scale, scale_2 = quantize_nvfp4(torch.randn(n, k, device=dev))
        s2 = float(scale_2)
        w_bf16 = dequantize_nvfp4(packed, scale, scale_2, torch.bfloat16)
        ms = do_bench(lambda: dequantize_nvfp4_triton(packed, scale, torch.bfloat16), return_mode="median")
        gbs = (n * k // 2 + n * k // 16 + n * k * 2) / ms / 1e6
        rows.append((name, n, k, 0, "decode pass", ms, float("nan"), gbs, float("nan")))
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = (x.float() @ w_bf16.float().T)
            t_torch = do_bench(lambda: x @ w_bf16.T, return_mode="median")
            for label, fn in (("triton dot", lambda: nvfp4_linear_triton(x, packed, scale, scale_2, path="dot")),
                              ("decode + cuBLAS", lambda: nvfp4_linear_dequant_mm(x, packed, scale, s2)),
                              ("torch bf16 (decoded weight)", lambda: x @ w_bf16.T)):
                t = do_bench(fn, return_mode="median")
                err = ((fn().float() - ref).norm() / ref.norm()).item()
                rows.append((name, n, k, m, label, t, 2 * m * n * k / t / 1e9, float("nan"), t_torch / t, err))
                print(f"{name} M {m}: {label}: {t * 1e3:.1f} us, {t_torch / t:.2f}x torch, rel {err:.1e}", flush=True)
    print(f"\nDEQUANT_MM_MIN_M = {DEQUANT_MM_MIN_M} (the engine's switch to decode + cuBLAS)")
    print("| projection | N x K | M | variant | us | TFLOP/s | of torch bf16 | rel RMS |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        name, n, k, m, label, t = row[:6]
        if m == 0:
            print(f"| {name} | {n}x{k} | - | {label} | {t * 1e3:.1f} | {row[7]:.0f} GB/s | - | - |")
        else:
            print(f"| {name} | {n}x{k} | {m} | {label} | {t * 1e3:.1f} | {row[6]:.0f} | {row[8]:.2f} | {row[9]:.1e} |")


if __name__ == "__main__":
    main()
