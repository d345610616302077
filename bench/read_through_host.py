"""Host time of the read-through expert cache's policy per decode step, on the CPU. Not a test.

    PYTHONPATH=. python3 bench/read_through_host.py [--layers 48] [--experts 512] [--slots 4026] [--top-k 10]
                                                    [--policy lru] [--mapped-victims]

The real `ExpertCache` and `ReadThrough` at the flagship's shape, the lookup kernel's torch
reference standing in for the decode step (`ft.tools.offload_sim`), a synthetic routing trace, no
collect between steps (as the engine decodes). Times `begin_step` (before the step is queued: on
the device's critical path) and `end_step` (after: hidden behind the device on a GPU; here it also
runs the commit reference on the CPU). Host Python time only: on a GPU the uploads are
asynchronous copies instead of CPU copies. Prints a table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ft.kernels.expert_lookup import expert_lookup_ref  # noqa: E402
from ft.tools.offload_sim import read_through_cache  # noqa: E402
from ft.tools.routing_trace import RoutingTrace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--slots", type=int, default=4026)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--policy", default="lru", choices=["lru", "lfu"])
    ap.add_argument("--mapped-victims", action="store_true", help="victims stay mapped until claimed")
    args = ap.parse_args()
    torch.set_num_threads(1)
    layers, k = args.layers, args.top_k
    cache = read_through_cache(layers, args.experts, args.slots, k, args.policy, rows=1,
                               mapped_victims=args.mapped_victims)
    rt = cache.read_through
    trace = RoutingTrace(layers, args.experts, k, seed=1).tokens(args.steps)
    begin, end = [], []
    for t, tok in enumerate(trace):
        t0 = time.perf_counter()
        rt.begin_step(1, k)
        t1 = time.perf_counter()
        for layer in range(layers):
            expert_lookup_ref(torch.tensor([tok[layer]]), cache.slot_table, rt.book, layer)
        t2 = time.perf_counter()
        rt.end_step()
        t3 = time.perf_counter()
        if t >= args.warmup:
            begin.append(t1 - t0)
            end.append(t3 - t2)
    cache.collect()
    print(f"\n{layers} layers x {args.experts} experts, {args.slots} slots, top-{k}, batch 1, {args.policy}"
          f"{', mapped victims' if args.mapped_victims else ''}, "
          f"{len(begin)} steps after {args.warmup}; hit rate {cache.stats.hit_rate:.1%}")
    print("| phase | median us | mean us |\n|---|---|---|")
    for name, xs in (("begin_step (critical path)", begin), ("end_step (hidden on a GPU)", end)):
        print(f"| {name} | {statistics.median(xs) * 1e6:.1f} | {statistics.fmean(xs) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
