"""Fit the synthetic routing trace (`ft.tools.routing_trace`) to published LRU hit rates. CPU only.

    PYTHONPATH=. python3 bench/routing_calibration.py [--layers 8] [--tokens 1200] [--seed 0]

For 512 experts / top-10 the published measurements give an LRU hit rate of about 67% with 12.5%
of all experts cached and about 81% with 25% (`routing_trace.TARGETS`). A grid over the Zipf
exponent s (0.45..1.2) and the reuse probability p (0.20..0.50) replays each trace through an
exact global LRU (`lru_hit_rate`) at both cache sizes, after a warm-up of a third of the tokens,
and picks the pair with the smallest squared error. Layers are alike in the trace, so a global
LRU over a few layers behaves as over all 48 (checked: the table's last row replays 48 layers).
Prints the grid's best rows and the check last.
"""

from __future__ import annotations

import argparse
import time

from ft.tools.routing_trace import CALIBRATED, TARGETS, RoutingParams, RoutingTrace, lru_hit_rate

EXPERTS, TOP_K = 512, 10


def rates(params: RoutingParams, layers: int, tokens: int, seed: int) -> list[float]:
    trace = RoutingTrace(layers, EXPERTS, TOP_K, params, seed).tokens(tokens)
    return [lru_hit_rate(trace, int(frac * layers * EXPERTS), warmup=tokens // 3) for frac, _ in TARGETS]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    for s in [0.45 + 0.05 * i for i in range(16)]:
        for p in [0.20 + 0.025 * i for i in range(13)]:
            params = RoutingParams(round(s, 3), round(p, 3))
            got = rates(params, args.layers, args.tokens, args.seed)
            err = sum((g - want) ** 2 for g, (_, want) in zip(got, TARGETS))
            rows.append((err, params, got))
    rows.sort(key=lambda r: r[0])
    print(f"grid of {len(rows)} in {time.perf_counter() - t0:.1f} s ({args.layers} layers, {args.tokens} tokens)")
    head = " | ".join(f"hits @{frac:.1%} (want {want:.0%})" for frac, want in TARGETS)
    print(f"\n| zipf s | reuse p | {head} | squared error |")
    print("|---|---|" + "---|" * len(TARGETS) + "---|")
    for err, params, got in rows[:5]:
        cells = " | ".join(f"{g:.1%}" for g in got)
        print(f"| {params.zipf_s} | {params.reuse_p} | {cells} | {err:.5f} |")
    check = rates(CALIBRATED, 48, max(300, args.tokens // 4), args.seed + 1)
    cells = " | ".join(f"{g:.1%}" for g in check)
    print(f"| CALIBRATED {CALIBRATED.zipf_s} | {CALIBRATED.reuse_p} | {cells} | 48 layers, other seed |")


if __name__ == "__main__":
    main()
