"""NVFP4 linear at batched-decode M (3..16): the tensor-core kernel (`ft.kernels.nvfp4.mma_kernel`)
against the current default path and torch bf16, on the flagship's dense decode projections.

Usage (device): ``PYTHONPATH=. python3 bench/small_m_gemm.py [--sweep] [--ms 4,8,16]``

Shapes (N x K, Qwen3-Next-80B-A3B): in_proj_qkvz 12288x2048 (36 layers), attention q (with its
gate) 8192x2048 (12), out_proj / o_proj 2048x4096 (48), attention k or v 512x2048 (24), and the
expert shapes 1024x2048 and 2048x512 for reference. Timing as `bench/kernels_nvfp4.py`: CUDA-graph
replays of calls that each read their own copy of the weights (every call reads HBM). With
``--sweep`` every configuration of `MMA_SWEEP` is checked (relative RMS against the fp32 reference,
bf16 output) and timed at M = 8, and the three best per shape again at the other M. The "step"
column weights each shape by its layers: the dense projections' share of one decode step.
Prints the table last.
"""

from __future__ import annotations

import argparse

import torch

from bench.gpu_timing import COPY_CEILING_GBS
from bench.kernels_nvfp4 import TOL_BF16, Shape, nbytes
from ft.kernels.nvfp4.kernel import _path, nvfp4_linear_triton
from ft.kernels.nvfp4.mma_kernel import mma_config

SHAPES = [  # name, N, K, layers using it per decode step (flagship)
    ("in_proj_qkvz", 12288, 2048, 36),
    ("attn_q", 8192, 2048, 12),
    ("out_proj", 2048, 4096, 48),
    ("attn_kv", 512, 2048, 24),
    ("expert_gate_up", 1024, 2048, 0),
    ("expert_down", 2048, 512, 0),
]

MMA_SWEEP = [
    {"BLOCK_N": bn, "BLOCK_KB": kb, "OPERAND": op, "num_warps": nw, "num_stages": st, "UNROLL": un}
    for bn, kb in [(16, 64), (16, 128), (16, 256), (32, 64), (32, 128), (32, 256), (64, 64), (64, 128), (64, 256),
                   (128, 64), (128, 128)]
    for op in ("x", "f16")
    for nw, st in [(4, 3), (4, 4), (8, 3)]
    for un in (False, True)
    if not un or (st == 3 and op == "x")
]


def _cfg(c: dict) -> str:
    return (f"{c['BLOCK_N']}x{c['BLOCK_KB']} {c['OPERAND']} w{c['num_warps']} s{c['num_stages']}"
            f"{' unrolled' if c.get('UNROLL') else ''}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time every MMA_SWEEP configuration (M = 8 first)")
    ap.add_argument("--ms", default="4,8,16")
    ap.add_argument("--only", default=None, help="comma-separated shape names")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    names = set(args.only.split(",")) if args.only else None
    rows, failures, best_cfgs = [], [], {}
    for name, n, k, layers in SHAPES:
        if names and name not in names:
            continue
        for m in sorted(ms, key=lambda v: v != 8):  # M = 8 first: its sweep picks the candidates for the others
            s = Shape(n, k, m)
            t_def = s.time(nvfp4_linear_triton)
            t_torch = s.time_torch()
            cands = [mma_config(m, n, k)]
            if args.sweep:
                cands += MMA_SWEEP if m == 8 or name not in best_cfgs else best_cfgs[name]
            timed = []
            for cfg in cands:
                try:
                    err = s.check(nvfp4_linear_triton, path="mma", config=cfg)
                    if not err < TOL_BF16:
                        failures.append((name, m, _cfg(cfg), err))
                        print(f"  {name} M{m} {_cfg(cfg)}: rel RMS {err:.1e} > {TOL_BF16}", flush=True)
                        continue
                    t = s.time(nvfp4_linear_triton, path="mma", config=cfg)
                except Exception as exc:  # noqa: BLE001 (a configuration the compiler refuses)
                    print(f"  {name} M{m} {_cfg(cfg)}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                timed.append((t, cfg, err))
                print(f"  {name} M{m} {_cfg(cfg)}: {t:.2f} us, rel RMS {err:.1e}", flush=True)
            timed.sort(key=lambda r: r[0])
            if m == 8:
                best_cfgs[name] = [c for _, c, _ in timed[:3]]
            t_mma, cfg, err = timed[0] if timed else (float("nan"), {}, float("nan"))
            t_dflt_mma = next((t for t, c, _ in timed if c == cands[0]), float("nan"))
            gbs = nbytes(m, n, k) / (t_mma * 1e-6) / 1e9
            rows.append((name, f"{n}x{k}", m, _path(m, n, k), t_def, t_dflt_mma, t_mma, _cfg(cfg) if cfg else "-",
                         gbs / COPY_CEILING_GBS, t_torch, err, layers))
            print(f"{name} M{m}: default {_path(m, n, k)} {t_def:.2f} us, mma {t_mma:.2f} us, torch {t_torch:.2f} us",
                  flush=True)
            del s
            torch.cuda.empty_cache()
    print()
    print("| shape | N x K | M | default path | default us | mma (mma_config) us | best mma us | best config | "
          "of copy ceiling | torch bf16 us | best vs default | rel RMS |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, nk, m, path, t_def, t_dm, t_mma, cfg, frac, t_torch, err, _ in rows:
        print(f"| {name} | {nk} | {m} | {path} | {t_def:.2f} | {t_dm:.2f} | {t_mma:.2f} | {cfg} | {frac:.0%} | "
              f"{t_torch:.2f} | {t_def / t_mma:.2f}x | {err:.1e} |")
    for m in ms:
        d = sum(r[4] * r[11] for r in rows if r[2] == m)
        b = sum(min(r[4], r[6]) * r[11] for r in rows if r[2] == m)
        if d:
            print(f"M = {m}: dense projections per decode step {d:.0f} us with the default paths, {b:.0f} us with the "
                  f"best of both")
    if failures:
        print(f"FAILED accuracy: {failures}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
