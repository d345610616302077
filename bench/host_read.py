"""Misses read from pinned host memory inside the decode MoE kernels: what they cost. Not a test.

    PYTHONPATH=. python3 bench/host_read.py [--store-gib 8] [--layers 48] [--land]

Flagship shapes (H 2048, I 512, top-10 + the shared expert), batch 1, bf16. A pinned host store of
512 experts (906 MB) and 64 device slots; each call routes 10 experts of which `misses` have no
slot and are read from the host store in place (each call of the 24 in a graph misses other
experts, so nothing is served from L2). Reports the block's time per call against 0 misses, the
host bytes' effective bandwidth, for the tuned block sizes and others (the host path may want
other tiles than the all-device path); then the host-side cost of launching a graph whose kernels
read a large pinned allocation (`--store-gib` extra pinned GiB allocated beside the store, as the
engine's 43 GB store is) against one that does not. Prints tables last.

`--layers N`: a store of N layers of 512 experts (48: the engine's 43.5 GB), each call reading a
random layer's experts, with the tuned tiles only: whether the store's size (the GPU's translation
of host addresses, NUMA placement) is what reads the misses at ~37 GB/s inside the engine against
48-55 GB/s here (session 18's profile).

`--land`: each miss also lands the bytes it read in a device slot (`topk_dst`, the read-through
landing store, as every first miss of an expert does in the engine), with the tuned tiles and also
without landing in the same run: whether the landing's HBM writes are what slows the engine's misses
(session 29: the engine's offloaded MoE spends ~55 us a miss against ~35 us here without landing).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.gpu_timing import graph_us
from bench.kernels_nvfp4 import MOE, random_pool
from ft.kernels.moe import SlotWeights
from ft.kernels.moe.decode_kernel import DECODE_GATE_UP_CONFIG, down_pairs_config, moe_decode_triton

DEV = torch.device("cuda")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store-gib", type=float, default=8.0)
    ap.add_argument("--layers", type=int, default=1, help="layers of 512 experts in the host store (48: the engine's)")
    ap.add_argument("--land", action="store_true",
                    help="also time each miss landing in a device slot (topk_dst), tuned tiles only")
    args = ap.parse_args()
    _, hid, inter, top_k = MOE
    torch.manual_seed(0)
    store = random_pool(512, hid, inter)
    host = SlotWeights(*(_layers(t.cpu(), args.layers) for t in store))
    slots = SlotWeights(*(t[:64].clone() for t in store))
    shared = SlotWeights(*(t[:1].clone() for t in store))
    expert_bytes = sum(t[0, 0].numel() * t.element_size() for t in host)
    del store
    x = torch.randn(1, hid, device=DEV, dtype=torch.bfloat16)
    wts = torch.cat([torch.softmax(torch.randn(1, top_k, device=DEV), -1), torch.rand(1, 1, device=DEV)], 1)
    wts = wts.to(torch.bfloat16)
    out = torch.empty_like(x)
    configs = [(DECODE_GATE_UP_CONFIG[1], down_pairs_config()), ((2, 0, 4), (32, 0, 4)), ((1, 0, 2), (16, 0, 2)),
               ((8, 0, 4), (128, 0, 4)), ((2, 0, 2), (64, 0, 2))][: 1 if args.layers > 1 or args.land else None]
    rows = []
    for (gu, dn), land in ((c, land) for c in configs for land in ((False, True) if args.land else (False,))):
        base = None
        for misses in (0, 1, 2, 4, 10):
            calls = []
            for c in range(24):
                ids = torch.randperm(512, device=DEV)[:top_k].view(1, -1)
                # the first top_k - misses pairs hit slots 0-31 (distinct per call), the rest miss; a
                # landing miss writes slot 32 + j, which no pair reads
                s = torch.tensor([[(c * 2 + j) % 32 if j < top_k - misses else -1 for j in range(top_k)]],
                                 device=DEV, dtype=torch.int32)
                dst = torch.tensor([[32 + j if land and j >= top_k - misses else -1 for j in range(top_k)]],
                                   device=DEV, dtype=torch.int32) if land else None
                layer = int(torch.randint(args.layers, ()))
                calls.append(lambda ids=ids, s=s, dst=dst, layer=layer: moe_decode_triton(
                    x, s, wts, slots, shared, out=out, host=host, topk_ids=ids, layer=layer, topk_dst=dst,
                    gate_up_config=gu, down_config=dn, down_per_pair=True))
            us = graph_us(calls)
            base = us if misses == 0 else base
            gbs = misses * expert_bytes / ((us - base) * 1e-6) / 1e9 if misses else float("nan")
            rows.append((gu, dn, misses, us, gbs, land))
            print(f"gate/up {gu} down {dn} misses {misses}{' landing' if land else ''}: {us:.1f} us", flush=True)
    print(f"\nhost store: {args.layers} layer(s) of 512 experts, {args.layers * 512 * expert_bytes / 1e9:.1f} GB")
    print("\n| gate/up (rows, -, warps) | down (rows, -, warps) | misses land | misses | us per block | "
          "host GB/s (over 0 misses) |")
    print("|---|---|---|---|---|---|")
    for gu, dn, misses, us, gbs, land in rows:
        print(f"| {gu} | {dn} | {'yes' if land else 'no'} | {misses} | {us:.1f} | {gbs:.1f} |")
    launch_cost(x, wts, slots, shared, host, out, args.store_gib)


def _layers(t: torch.Tensor, n: int) -> torch.Tensor:
    """[n, *t.shape] pinned: t in every layer (the bytes' values do not change what a read costs)."""
    out = torch.empty((n, *t.shape), dtype=t.dtype, pin_memory=True)
    out.copy_(t.unsqueeze(0).expand_as(out))
    return out


def launch_cost(x, wts, slots, shared, host, out, store_gib: float) -> None:
    """Host microseconds of graph.replay() for 48 MoE blocks reading the host store vs not."""
    extra = torch.empty(int(store_gib * 2**30), dtype=torch.uint8).pin_memory() if store_gib > 0 else None
    ids = torch.randperm(512, device=DEV)[:10].view(1, -1)
    s = torch.full((1, 10), -1, device=DEV, dtype=torch.int32)
    res = []
    for name, kw in (("device slots only", {}), ("host store", {"host": host, "topk_ids": ids})):
        slots_in = ids.to(torch.int32) % 64 if not kw else s
        moe_decode_triton(x, slots_in, wts, slots, shared, out=out, **kw)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(48):
                moe_decode_triton(x, slots_in, wts, slots, shared, out=out, **kw)
        times = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g.replay()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        times.sort()
        res.append((name, times[len(times) // 2] * 1e6))
    print(f"\ngraph.replay() host time, 48 blocks (pinned beside: {store_gib} GiB{'' if extra is not None else ', none'}):")
    print("| graph | host us per replay |\n|---|---|")
    for name, us in res:
        print(f"| {name} | {us:.0f} |")


if __name__ == "__main__":
    main()
