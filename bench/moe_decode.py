"""The decode MoE block on the H200: routed experts + shared expert, unfused (today's launches) vs
fused (`moe_decode_triton`: two launches, the shared expert as one more pair, one sum), and the
fused block with its whole-K word decode in Triton against inline PTX (kernel variant "nvfp4-lanes-triton" against the default). Not a test.

    PYTHONPATH=. python3 bench/moe_decode.py [--sweep] [--grouped [--sweep]] [--shape S,H,I,K] [--batches 1,8]
        [--variants NAME[,NAME...]]

`--variants`: the fused block under each named kernel variant (`ft.kernels.options.VARIANTS`, e.g.
nvfp4-no-half-sums) against the defaults, timed in turns (default, variants, default, variants: the
better of two each), with each one's error against the reference: a table of its own.

`--grouped`: instead, at batch 8, 16, 32 and 64 with uniform routing (pairs per distinct expert
~1.08 / 1.16 / 1.34 / 1.75, as the calibrated trace gives): the decode block, and its routed part
alone on the per-pair kernels against the prefill's grouped tl.dot path (`moe_over_slots_triton`,
`grouped=True`: each expert's tile decoded once for all its pairs), whether a step whose tokens share
experts is better served grouped; with `--sweep`, also the grouped path on decode-sized tiles
(`GROUPED_DECODE_SWEEP`: 16-pair tiles, the prefill's are 32 and 128).

Flagship shapes (512 slots, H 2048, I 512, top-10, shared expert of the same shapes; `--shape 512,2560,640,10`
for Qwen3.8-Flash-Next's), bf16, every
call inside a CUDA graph over 24 routings (`bench.gpu_timing.graph_us`; the pool is 850 MB, past
L2). Prints a table last.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from bench.gpu_timing import graph_us, rel_rms
from bench.kernels_nvfp4 import MOE, random_pool
from ft.kernels.activation import expert_combine, silu_mul
from ft.kernels.moe import SlotWeights, moe_decode_ref, moe_over_slots_ref
from ft.kernels.moe.decode_kernel import moe_decode_triton
from ft.kernels.moe.kernel import moe_over_slots_triton
from ft.kernels.options import use_kernel_options, variant
from ft.kernels.nvfp4 import nvfp4_linear
from ft.kernels.router.kernel import route_triton

DEV = torch.device("cuda")
TOL = 1e-2


def unfused(x, slots, wts_routed, pool, shared, gate_logit, out):
    """The launches the model ran before: routed MoE (gate_up, down, sum), the shared MLP (gate, up,
    SiLU, down) and the gated combine."""
    routed = moe_over_slots_triton(x, slots, wts_routed, pool, out=out)
    i = shared.w13.shape[1] // 2
    g = nvfp4_linear(x, shared.w13[0, :i], shared.w13_scale[0, :i], shared.scale_2[0, 0])
    u = nvfp4_linear(x, shared.w13[0, i:], shared.w13_scale[0, i:], shared.scale_2[0, 1])
    s = nvfp4_linear(silu_mul(g, u), shared.w2[0], shared.w2_scale[0], shared.scale_2[0, 2])
    return expert_combine(routed, s, gate_logit)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time other block sizes of the fused kernels")
    ap.add_argument("--grouped", action="store_true", help="the routed part per pair against the grouped tl.dot path, "
                                                           "batch 8 to 64")
    ap.add_argument("--shape", default=",".join(map(str, MOE)), help="slots,hidden,intermediate,top-k (default: "
                    "the 80B's; Qwen3.8-Flash-Next: 512,2560,640,10)")
    ap.add_argument("--batches", default="1,8", help="tokens a step for the fused block's rows and --sweep")
    ap.add_argument("--variants", default="", help="kernel variants timed against the defaults (their own table)")
    args = ap.parse_args()
    n_slots, hid, inter, top_k = (int(v) for v in args.shape.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    pool = random_pool(n_slots, hid, inter)
    shared = SlotWeights(*(t[:1].clone() for t in pool))
    if args.grouped:
        return grouped_table(pool, GROUPED_DECODE_SWEEP if args.sweep else [])
    rows, variant_rows = [], []
    names = [v for v in args.variants.split(",") if v]
    for batch in batches:
        routes = [torch.stack([torch.randperm(n_slots, device=DEV)[:top_k] for _ in range(batch)]) for _ in range(24)]
        x = torch.randn(batch, hid, device=DEV, dtype=torch.bfloat16)
        gate_logit = torch.randn(batch, 1, device=DEV, dtype=torch.bfloat16)
        wts = torch.cat([torch.softmax(torch.randn(batch, top_k, device=DEV), -1), torch.sigmoid(gate_logit.float())],
                        dim=1).to(torch.bfloat16)
        out = torch.empty_like(x)
        ref = moe_decode_ref(x, routes[0], wts, pool, shared)
        wr = wts[:, :-1].contiguous()
        err_u = rel_rms(unfused(x, routes[0], wr, pool, shared, gate_logit, out), ref)
        err_f = rel_rms(moe_decode_triton(x, routes[0], wts, pool, shared), ref)
        t_u = graph_us([partial(unfused, x, r, wr, pool, shared, gate_logit, out) for r in routes])
        t_f = graph_us([partial(moe_decode_triton, x, r, wts, pool, shared, out=out) for r in routes])
        y_p = moe_decode_triton(x, routes[0], wts, pool, shared)
        with use_kernel_options(variant("nvfp4-lanes-triton")):  # the word decode in Triton (before 2026-12-02)
            y_t = moe_decode_triton(x, routes[0], wts, pool, shared)
            t_t = graph_us([partial(moe_decode_triton, x, r, wts, pool, shared, out=out) for r in routes])
        same = torch.equal(y_p, y_t)
        t_f = min(t_f, graph_us([partial(moe_decode_triton, x, r, wts, pool, shared, out=out) for r in routes]))
        best = ("default tiles", t_f)
        if args.sweep:  # one pass's tile at a time, the other's the default (its best is found alone)
            downs = [(d, False) for d in SWEEP_DOWN_LOOP if batch <= 8] + [(d, True) for d in SWEEP_DOWN_PAIRS]
            configs = [(gu, None, None) for gu in SWEEP_GATE_UP] + [(None, dn, pairs) for dn, pairs in downs]
            for gu, dn, pairs in configs:
                fn = partial(moe_decode_triton, gate_up_config=gu, down_config=dn, down_per_pair=pairs)
                e = rel_rms(fn(x, routes[0], wts, pool, shared), ref)
                tc = graph_us([partial(fn, x, r, wts, pool, shared, out=out) for r in routes]) if e < TOL else float("inf")
                name = f"gate_up {gu}" if gu else f"down {dn} {'pairs' if pairs else 'loop'}"
                print(f"  sweep b{batch} {name}: {tc:.2f} us ({t_f / tc:.3f}x the defaults) err {e:.1e}", flush=True)
                if tc < best[1]:
                    best = (name, tc)
        rows.append((batch, t_u, t_t, t_f, err_u, err_f, same, best))
        if names:
            variant_rows.append((batch, *variant_times(names, x, routes, wts, pool, shared, out, ref)))
        print(f"batch {batch}: unfused {t_u:.2f} us, fused {t_f:.2f} us", flush=True)
    route_rows = []
    table = torch.randperm(n_slots, device=DEV)
    for batch in batches:
        logits = [torch.randn(batch, n_slots + 1, device=DEV, dtype=torch.bfloat16) for _ in range(24)]
        for warps in (1, 2, 4, 8):
            t_r = graph_us([partial(route_triton, lg, top_k, True, shared_gate=True, slot_table=table, num_warps=warps)
                            for lg in logits])
            route_rows.append((batch, warps, t_r))
    print(f"\n{'batch':>5} {'warps':>5} {'route us':>9}")
    for batch, warps, t_r in route_rows:
        print(f"{batch:>5} {warps:>5} {t_r:>9.2f}")
    if variant_rows:
        print(f"\n{'batch':>5} {'defaults us':>12} " + " ".join(f"{n + ' us':>22} {'x':>6} {'err':>8}" for n in names))
        for batch, t_d, cols in variant_rows:
            print(f"{batch:>5} {t_d:>12.2f} " + " ".join(f"{t:>22.2f} {t_d / t:>5.3f}x {e:>8.1e}" for t, e in cols))
    print(f"\n{'batch':>5} {'unfused us':>11} {'fused, Triton lanes us':>23} {'fused us':>9} {'PTX lanes':>10} "
          f"{'err unfused':>12} {'err fused':>10} {'same bits':>9}  best config")
    for batch, t_u, t_t, t_f, err_u, err_f, same, best in rows:
        print(f"{batch:>5} {t_u:>11.2f} {t_t:>23.2f} {t_f:>9.2f} {t_t / t_f:>9.2f}x {err_u:>12.1e} {err_f:>10.1e} "
              f"{str(same):>9}  {best[0]} {best[1]:.2f} us")


def variant_times(names, x, routes, wts, pool, shared, out, ref):
    """The fused block's us with the defaults and under each variant, in two rounds of turns (the better
    of each's two), and each variant's error against the reference: (t_defaults, [(t, err), ...])."""
    def timed(*variant_names):
        with use_kernel_options(variant(*variant_names)):
            return graph_us([partial(moe_decode_triton, x, r, wts, pool, shared, out=out) for r in routes])

    best = {None: float("inf"), **{n: float("inf") for n in names}}
    for _ in range(2):
        for name in [None, *names]:
            best[name] = min(best[name], timed(*([name] if name else [])))
    errs = []
    for name in names:
        with use_kernel_options(variant(name)):
            errs.append(rel_rms(moe_decode_triton(x, routes[0], wts, pool, shared), ref))
    return best[None], [(best[n], e) for n, e in zip(names, errs)]


SWEEP_GATE_UP = [(8, 0, 4), (4, 0, 4), (16, 0, 4), (8, 0, 2), (16, 0, 8), (32, 0, 8), (4, 0, 2), (4, 0, 1), (8, 0, 1),
                 (16, 0, 2)]
"""Gate/up tiles (BLOCK_I rows, BLOCK_W words or 0 for the whole K, warps) of `--sweep`."""
SWEEP_DOWN_LOOP = [(8, 0, 4), (16, 0, 4), (8, 0, 2)]
"""Down tiles of the per-token loop (swept at batches up to 8: past them the per-pair pass wins)."""
SWEEP_DOWN_PAIRS = [(16, 0, 1), (16, 0, 2), (32, 0, 1), (32, 0, 2), (64, 0, 2), (16, 0, 4), (32, 0, 4), (64, 0, 4),
                    (32, 0, 8), (128, 0, 8), (64, 0, 8), (128, 0, 4), (256, 0, 8)]
"""Down tiles of the per-pair pass (BLOCK_H rows, whole K, warps). The last two for Qwen3.8-Flash-Next's K of
640 (two whole-K tiles, 64 + 16 words): its down pass ran at ~43% of the H100's stream at batch 8 (session 47),
in 64-row programs of ~22 KB each."""


GROUPED_DECODE_SWEEP = [(16, 64, 128, 4, 3, True), (16, 128, 128, 4, 3, True), (16, 64, 256, 4, 2, True),
                        (16, 32, 256, 4, 2, True), (16, 128, 64, 4, 4, True), (16, 64, 64, 4, 4, True),
                        (16, 256, 64, 8, 3, True)]
"""Grouped tiles (BLOCK_M pairs, BLOCK_N rows, BLOCK_K, warps, stages, SWAP_AB) sized for a decode step's
runs of 1-2 pairs an expert."""


def grouped_table(pool: SlotWeights, sweep: list) -> None:
    """At batch 8..64, us per call (graph of 24 routings): the decode block (routed + shared, per
    pair), the routed part per pair and on the grouped tl.dot path, and the pairs per distinct expert;
    then the grouped path on each tile of `sweep`."""
    n_slots, hid, _, top_k = MOE
    shared = SlotWeights(*(t[:1].clone() for t in pool))
    rows = []
    for batch in (8, 16, 32, 64):
        routes = [torch.stack([torch.randperm(n_slots, device=DEV)[:top_k] for _ in range(batch)]) for _ in range(24)]
        share = sum(r.numel() / r.unique().numel() for r in routes) / len(routes)
        x = torch.randn(batch, hid, device=DEV, dtype=torch.bfloat16)
        wts = torch.cat([torch.softmax(torch.randn(batch, top_k, device=DEV), -1), torch.rand(batch, 1, device=DEV)],
                        dim=1).to(torch.bfloat16)
        wr = wts[:, :-1].contiguous()
        out = torch.empty_like(x)
        ref = moe_over_slots_ref(x, routes[0], wr, pool)
        errs = [rel_rms(moe_over_slots_triton(x, routes[0], wr, pool, grouped=g, distinct_slots=n_slots + 1), ref)
                for g in (False, True)]
        t_block = graph_us([partial(moe_decode_triton, x, r, wts, pool, shared, out=out) for r in routes])
        t_pairs, t_grouped = (graph_us([partial(moe_over_slots_triton, x, r, wr, pool, out=out, grouped=g,
                                                distinct_slots=n_slots + 1) for r in routes]) for g in (False, True))
        best = ("default", t_grouped)
        for cfg in sweep:
            fn = partial(moe_over_slots_triton, grouped=True, grouped_config=cfg, distinct_slots=n_slots + 1)
            e = rel_rms(fn(x, routes[0], wr, pool), ref)
            tc = graph_us([partial(fn, x, r, wr, pool, out=out) for r in routes]) if e < TOL else float("inf")
            print(f"  sweep b{batch} grouped {cfg}: {tc:.1f} us err {e:.1e}", flush=True)
            if tc < best[1]:
                best = (cfg, tc)
        rows.append((batch, share, t_block, t_pairs, t_grouped, *errs, best))
        print(f"batch {batch}: block {t_block:.1f} us, routed per pair {t_pairs:.1f}, grouped {t_grouped:.1f}", flush=True)
    print(f"\n{'batch':>5} {'pairs/expert':>12} {'block us':>9} {'routed per pair us':>19} {'routed grouped us':>18} "
          f"{'grouped/pairs':>13} {'err pairs':>10} {'err grouped':>11}  best grouped tile")
    for batch, share, t_block, t_pairs, t_grouped, e_p, e_g, best in rows:
        print(f"{batch:>5} {share:>12.2f} {t_block:>9.1f} {t_pairs:>19.1f} {t_grouped:>18.1f} {t_grouped / t_pairs:>12.2f}x "
              f"{e_p:>10.1e} {e_g:>11.1e}  {best[0]} {best[1]:.1f} us")

if __name__ == "__main__":
    main()
