"""The MoE block of a prefill chunk (routed experts only), NVFP4 slots against torch bf16. Not a test.

    PYTHONPATH=. python3 bench/moe_prefill.py [--tokens 1024,4096,8192] [--sweep] [--split] [--words]
        [--variants NAME[,NAME...]]

Flagship shapes: 512 experts (all resident), hidden 2048, intermediate 512, top-10, random routing
(every expert gets ~T * 10 / 512 pairs). Rows:

* before: the grouped path's former tiling (32 x 64 x 128 tiles, passes of 1,024 tokens; the
  per-pair outputs were fp32 then, they are in x's dtype now);
* after: `moe_over_slots_triton` as it is now (`grouped_config_for` the pass, passes of `MoeOptions.grouped_max_tokens`);
* torch bf16: the same experts dequantized to bf16, tokens sorted by expert, `torch._grouped_mm`
  for gate_up and down (cuBLAS grouped GEMM) plus the torch glue: the "GEMM speed" the issue
  compares against.

`--variants`: "after" again under each named kernel variant (`ft.kernels.options.VARIANTS`, e.g.
moe-bytes), then "after" once more (the defaults, timed on both sides of the variants).

Times are `triton.testing.do_bench` medians; TFLOP/s counts 2 * pairs * 3 * H * I. `--sweep` also
times the block configurations in SWEEP. Prints a table last.

`--once`: no timing; one grouped pass at the first of `--tokens` under the defaults, then under each of
`--variants`, each after a warm pass, for a profiler to look at, e.g.
`ncu --kernel-name regex:_grouped --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum
python3 bench/moe_prefill.py --once --tokens 16384 --variants moe-grouped-tiles-first` (launches 3-4 and 7-8).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import triton
from triton.testing import do_bench

import ft.kernels.moe.grouped_kernel as grp
import ft.kernels.moe.kernel as moe_kernel
from ft.kernels.moe import SlotWeights, moe_over_slots_ref
from ft.kernels.moe.kernel import moe_over_slots_triton
from ft.kernels.nvfp4.reference import dequantize_nvfp4
from ft.kernels.options import kernel_options, use_kernel_options, variant

E, H, I, K = 512, 2048, 512, 10
SWEEP = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, SWAP_AB]); session 9 swept the unswapped tiles
    (64, 64, 64, 4, 4), (32, 64, 128, 4, 3), (64, 64, 64, 4, 4, True), (32, 64, 128, 4, 3, True),
    (16, 64, 128, 4, 3, True), (32, 64, 64, 4, 4, True), (128, 64, 64, 4, 4, True), (64, 128, 64, 4, 4, True),
    (32, 128, 128, 4, 3, True),
]
BASE_4K = (128, 64, 64, 4, 4, True)
SPLIT_TILES = [  # --split: each tile for one of the two passes at a time, the other kept at BASE_4K
    (128, 128, 64, 8, 3, True), (128, 128, 64, 8, 4, True), (128, 64, 128, 4, 3, True), (128, 64, 128, 8, 3, True),
    (128, 128, 128, 8, 2, True), (128, 64, 64, 8, 4, True), (128, 64, 64, 4, 3, True), (128, 64, 64, 4, 5, True),
]


def random_pool() -> SlotWeights:
    """Random NVFP4 experts: every nibble valid, block scales ~ 2**U(-3, 3), global scales ~ 0.01."""
    def part(n: int, k: int):
        packed = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, device="cuda")
        return packed, torch.exp2(torch.empty(E, n, k // 16, device="cuda").uniform_(-3, 3)).to(torch.float8_e4m3fn)

    (w13, s13), (w2, s2w) = part(2 * I, H), part(H, I)
    return SlotWeights(w13, w2, s13, s2w, torch.empty(E, 3, device="cuda").uniform_(0.005, 0.02))


def torch_grouped(x, ids, wts, w13, w2):
    """bf16 reference at GEMM speed: sort pairs by expert, grouped GEMMs, weighted scatter-add."""
    t = x.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // K]
    gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    y = y * wts.reshape(-1)[order, None]
    return torch.zeros(t, H, device=x.device, dtype=torch.float32).index_add_(0, order // K, y.float()).to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,4096,8192")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--passes", default="1024,4096", help="tokens per grouped pass to sweep (--sweep)")
    ap.add_argument("--words", action="store_true",
                    help="also time the library's tiles with the byte-wise weight decode (kernel variant moe-bytes; "
                         "the default decodes words)")
    ap.add_argument("--variants", default="", help="kernel variants timed as 'after' rows of their own")
    ap.add_argument("--split", action="store_true",
                    help="4,096-token passes: SPLIT_TILES for gate_up alone, then for down alone (the other: BASE_4K)")
    ap.add_argument("--once", action="store_true", help="one pass per variant for a profiler, nothing timed")
    args = ap.parse_args()
    pool = random_pool()
    if args.once:
        t = int(args.tokens.split(",")[0])
        x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.topk(torch.randn(t, E, device="cuda"), K, dim=-1).indices
        wts = torch.softmax(torch.randn(t, K, device="cuda"), -1).to(torch.bfloat16)
        for name in [""] + [v for v in args.variants.split(",") if v]:
            with use_kernel_options(variant(*([name] if name else []))):
                for _ in range(2):  # warm, then the pass to look at
                    moe_over_slots_triton(x, ids, wts, pool, grouped=True)
                torch.cuda.synchronize()
            print(f"one pass of {t} tokens: {name or 'defaults'}", flush=True)
        return
    w13 = torch.stack([torch.cat([dequantize_nvfp4(pool.w13[e, :I], pool.w13_scale[e, :I], pool.scale_2[e, 0]),
                                  dequantize_nvfp4(pool.w13[e, I:], pool.w13_scale[e, I:], pool.scale_2[e, 1])])
                       for e in range(E)]).to(torch.bfloat16)
    w2 = torch.stack([dequantize_nvfp4(pool.w2[e], pool.w2_scale[e], pool.scale_2[e, 2]) for e in range(E)]).to(torch.bfloat16)
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.topk(torch.randn(t, E, device="cuda"), K, dim=-1).indices
        wts = torch.softmax(torch.randn(t, K, device="cuda"), -1).to(torch.bfloat16)
        ref = moe_over_slots_ref(x[:256], ids[:256], wts[:256], pool).float()
        flops = 2 * t * K * 3 * H * I

        def run(label, fn):
            err = ((fn()[:256].float() - ref).norm() / ref.norm()).item()
            ms = do_bench(fn, return_mode="median")
            rows.append((t, label, ms, flops / ms / 1e9, err))
            print(f"T{t} {label}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s err {err:.1e}", flush=True)
            return ms

        with use_kernel_options(variant("moe-bytes", **{"moe.grouped_max_tokens": 1024})):
            run("before", partial(moe_over_slots_triton, x, ids, wts, pool, grouped=True,
                                  grouped_config=(32, 64, 128, 4, 3)))
        run("after", partial(moe_over_slots_triton, x, ids, wts, pool, grouped=True))
        for name in (v for v in args.variants.split(",") if v):
            with use_kernel_options(variant(name)):
                run(f"after, {name}", partial(moe_over_slots_triton, x, ids, wts, pool, grouped=True))
        if args.variants:
            run("after, again", partial(moe_over_slots_triton, x, ids, wts, pool, grouped=True))
        if args.words:
            with use_kernel_options(variant("moe-bytes")):
                run("after, byte decode", partial(moe_over_slots_triton, x, ids, wts, pool, grouped=True))
        if args.sweep:
            for passes in (int(v) for v in args.passes.split(",")):
                with use_kernel_options(variant(**{"moe.grouped_max_tokens": passes})):
                    for cfg in SWEEP:
                        try:
                            run(f"pass {passes} {cfg}",
                                partial(moe_over_slots_triton, x, ids, wts, pool, grouped=True, grouped_config=cfg))
                        except Exception as exc:  # noqa: BLE001
                            print(f"  {cfg} failed: {type(exc).__name__} {str(exc)[:100]}")
        if args.split:
            for which in ("gate_up", "down"):
                for tile in [BASE_4K] + SPLIT_TILES if which == "gate_up" else SPLIT_TILES:
                    cfg = (tile, BASE_4K) if which == "gate_up" else (BASE_4K, tile)
                    try:
                        run(f"{which} {tile}", partial(moe_over_slots_triton, x, ids, wts, pool, grouped=True,
                                                       grouped_config=cfg))
                    except Exception as exc:  # noqa: BLE001
                        print(f"  {which} {tile} failed: {type(exc).__name__} {str(exc)[:100]}")
        try:
            run("torch bf16 grouped_mm", partial(torch_grouped, x, ids, wts, w13, w2))
        except Exception as exc:  # noqa: BLE001
            print(f"torch grouped_mm unavailable: {type(exc).__name__} {str(exc)[:120]}")
    print(f"\ngrouped_max_tokens {kernel_options().moe.grouped_max_tokens}, GROUPED_CONFIG {grp.GROUPED_CONFIG}, "
          f"GROUPED_CONFIG_SHORT {grp.GROUPED_CONFIG_SHORT} up to {grp.GROUPED_SHORT_TOKENS} tokens, "
          f"{triton.__version__=}, {torch.__version__=}")
    print(f"{'tokens':>6}  {'variant':<44} {'ms':>8} {'TFLOP/s':>8} {'rel err':>8}")
    for t, label, ms, tf, err in rows:
        print(f"{t:>6}  {label:<44} {ms:>8.3f} {tf:>8.0f} {err:>8.1e}")


if __name__ == "__main__":
    main()
