"""Filling a streamed prefill's staging page: one copy per run of consecutive experts (copy engine)
against one gather launch per tensor reading the pinned store in place (`copy_rows`), over the
kernel's options; alone, and beside a GEMM on the compute stream (what the copy takes from it). Not
a test.

    PYTHONPATH=. python3 bench/stream_copy.py [--experts 512] [--page 64] [--resident 0.5] [--pages 24]

The 80B's NVFP4 expert (w13 1 MiB, w2 512 KiB, their e4m3 scales, 3 fp32 global scales: 1.77 MB);
a layer's store of `--experts` experts pinned; `--resident` of them (random) are not streamed, the
rest fill `--pages` pages of `--page` experts on a side stream, as `PrefillStream` does. Reports GB/s
from the first launch to the last event (host time to issue included: what a chunk sees), the host
calls, and a 8192 x 2048 x 4096 bf16 GEMM loop's slowdown while the copies run. Prints a table last.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import torch

from ft.kernels.host_gather import copy_rows
from ft.kernels.host_gather.kernel import CopyRowsOptions
from ft.memory.prefill_stream import _runs

DEV = torch.device("cuda")


def store(experts: int) -> list[torch.Tensor]:
    shapes = [((1024, 1024), torch.uint8), ((2048, 256), torch.uint8), ((1024, 128), torch.uint8),
              ((2048, 32), torch.uint8), ((3,), torch.float32)]
    return [torch.zeros(experts, *s, dtype=torch.uint8 if d == torch.uint8 else d).pin_memory() for s, d in shapes]


def fill(method, host, pages_dev, missing, page, opts, side) -> tuple[float, int]:
    """Queue every page's fill on `side`; returns (seconds until the last copy ends, host calls)."""
    calls = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(side):
        for q in range(0, missing.size, page):
            group = missing[q : q + page]
            if method == "copy":
                for a, b, at in _runs(group):
                    for dst, src in zip(pages_dev, host):
                        dst[at : at + b - a].copy_(src[a:b], non_blocking=True)
                        calls += 1
            else:
                ids = torch.from_numpy(group.astype(np.int32)).pin_memory().to(DEV, non_blocking=True)
                for dst, src in zip(pages_dev, host):
                    copy_rows(dst[: group.size], src, ids, opts)
                    calls += 1
    side.synchronize()
    return time.perf_counter() - t0, calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--resident", type=float, default=0.5)
    ap.add_argument("--pages", type=int, default=24, help="pages filled per measurement (ids drawn again per page)")
    args = ap.parse_args()
    host = store(args.experts)
    expert_bytes = sum(t[0].numel() * t.element_size() for t in host)
    pages_dev = [torch.empty(args.page, *t.shape[1:], dtype=t.dtype, device=DEV) for t in host]
    rng = np.random.default_rng(0)
    per_page = []
    for _ in range(args.pages):  # pages of the missing experts of several layers
        keep = rng.random(args.experts) >= args.resident
        per_page.append(np.flatnonzero(keep)[: args.page])
    missing = np.concatenate(per_page)  # each page's ids sorted, as the stream's plan
    side = torch.cuda.Stream()
    a = torch.randn(8192, 2048, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(2048, 4096, device=DEV, dtype=torch.bfloat16)

    def gemm_loop(n: int = 300) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            a @ b
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    variants = [("copy", None)] + [("gather", CopyRowsOptions(programs=p, block_words=w, num_warps=nw))
                                   for p, w, nw in ((8, 4096, 4), (16, 4096, 4), (32, 4096, 4), (64, 4096, 4),
                                                    (132, 4096, 4), (32, 2048, 4), (32, 8192, 8), (64, 2048, 4))]
    gemm_loop()  # warm: cuBLAS picks its kernel, the clocks rise
    gemm_alone = gemm_loop()
    rows = []
    for method, opts in variants:
        fill(method, host, pages_dev, missing[: args.page], args.page, opts, side)  # warm (compiles)
        secs, calls = min(fill(method, host, pages_dev, missing, args.page, opts, side) for _ in range(3))
        gbs = missing.size * expert_bytes / secs / 1e9
        # beside a GEMM loop: the fills issued from a thread while this one times the GEMMs
        done = {}
        th = threading.Thread(target=lambda: done.setdefault("f", fill(method, host, pages_dev, missing, args.page, opts, side)))
        th.start()
        gemm_with = gemm_loop()
        th.join()
        rows.append((method, opts, calls, secs, gbs, gemm_with / gemm_alone, done["f"][0]))
        print(rows[-1], flush=True)
    print(f"\n{missing.size} experts of {expert_bytes / 1e6:.2f} MB in pages of {args.page} ({args.resident:.0%} resident)")
    print("| loader | programs | block words | warps | host calls | ms | GB/s | GEMM time beside / alone |")
    print("|---|---|---|---|---|---|---|---|")
    for method, opts, calls, secs, gbs, slow, _ in rows:
        o = (opts.programs, opts.block_words, opts.num_warps) if opts else ("-", "-", "-")
        print(f"| {method} | {o[0]} | {o[1]} | {o[2]} | {calls} | {secs * 1e3:.1f} | {gbs:.1f} | {slow:.2f} |")


if __name__ == "__main__":
    main()
