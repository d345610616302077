"""Qwen3.8-Flash-Next's HyperConnection read on the H200: the cuBLAS read (two GEMMs, a split-K reduce,
a SiLU and the mix kernel) against the fused read (`hc_read_triton`: two Triton launches), after the
norm, at the decode batches. Not a test.

    PYTHONPATH=. python3 bench/hc_read.py [--tokens 1,2,4,8,16,32,64] [--sweep]

4 streams of 2,560, rank 320 (mix_in [324, 10,240] and up [10,240, 320] bf16: 13.2 MB a module), bf16;
every call inside a CUDA graph over copies of the weights (`bench.gpu_timing.graph_us`: a pass reads
several times L2, as the 97 modules of a step do). `--sweep`: the fused read's tiles
(`HyperConnectionOptions.down_rows`, `down_chunk`, `up_block_d`). The floor is the weights' bytes at
4.3 TB/s. Prints a table last.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from bench.gpu_timing import copies_for, graph_us, kernel_us, rel_rms
from ft.kernels.hyper_connection import hc_read, hc_read_ref
from ft.kernels.options import use_kernel_options, variant

DEV = torch.device("cuda")
STREAMS, WIDTH, RANK = 4, 2560, 320
HBM_BW = 4.3e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--sweep", action="store_true", help="also time the fused read's other tiles")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    c, d, r = STREAMS, WIDTH, RANK
    torch.manual_seed(0)
    weight_bytes = ((r + c) * c * d + c * d * r) * 2
    copies = copies_for(weight_bytes)
    mods = [((torch.randn(r + c, c * d, device=DEV) * 0.02).to(torch.bfloat16),
             (torch.randn(c * d, r, device=DEV) * 0.1).to(torch.bfloat16)) for _ in range(copies)]
    cublas = variant(**{"hyper_connection.fused_read_max_tokens": 0})
    fused = variant(**{"hyper_connection.fused_read_max_tokens": max(tokens)})
    tiles = [(4, 2048, 16)]
    if args.sweep:
        tiles += [t for t in itertools.product((2, 4, 8), (1024, 2048), (8, 16, 32)) if t != (4, 2048, 16)]
    floor_us = weight_bytes / HBM_BW * 1e6
    rows = []
    for t in tokens:
        n = torch.randn(t, c * d, device=DEV).to(torch.bfloat16)
        calls = [lambda mix_in=m, up=u: hc_read(n, mix_in, up, r, c) for m, u in mods]
        with use_kernel_options(cublas):
            base_us = graph_us(calls)
            base_kernels = kernel_us(calls[:4])
            want = hc_read_ref(n, *mods[0], r, c)
        best = None
        for rows_, chunk, block_d in tiles:
            opts = fused.with_(**{"hyper_connection.down_rows": rows_, "hyper_connection.down_chunk": chunk,
                                  "hyper_connection.up_block_d": block_d})
            with use_kernel_options(opts):
                us = graph_us(calls)
                got = hc_read(n, *mods[0], r, c)
            err = max(rel_rms(got[0], want[0]), rel_rms(got[1], want[1]))
            if args.sweep:
                print(f"  T {t} tile rows {rows_} chunk {chunk} block_d {block_d}: {us:.1f} us (err {err:.1e})")
            if (rows_, chunk, block_d) == tiles[0]:
                default_us, default_err = us, err
                with use_kernel_options(opts):
                    fused_kernels = kernel_us(calls[:4])
            if best is None or us < best[0]:
                best = (us, (rows_, chunk, block_d))
        print(f"T {t}: cuBLAS {base_us:.1f} us ({base_kernels}); fused {default_us:.1f} us ({fused_kernels})")
        rows.append((t, base_us, default_us, default_err, best))
    print(f"\nHyperConnection read, {c} streams of {d}, rank {r}, bf16, {copies} copies; floor {floor_us:.1f} us "
          f"({weight_bytes / 1e6:.1f} MB at 4.3 TB/s)")
    print(f"{'tokens':>6} {'cuBLAS us':>10} {'fused us':>9} {'cuBLAS/fused':>13} {'err':>8}  best tile (rows, chunk, block_d)")
    for t, base_us, us, err, best in rows:
        print(f"{t:>6} {base_us:>10.1f} {us:>9.1f} {base_us / us:>12.2f}x {err:>8.1e}  {best[1]} {best[0]:.1f} us")


if __name__ == "__main__":
    main()
