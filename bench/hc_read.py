"""Qwen3.8-Flash-Next's HyperConnection read on the H200: the cuBLAS read (two GEMMs, a split-K reduce,
a SiLU and the mix kernel) against the fused read (`hc_read_triton`) in its two forms, "fma" (two
launches, CUDA-core dots a token at a time) and "dot" (three launches, tensor-core tiles), after the
norm, at the decode batches. Not a test.

    PYTHONPATH=. python3 bench/hc_read.py [--tokens 1,2,4,8,16,32,64] [--sweep] [--write-read]

4 streams of 2,560, rank 320 (mix_in [324, 10,240] and up [10,240, 320] bf16: 13.2 MB a module), bf16;
every call inside a CUDA graph over copies of the weights (`bench.gpu_timing.graph_us`: a pass reads
several times L2, as the 97 modules of a step do). `--sweep`: the forms' tiles
(`HyperConnectionOptions.down_rows`, `down_chunk`, `up_block_d`, `up_warps`; `dot_down_rows`, `dot_down_chunk`,
`dot_up_block_d`, `dot_up_block_rank`). `--write-read`: a write folded into the next read against
the write's own launch then the read (`HyperConnectionOptions.write_into_read`), after the table. The
floor is the weights' bytes at 4.3 TB/s. Prints a table last.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from bench.gpu_timing import copies_for, graph_us, kernel_us, rel_rms
from ft.kernels.hyper_connection import hc_read, hc_read_ref
from ft.kernels.options import HyperConnectionOptions, use_kernel_options, variant

DEV = torch.device("cuda")
STREAMS, WIDTH, RANK = 4, 2560, 320
HBM_BW = 4.3e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--sweep", action="store_true", help="also time the fused read's other tiles")
    ap.add_argument("--write-read", action="store_true",
                    help="also time a write folded into the next read (`hc_write_read`, one token) against the "
                         "write's own launch and the read (`HyperConnectionOptions.write_into_read`)")
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
    # The first tile of each form is the library's default (`HyperConnectionOptions`); --sweep adds the others.
    fma_keys = ("down_rows", "down_chunk", "up_block_d", "up_warps")
    dot_keys = ("dot_down_rows", "dot_down_chunk", "dot_up_block_d", "dot_up_block_rank")
    defaults = HyperConnectionOptions()
    tile = lambda keys, values: {f"hyper_connection.{k}": v for k, v in zip(keys, values)}  # noqa: E731
    forms = {"fma": [tile(fma_keys, [getattr(defaults, k) for k in fma_keys])],
             "dot": [tile(dot_keys, [getattr(defaults, k) for k in dot_keys])]}
    if args.sweep:
        forms["fma"] += [tile(fma_keys, v) for v in ((4, 2048, 8, 4), (4, 2048, 4, 4), (4, 2048, 4, 8),
                                                     (4, 2048, 16, 4), (4, 2048, 16, 8), (2, 2048, 8, 0),
                                                     (4, 1024, 8, 0))]
        forms["dot"] += [tile(dot_keys, v)
                         for v in itertools.product((16, 32), (512, 1024), (4, 8, 16), (32, 64, 128))]
        for form in forms:  # the default once
            forms[form] = [forms[form][0]] + [t for t in forms[form][1:] if t != forms[form][0]]
    floor_us = weight_bytes / HBM_BW * 1e6
    rows = []
    for t in tokens:
        n = torch.randn(t, c * d, device=DEV).to(torch.bfloat16)
        calls = [lambda mix_in=m, up=u: hc_read(n, mix_in, up, r, c) for m, u in mods]
        with use_kernel_options(cublas):
            base_us = graph_us(calls)
            base_kernels = kernel_us(calls[:4])
            want = hc_read_ref(n, *mods[0], r, c)
        row = {"cublas": base_us}
        line = f"T {t}: cuBLAS {base_us:.1f} us ({base_kernels})"
        for form, tiles in forms.items():
            best = None
            for i, tile in enumerate(tiles):
                fma = form.startswith("fma")
                opts = fused.with_(**{"hyper_connection.fma_read_max_tokens": 1 << 20 if fma else 0, **tile})
                with use_kernel_options(opts):
                    us = graph_us(calls)
                    got = hc_read(n, *mods[0], r, c)
                    kernels = kernel_us(calls[:4]) if i == 0 else ""
                err = max(rel_rms(got[0], want[0]), rel_rms(got[1], want[1]))
                short = tuple(tile.values())
                if args.sweep:
                    print(f"  T {t} {form} tile {short}: {us:.1f} us (err {err:.1e})")
                if i == 0:
                    row[form] = us
                    row[form + " err"] = err
                    line += f"; {form} {us:.1f} us ({kernels})"
                if best is None or us < best[0]:
                    best = (us, short)
            row[form + " best"] = best
        print(line)
        rows.append((t, row))
    print(f"\nHyperConnection read, {c} streams of {d}, rank {r}, bf16, {copies} copies; floor {floor_us:.1f} us "
          f"({weight_bytes / 1e6:.1f} MB at 4.3 TB/s)")
    names = list(forms)
    print(f"{'tokens':>6} {'cuBLAS us':>10} " + " ".join(f"{f + ' us':>10}" for f in names) + f" {'cuBLAS/best':>12} "
          + " ".join(f"{'err ' + f:>12}" for f in names) + "  best tile of each form")
    for t, row in rows:
        best = min(row[f] for f in names)
        print(f"{t:>6} {row['cublas']:>10.1f} " + " ".join(f"{row[f]:>10.1f}" for f in names)
              + f" {row['cublas'] / best:>11.2f}x " + " ".join(f"{row[f + ' err']:>12.1e}" for f in names) + "  "
              + " / ".join(f"{f} {row[f + ' best'][1]} {row[f + ' best'][0]:.1f}" for f in names))
    if args.write_read:
        write_read_rows(mods, c, d, r)


def write_read_rows(mods: list, c: int, d: int, r: int) -> None:
    """One token's write folded into the next read, and the write's own launch then the read (variant
    "hc-write-own-launch"): us a call (a CUDA graph over the weight copies), each kernel's share,
    the error against the reference."""
    from ft.kernels.hyper_connection import hc_write_read, hc_write_read_ref

    x = (torch.randn(1, c * d, device=DEV) * 3).to(torch.bfloat16)
    y, gates = torch.randn(1, d, device=DEV).to(torch.bfloat16), torch.randn(1, c, device=DEV).to(torch.bfloat16)
    norm = (torch.randn(c * d, device=DEV) * 0.1).to(torch.bfloat16)
    calls = [lambda mix_in=m, up=u: hc_write_read(x, y, gates, c, norm, 1e-6, mix_in, up, r) for m, u in mods]
    want = hc_write_read_ref(x, y, gates, c, norm, 1e-6, *mods[0], r)
    print(f"\nwrite folded into the next read, 1 token ({len(mods)} copies)")
    print(f"{'form':>16} {'us':>7} {'err u':>9}  kernels")
    for name, names in (("folded", ()), ("own launch", ("hc-write-own-launch",))):
        with use_kernel_options(variant(*names)):
            us = graph_us(calls)
            kernels = kernel_us(calls[:4])
            got = hc_write_read(x, y, gates, c, norm, 1e-6, *mods[0], r)
        print(f"{name:>16} {us:>7.1f} {rel_rms(got[1], want[1]):>9.1e}  {kernels}")


if __name__ == "__main__":
    main()
