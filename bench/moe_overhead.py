"""Where the fused MoE's time goes on the GPU (kernels issue). Not a test.

    PYTHONPATH=. python3 bench/moe_overhead.py

Times `moe_over_slots_triton` for 10 experts (flagship shapes) at batch 1 and 8: eager
(`do_bench`, host work included) against CUDA-graph replay (`do_bench_cudagraph`, kernels
only), and the two-pass total against the bytes floor at 4.3 TB/s. Prints a table last.
"""

from __future__ import annotations

import torch
import triton.testing

from bench.cuda_engine_check import slot_pool
from ft.kernels.moe_triton import moe_over_slots_triton


def main() -> None:
    torch.manual_seed(0)
    pool = slot_pool(64, 2048, 512)
    per_expert = pool.w13[0].numel() + pool.w2[0].numel() + pool.w13_scale[0].numel() + pool.w2_scale[0].numel()
    rows = []
    for batch in (1, 8):
        x = torch.randn(batch, 2048, device="cuda", dtype=torch.bfloat16)
        slots = torch.stack([torch.randperm(64, device="cuda")[:10] for _ in range(batch)])
        w = torch.softmax(torch.randn(batch, 10, device="cuda"), -1).to(torch.bfloat16)
        out = torch.empty_like(x)
        fn = lambda: moe_over_slots_triton(x, slots, w, pool, out=out)  # noqa: E731
        fn()
        eager = triton.testing.do_bench(fn, return_mode="median") * 1e3
        graph = triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3
        floor = len(torch.unique(slots)) * per_expert / 4.3e12 * 1e6
        rows.append((batch, eager, graph, floor))
    sweep = []
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64, device="cuda")[:10][None]
    w = torch.softmax(torch.randn(1, 10, device="cuda"), -1).to(torch.bfloat16)
    out = torch.empty_like(x)
    ref = moe_over_slots_triton(x, slots, w, pool)
    for gu in [(16, 128, 4), (32, 128, 4), (32, 256, 4), (64, 128, 8), (64, 256, 8), (8, 256, 4), (16, 512, 4)]:
        for dn in [(16, 128, 4), (32, 128, 4), (64, 128, 8), (32, 64, 4), (8, 128, 4)]:
            fn = lambda: moe_over_slots_triton(x, slots, w, pool, out=out, gate_up_config=gu, down_config=dn)  # noqa: E731
            fn()
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            sweep.append((triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3, gu, dn, err))
    sweep.sort(key=lambda r: r[0])
    print("\nbatch-1 sweep (graph us, gate_up config, down config, rel diff to default):")
    for r in sweep[:8]:
        print(f"  {r[0]:7.1f}  {r[1]}  {r[2]}  {r[3]:.1e}")
    print(f"\n{'batch':>5} {'eager us':>9} {'graph us':>9} {'bytes floor us':>14}")
    for b, e, g, f in rows:
        print(f"{b:>5} {e:>9.1f} {g:>9.1f} {f:>14.1f}")


if __name__ == "__main__":
    main()
