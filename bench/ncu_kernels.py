"""Nsight Compute (`ncu`) on the decode kernels: drivers that launch one kernel family a few times eagerly at a
given shape, and a reader that sums a raw CSV by kernel. Not a benchmark of its own: the counters say why a kernel
is where `bench/moe_decode.py` or `bench/kernels_nvfp4.py` time it (DRAM against issue slots, registers against
occupancy). ncu reads counters on the Firecracker machines (the H100s; not on gVisor); leave the clocks alone.

    # the decode MoE block (gate/up + per-pair down) at 512 slots x 2,560 x 640, top-10, 8 tokens
    ncu --clock-control none --kernel-name regex:_moe_decode --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python3 bench/ncu_kernels.py moe-decode --shape 512,2560,640,10 --batch 8
    # the NVFP4 linear at N x K for M rows (the 16-row tl.dot tile from M = 3)
    ncu --clock-control none --kernel-name regex:_nvfp4 --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python3 bench/ncu_kernels.py nvfp4-linear --shape 16384,2560 --batch 8
    # every kernel of a few decode steps (bench/decode.py --ncu-window), summed by kernel
    ncu --profile-from-start off --clock-control none --csv --page raw --metrics "$(python3 bench/ncu_kernels.py metrics)" \\
        python3 bench/decode.py --modes graphs --batches 8 --tokens 4 --ncu-window 1 --variant no-pdl > step.csv
    python3 bench/ncu_kernels.py summary step.csv

Each driver makes 4 calls (new routings or weight copies each) and synchronizes: skip the first two for warm-up
(each launch is one of the kernels named above; the MoE block launches 2, gate/up and down, at these shapes).
Kernels that wait on other programs' tickets across launches cannot be replayed by ncu inside a graph
(session 48: the HyperConnection read's reduce stopped a step's profile): exclude them with
``--kernel-name regex:'^(?!_read_reduce)'``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict

METRICS = ("gpu__time_duration.sum", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed", "launch__registers_per_thread",
           "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__grid_size", "launch__block_size")
"""The per-kernel metrics `summary` reads (`--metrics` of a raw-CSV run): duration, DRAM and SM throughput as % of
peak, registers a thread, achieved occupancy, grid and block."""


def moe_decode(shape: str, batch: int) -> None:
    """The decode MoE block (`moe_decode_triton`: routed pairs + the shared expert) at slots,hidden,inter,top-k."""
    import torch

    from bench.kernels_nvfp4 import random_pool
    from ft.kernels.moe import SlotWeights
    from ft.kernels.moe.decode_kernel import moe_decode_triton

    n_slots, hid, inter, top_k = (int(v) for v in shape.split(","))
    torch.manual_seed(0)
    pool = random_pool(n_slots, hid, inter)
    shared = SlotWeights(*(t[:1].clone() for t in pool))
    x = torch.randn(batch, hid, device="cuda", dtype=torch.bfloat16)
    wts = torch.softmax(torch.randn(batch, top_k + 1, device="cuda"), -1).to(torch.bfloat16)
    out = torch.empty_like(x)
    for _ in range(4):
        slots = torch.stack([torch.randperm(n_slots, device="cuda")[:top_k] for _ in range(batch)])
        moe_decode_triton(x, slots, wts, pool, shared, out=out)
    torch.cuda.synchronize()


def nvfp4_linear(shape: str, batch: int) -> None:
    """The NVFP4 linear (`nvfp4_linear_triton`, the path its dispatcher takes) at N,K for `batch` rows, on four
    weight copies (each call reads HBM)."""
    import torch

    from bench.kernels_nvfp4 import random_nvfp4
    from ft.kernels.nvfp4.kernel import nvfp4_linear_triton

    n, k = (int(v) for v in shape.split(","))
    torch.manual_seed(0)
    weights = [random_nvfp4(n, k) for _ in range(4)]
    x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(batch, n, device="cuda", dtype=torch.bfloat16)
    for w in weights:
        nvfp4_linear_triton(x, *w, out=y)
    torch.cuda.synchronize()


def summary_rows(lines: list[str]) -> list[tuple]:
    """An `ncu --csv --page raw --metrics METRICS` output (other lines before its header ignored) -> one row per
    kernel name, the longest total first: (name, launches, total us, share of all kernels' time, DRAM %, SM %
    (both weighted by duration), registers, achieved occupancy %, "grid x block" of its last launch)."""
    rows = list(csv.reader(lines))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
    if start is None:
        raise ValueError("no ncu raw CSV header (a row starting with \"ID\") in the input")
    header = rows[start]
    col = {name: i for i, name in enumerate(header)}
    missing = [m for m in (*METRICS, "Kernel Name") if m not in col]
    if missing:
        raise ValueError(f"the CSV lacks {', '.join(missing)}: run ncu with --metrics \"{','.join(METRICS)}\"")

    def num(r, name):
        return float(r[col[name]].replace(",", ""))

    agg = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0, 0.0, ""])
    for r in rows[start + 2:]:  # (the row after the header holds the units)
        if len(r) != len(header):
            continue
        a = agg[r[col["Kernel Name"]]]
        us = num(r, "gpu__time_duration.sum") / 1e3
        a[0] += 1
        a[1] += us
        a[2] += us * num(r, "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed")
        a[3] += us * num(r, "sm__throughput.avg.pct_of_peak_sustained_elapsed")
        a[4] = num(r, "launch__registers_per_thread")
        a[5] += us * num(r, "sm__warps_active.avg.pct_of_peak_sustained_active")
        a[6] = f"{r[col['launch__grid_size']]} x {r[col['launch__block_size']]}"
    total = sum(a[1] for a in agg.values()) or 1.0
    return sorted(((name, a[0], a[1], a[1] / total, a[2] / (a[1] or 1), a[3] / (a[1] or 1), a[4], a[5] / (a[1] or 1),
                    a[6]) for name, a in agg.items()), key=lambda row: -row[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    for name in ("moe-decode", "nvfp4-linear"):
        p = sub.add_parser(name)
        p.add_argument("--shape", required=True, help="moe-decode: slots,hidden,inter,top-k; nvfp4-linear: N,K")
        p.add_argument("--batch", type=int, default=8, help="tokens (rows of x)")
    sub.add_parser("metrics", help="print the --metrics list `summary` reads")
    p = sub.add_parser("summary", help="sum an ncu raw CSV by kernel")
    p.add_argument("csv", help="the file ncu --csv --page raw wrote (- for stdin)")
    args = ap.parse_args()
    if args.what == "metrics":
        print(",".join(METRICS))
    elif args.what == "summary":
        lines = sys.stdin.read().splitlines() if args.csv == "-" else open(args.csv).read().splitlines()
        rows = summary_rows(lines)
        print(f"{len(rows)} kernels, {sum(r[1] for r in rows)} launches, {sum(r[2] for r in rows):.1f} us")
        print(f"{'kernel':60} {'n':>4} {'us':>9} {'share':>6} {'dram%':>6} {'sm%':>5} {'regs':>5} {'occ%':>5}  grid x block")
        for name, n, us, share, dram, sm, regs, occ, grid in rows:
            print(f"{name[:60]:60} {n:>4} {us:>9.1f} {share:>6.1%} {dram:>6.1f} {sm:>5.1f} {regs:>5.0f} {occ:>5.1f}  {grid}")
    else:
        (moe_decode if args.what == "moe-decode" else nvfp4_linear)(args.shape, args.batch)


if __name__ == "__main__":
    main()
