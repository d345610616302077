"""Which residents make room for misses: the read-through policies against the exact LRU, on
calibrated routing traces. CPU only.

    PYTHONPATH=. python3 bench/offload_policy.py [--tokens 600] [--seed 3] [--slots 14116,2008] [--rows 1]
                                                [--no-shared-popularity]

Flagship routing (48 MoE layers x 512 experts, top-10, `routing_trace.CALIBRATED`), batch-1
decode replayed through the expert cache in read-through mode (`ft.tools.offload_sim`: the real
cache and policy, the lookup kernel's reference) at the slot counts the H200 runs measured for
the emulated 32 GiB and 16 GiB cards (bench/RESULTS.md), each policy with the victims unmapped
before the step (the default) and kept mapped until a miss claims their slot (`--expert-mapped-victims`),
and through the exact global LRU (`lru_hit_rate`: misses loaded before the call that needs them);
and the bound no policy passes on the same trace, Belady's MIN with bypass (`belady_hit_rate`: it knows
every future access). Hit rates after a warm-up of a third of the tokens. Prints a table last.
"""

from __future__ import annotations

import argparse
import time

from ft.tools.offload_sim import read_through_hit_rate
from ft.tools.routing_trace import RoutingTrace, belady_hit_rate, lru_hit_rate, model_popularity

LAYERS, EXPERTS, TOP_K = 48, 512, 10
SLOTS = [("32GiB, 64K rung", 13260), ("32GiB, 256K rung", 10528), ("16GiB, 64K rung", 4432),
         ("16GiB, 128K rung", 3520), ("16GiB, 256K rung", 1700)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--slots", default="", metavar="N[,N...]",
                    help="slot counts to replay instead of the measured cards' (e.g. 14116,7600,2008,1299: session "
                         "31's 80B 32 GiB / Flash-Next 32 GiB and 16 GiB rungs with the embedding in host memory)")
    ap.add_argument("--rows", type=int, default=1,
                    help="decode rows a step: one trace each (seeds --seed, --seed + 1, ...); the exact "
                         "LRU column is for one row only")
    ap.add_argument("--shared-popularity", action=argparse.BooleanOptionalAction, default=True,
                    help="the rows' traces rank the experts in the model's one popularity order, as a traced "
                         "synthetic model's requests do since session 33 (`ft.engine.worker.routing_override`); "
                         "--no-shared-popularity: an order of its own per row (session 32's --rows figures)")
    args = ap.parse_args()
    slot_list = [(f"{int(n):,} slots", int(n)) for n in args.slots.split(",") if n] or SLOTS
    shared = model_popularity(LAYERS, EXPERTS, args.seed) if args.shared_popularity else None
    trace, *others = (RoutingTrace(LAYERS, EXPERTS, TOP_K, seed=args.seed + r, popularity=shared).tokens(args.tokens)
                      for r in range(args.rows))
    warm = args.tokens // 3
    rows = []
    for name, slots in slot_list:
        t0 = time.perf_counter()
        exact = lru_hit_rate(trace, slots, warmup=warm) if not others else float("nan")
        best = belady_hit_rate(trace, slots, warmup=warm) if not others else float("nan")
        rates = [read_through_hit_rate(trace, slots, warmup=warm, policy=policy, mapped_victims=mapped, others=others)
                 for policy in ("lru", "lfu") for mapped in (False, True)]
        rows.append((name, slots, exact, *rates, best))
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    print("\n| card, rung | slots | of all experts | exact LRU | read-through LRU | LRU, mapped victims "
          "| read-through LFU (aging) | LFU, mapped victims | Belady (future known) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, slots, exact, lru, lru_m, lfu, lfu_m, best in rows:
        exact_s = "-" if exact != exact else f"{exact:.1%}"  # (NaN: several rows)
        print(f"| {name} | {slots:,} | {slots / (LAYERS * EXPERTS):.1%} | {exact_s} | {lru:.1%} | {lru_m:.1%} "
              f"({100 * (lru_m - lru):+.1f}) | {lfu:.1%} | {lfu_m:.1%} ({100 * (lfu_m - lfu):+.1f}) | "
              + ("-" if best != best else f"{best:.1%}") + " |")


if __name__ == "__main__":
    main()
