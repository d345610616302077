"""NVFP4 kernels on the GPU: correctness against the torch references, then timings; tables last.

Usage (device): ``PYTHONPATH=. python3 bench/kernels_nvfp4.py [--sweep] [--log FILE] [--baseline-rev REV]``

Shapes (N x K) from Qwen3-Next-80B-A3B: in_proj_qkvz 12288x2048, attention q 8192x2048,
out_proj 2048x4096, expert gate_up 1024x2048, expert down 2048x512, and 32768x8192 for the
bandwidth ceiling; Qwen3.8-Flash-Next's in_proj_qkvz 16384x2560, attention q/gate/k/v 13312x2560 and
out_proj / o_proj 2560x6144 (fn_*: K / 8 no power of two: two whole-K tiles at M = 1, the sweep's K loops beside
them); decode at M = 1 and 8, prefill GEMM at M = 4096 on 8192x2048; the fused MoE
with 10 of 512 experts (hidden 2048, intermediate 512) at batch 1 and 8, and grouped at 1024.

Decode timings are CUDA-graph replays (`bench.gpu_timing.graph_us`) of calls that each read
their own copy of the weights (a pass reads 4x the L2), so every call reads HBM and no Python
launch cost is counted: what the engine's graphed decode sees. Effective GB/s counts weights +
block scales + x read and y written once; the ceiling is the measured 4.3 TB/s copy. Baselines
in the same run: torch bf16 ``matmul`` on dense [N, K] weights (same rotation), and, with
``--baseline-rev REV``, the kernels of git revision REV ("before" columns), so "before -> after"
is a ratio from one run. The first version of the kernels (the "v1" of bench/RESULTS.md):
``--baseline-rev 9247dbf --baseline-nvfp4 bench/baselines/nvfp4_triton_v1.py
--baseline-moe bench/baselines/moe_triton_v1.py``.
Prefill and grouped-MoE times are ``triton.testing.do_bench`` medians (launch cost negligible).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from types import ModuleType

import torch
import triton
from triton.testing import do_bench

from bench.git_rev import exists_at, import_at
from bench.gpu_timing import COPY_CEILING_GBS, copies_for, graph_us, rel_rms
from ft.kernels.moe import SlotWeights, moe_over_slots_ref
from ft.kernels.moe.kernel import moe_over_slots_triton
from ft.kernels.nvfp4 import dequantize_nvfp4, nvfp4_linear, nvfp4_linear_ref
from ft.kernels.nvfp4.kernel import nvfp4_linear_triton
from ft.kernels.options import set_kernel_options, variant

TOL_BF16 = 1e-2  # relative RMS vs the fp32-matmul reference, y rounded to bf16
TOL_MOE = 2e-2  # the MoE reference runs its matmuls in bf16

DECODE_SHAPES = [
    ("in_proj_qkvz", 12288, 2048),
    ("attn_q", 8192, 2048),
    ("out_proj", 2048, 4096),
    ("expert_gate_up", 1024, 2048),
    ("expert_down", 2048, 512),
    ("large", 32768, 8192),
    ("fn_qkvz", 16384, 2560),
    ("fn_attn_qkv", 13312, 2560),
    ("fn_out_proj", 2560, 6144),
]
PREFILL = ("attn_q", 8192, 2048, 4096)
MOE = (512, 2048, 512, 10)  # slots, hidden, intermediate, top-k
MOE_GROUPED_TOKENS = (64, 1024)

DEV = torch.device("cuda")
X_DTYPE = torch.bfloat16
"""Activations' dtype: bf16 on the device; fp16 in --dry-run (the interpreter's bf16 `tl.dot` is wrong)."""

GEMV_SWEEP = [
    {"BLOCK_N": bn, "BLOCK_W": bw, "num_warps": nw}
    for bn, bw, nw in [(8, 64, 4), (32, 64, 4), (4, 128, 4), (16, 64, 4)]
] + [{"BLOCK_N": bn, "BLOCK_W": 2, "num_warps": nw, "WHOLE_K": True} for bn, nw in [(4, 4), (8, 4), (16, 4), (2, 4), (8, 8), (32, 8)]]
GEMV_M8_SWEEP = [{"BLOCK_M": 8, "BLOCK_N": bn, "BLOCK_W": 2, "WHOLE_K": True, "num_warps": nw}
                 for bn, nw in [(1, 4), (2, 4), (4, 4), (2, 8), (4, 8), (8, 8)]]
DOT_SMALL_SWEEP = [
    {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "num_warps": nw, "num_stages": st, "SWAP_AB": sw}
    for bn, bk, nw, st, sw in [(32, 256, 4, 3, False), (64, 128, 4, 3, False), (64, 256, 4, 3, True), (64, 128, 4, 3, True),
                               (128, 128, 4, 3, True), (64, 128, 4, 4, True), (128, 64, 4, 4, True), (64, 256, 4, 2, True)]
]
DOT_HALVES_SMALL_SWEEP = [
    {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "num_warps": nw, "num_stages": st, "SPLIT_K": sk}
    for bn, bk, nw, st, sk in [(32, 256, 4, 3, 2), (32, 256, 4, 3, 4), (32, 256, 2, 3, 1), (32, 256, 8, 3, 1),
                               (32, 512, 4, 2, 1), (32, 128, 4, 4, 1), (32, 256, 4, 4, 1), (16, 256, 4, 3, 1),
                               (16, 256, 2, 3, 1), (64, 256, 4, 3, 1), (64, 128, 4, 3, 1), (64, 256, 8, 3, 1)]
]
"""Decode batches of 3-16 rows on the halves (the tile `_dot_config` takes there, 16 x 32 x 256 in 4 warps and 3
stages, against other widths, depths, warps, stages and K split over 2 or 4 programs, session 46). Five wider tiles
(64 and 128 columns in 2-8 warps, session 61) lost both models' steps in session 62 (alone at M = 8: up to 3% faster
on fn_qkvz, 15-36% slower on in_proj_qkvz; bench/RESULTS.md): they left the list."""
DOT_MID_SWEEP = [
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "num_warps": nw, "num_stages": 3, "HALVES": hv,
     "SPLIT_K": sk}
    for bm, bn, bk, hv in [(32, 64, 128, True), (64, 32, 256, True), (16, 32, 256, True), (64, 16, 256, True),
                           (64, 64, 128, False)]
    for nw, sk in ([(4, 1), (4, 2), (4, 4), (8, 1)] if hv else [(4, 1)])
]
"""Decode batches past 16 rows (`--decode-m 32,64`): the tiles `_dot_config` chooses from for 16 < M <= 64 since
session 28 (32 x 64 x 128 / 64 x 32 x 256 with the halves, 16 x 32 x 256 / 64 x 16 x 256 where the wide one launches
too few programs) and the 64 x 64 x 128 tile without the halves that was the default before (the 32-row tiles of
32 or 16 columns lost everywhere and left the list; their figures: bench/RESULTS.md, session 28); each halves tile
also with K split over 2 and 4 programs (`Nvfp4Options.dot_split_k`, the tile's last program summing) and in 8 warps.
Six wider tiles (64 and 128 columns, session 61) lost alone and in the 80B's step (session 62): they left the list."""
DOT_SWEEP = [
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": nw, "num_stages": st}
    for bm, bn, bk, nw, st in [(256, 128, 64, 8, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4)]
] + [
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": nw, "num_stages": st, "SWAP_AB": True}
    for bm, bn, bk, nw, st in [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (64, 128, 64, 4, 4),
                               (128, 128, 64, 4, 3), (128, 128, 128, 8, 3)]
]
MOE_SWEEP_GATE_UP = [(8, 64, 4), (16, 64, 4), (2, 0, 4), (4, 0, 4), (8, 0, 4), (16, 0, 8)]
MOE_SWEEP_DOWN = [(32, 32, 4), (32, 64, 4), (8, 0, 4), (16, 0, 4), (32, 0, 4)]
GROUPED_SWEEP = [(16, 64, 128, 4, 3), (32, 64, 128, 4, 3), (64, 64, 64, 4, 3), (32, 128, 64, 4, 3), (64, 128, 64, 8, 3)]

BASELINE_PATHS = {
    "nvfp4": ("ft/kernels/nvfp4/kernel.py", "ft/kernels/nvfp4_triton.py"),
    "moe": ("ft/kernels/moe/kernel.py", "ft/kernels/moe_triton.py"),
}
"""Where each kernel module lived, newest layout first: the default module of a --baseline-rev."""


def load_baseline(rev: str, paths: dict[str, str | None]) -> dict[str, ModuleType]:
    """The kernel modules of git revision `rev` ({"nvfp4": ..., "moe": ...}); `paths` names each
    module's file there (None: the first of `BASELINE_PATHS` that exists). Each module's public
    function must take this checkout's arguments (``out=`` included)."""
    if not exists_at(rev, "ft"):
        raise SystemExit(f"--baseline-rev {rev}: not a revision of this repository with an ft/ package")
    found = {}
    for name, path in paths.items():
        path = path or next((p for p in BASELINE_PATHS[name] if exists_at(rev, p)), None)
        if path is None or not exists_at(rev, path):
            raise SystemExit(f"--baseline-rev {rev}: no {name} kernel module at {path or BASELINE_PATHS[name]}")
        found[name] = path
    return import_at(rev, found)


def random_nvfp4(n: int, k: int, lead: tuple = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random NVFP4 weight bytes (every nibble valid), block scales ~ 2**U(-3, 3), scale_2 0.01."""
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=DEV.type)
    scale = torch.exp2(torch.empty(*lead, n, k // 16, device=DEV.type).uniform_(-3, 3)).to(torch.float8_e4m3fn)
    return packed, scale, torch.tensor(0.01, device=DEV.type)


def nbytes(m: int, n: int, k: int) -> int:
    return n * k // 2 + n * k // 16 + m * k * 2 + m * n * 2


class Shape:
    """One N x K weight in rotated copies (NVFP4 and dense bf16) with x and y buffers for M rows."""

    def __init__(self, n: int, k: int, m: int):
        self.n, self.k, self.m = n, k, m
        self.q = [random_nvfp4(n, k) for _ in range(copies_for(n * k // 2))]
        self.dense = [dequantize_nvfp4(*q, dtype=X_DTYPE) for q in self.q[:copies_for(n * k * 2)]]
        self.x = torch.randn(m, k, device=DEV.type, dtype=X_DTYPE)
        self.y = torch.empty(m, n, device=DEV.type, dtype=X_DTYPE)

    def time(self, fn, **kw) -> float:
        return graph_us([partial(fn, self.x, *q, out=self.y, **kw) for q in self.q])

    def time_torch(self) -> float:
        return graph_us([partial(torch.matmul, self.x, w.T, out=self.y) for w in self.dense])

    def check(self, fn, m: int | None = None, **kw) -> float:
        m = m or self.m
        x = torch.randn(m, self.k, device=DEV.type, dtype=X_DTYPE)
        out = torch.full((m, self.n), float("nan"), device=DEV.type, dtype=X_DTYPE)
        fn(x, *self.q[0], out=out, **kw)
        return rel_rms(out, nvfp4_linear_ref(x, *self.q[0]))


def decode_rows(args, base, say, failures):
    rows, sweep_rows = [], []
    ms = [int(v) for v in args.decode_m.split(",")]
    names = set(args.decode_shapes.split(",")) if args.decode_shapes else None
    for name, n, k in DECODE_SHAPES:
        if names is not None and name not in names:
            continue
        for m in ms:
            s = Shape(n, k, m)
            errs = [s.check(nvfp4_linear_triton, mm) for mm in {1: (1, 2), 8: (3, 8, 16)}.get(m, (m,))]
            x_d = torch.randn(m, k, device=DEV.type, dtype=X_DTYPE)
            errs.append(rel_rms(nvfp4_linear(x_d, *s.q[0]), nvfp4_linear_ref(x_d, *s.q[0])))
            if not max(errs) < TOL_BF16:
                failures.append((name, m, errs))
            t_new = s.time(nvfp4_linear_triton)
            t_old = s.time(base["nvfp4"].nvfp4_linear_triton) if base else None
            if args.interleaved and m > 2 and not base:  # "before": the 16-row tile without the halves
                from ft.kernels.nvfp4.kernel import _dot_config

                t_old = s.time(nvfp4_linear_triton, path="dot", config={**_dot_config(m, n, k), "HALVES": False})
            t_ref = s.time_torch()
            best = ("default", t_new)
            if args.sweep and not (m == 1 and args.sweep_skip_m1):
                cands = []
                if m == 1:
                    cands = [("gemv", dict(c, BLOCK_M=1)) for c in GEMV_SWEEP if k // 8 >= c["BLOCK_W"]
                             and (not c.get("WHOLE_K") or c["BLOCK_N"] * k // 8 <= 8192)]
                elif m > 16:
                    cands = [("dot", c) for c in DOT_MID_SWEEP]
                else:
                    cands = [("dot", c) for c in DOT_SMALL_SWEEP[:1] + DOT_HALVES_SMALL_SWEEP] \
                        + [("gemv", c) for c in GEMV_M8_SWEEP]
                for path, cfg in cands:
                    try:
                        err = s.check(nvfp4_linear_triton, path=path, config=cfg)
                        tc = s.time(nvfp4_linear_triton, path=path, config=cfg) if err < TOL_BF16 else float("inf")
                    except Exception as exc:  # noqa: BLE001 (a config the compiler refuses)
                        say(f"  sweep {name} M{m} {path} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    say(f"  sweep {name} M{m} {path} {cfg}: {tc:.2f} us err {err:.1e}")
                    sweep_rows.append((name, m, path, cfg, tc))
                    if tc < best[1]:
                        best = (f"{path} {cfg}", tc)
            gbs = nbytes(m, n, k) / (t_new * 1e-6) / 1e9
            rows.append((name, f"{n}x{k}", m, t_new, gbs, gbs / COPY_CEILING_GBS, t_old, t_ref, max(errs), best))
            before = f", before {t_old:.2f} us" if t_old is not None else ""
            say(f"{name} M{m}: {t_new:.2f} us ({gbs:.0f} GB/s){before}, torch bf16 {t_ref:.2f} us, err {max(errs):.1e}")
            del s
            torch.cuda.empty_cache()
    return rows


def prefill_rows(args, base, say, failures):
    name, n, k, m = PREFILL
    s = Shape(n, k, m)
    s.q, s.dense = s.q[:1], s.dense[:1]
    err = s.check(nvfp4_linear_triton)
    if not err < TOL_BF16:
        failures.append((name, m, err))
    bench = lambda fn, **kw: do_bench(partial(fn, s.x, *s.q[0], out=s.y, **kw), return_mode="median") * 1e3  # noqa: E731
    t_new = bench(nvfp4_linear_triton)
    t_old = bench(base["nvfp4"].nvfp4_linear_triton) if base else None
    t_ref = do_bench(partial(torch.matmul, s.x, s.dense[0].T, out=s.y), return_mode="median") * 1e3
    best = ("default", t_new)
    if args.sweep:
        for cfg in DOT_SWEEP:
            try:
                e = s.check(nvfp4_linear_triton, path="dot", config=cfg)
                tc = bench(nvfp4_linear_triton, path="dot", config=cfg)
            except Exception as exc:  # noqa: BLE001
                say("  sweep prefill failed:", cfg, type(exc).__name__, str(exc)[:120])
                continue
            say(f"  sweep prefill {cfg}: {tc:.1f} us, {2 * m * n * k / tc / 1e6:.0f} TFLOP/s, err {e:.1e}")
            if tc < best[1] and e < TOL_BF16:
                best = (str(cfg), tc)
    return [(name, f"{n}x{k}", m, t_new, t_old, t_ref, 2 * m * n * k, err, best)]


def random_pool(slots: int, hidden: int, inter: int) -> SlotWeights:
    w13, s13, _ = random_nvfp4(2 * inter, hidden, (slots,))
    w2, s2w, _ = random_nvfp4(hidden, inter, (slots,))
    s2 = torch.empty(slots, 3, device=DEV.type).uniform_(0.005, 0.02)
    return SlotWeights(w13, w2, s13, s2w, s2)


def router_row(say, failures):
    """The Triton router (softmax, top-k, renormalize) against its reference on flagship routing shapes."""
    from ft.kernels.router import router_topk_ref
    from ft.kernels.router.kernel import router_topk_triton

    n_experts, top_k = MOE[0], MOE[3]
    worst = 0.0
    for t in (1, 8, 1024):
        logits = torch.randn(t, n_experts, device=DEV.type, dtype=X_DTYPE) * 2
        w, ids = router_topk_triton(logits, top_k, True)
        w_ref, ids_ref = router_topk_ref(logits, top_k, True)
        probs = torch.softmax(logits.float(), -1)
        if not torch.equal(probs.gather(1, ids), probs.gather(1, ids_ref)):  # same experts up to ties
            failures.append(("router ids", t))
        worst = max(worst, rel_rms(w, w_ref))
    if not worst < TOL_BF16:
        failures.append(("router weights", worst))
    logits = torch.randn(1, n_experts, device=DEV.type, dtype=X_DTYPE)
    t_tri = graph_us([partial(router_topk_triton, logits, top_k, True)])
    t_ref = graph_us([partial(router_topk_ref, logits, top_k, True)])
    say(f"router {n_experts} experts top-{top_k}, batch 1: {t_tri:.2f} us (torch ops {t_ref:.2f} us), weights rel RMS {worst:.1e}")
    return ("router", t_tri, t_ref, worst)


def moe_rows(args, base, say, failures):
    n_slots, hid, inter, top_k = MOE
    pool = random_pool(n_slots, hid, inter)
    per_expert = sum(t[0].numel() for t in (pool.w13, pool.w2, pool.w13_scale, pool.w2_scale))
    rows = []
    for batch in (1, 8):
        routes = [torch.stack([torch.randperm(n_slots, device=DEV.type)[:top_k] for _ in range(batch)]) for _ in range(24)]
        x = torch.randn(batch, hid, device=DEV.type, dtype=X_DTYPE)
        wts = torch.softmax(torch.randn(batch, top_k, device=DEV.type), -1).to(X_DTYPE)
        out = torch.empty_like(x)
        ref = moe_over_slots_ref(x, routes[0], wts, pool)
        poisoned = torch.full_like(x, float("nan"))
        err = rel_rms(moe_over_slots_triton(x, routes[0], wts, pool, out=poisoned), ref)
        old = base["moe"].moe_over_slots_triton if base else None
        err_old = rel_rms(old(x, routes[0], wts, pool), ref) if base else None
        if not err < TOL_MOE:
            failures.append(("moe", batch, err))
        t_new = graph_us([partial(moe_over_slots_triton, x, r, wts, pool, out=out) for r in routes])
        t_old = graph_us([partial(old, x, r, wts, pool, out=out) for r in routes]) if base else None
        t_eager = do_bench(partial(moe_over_slots_triton, x, routes[0], wts, pool, out=out), return_mode="median") * 1e3
        best = ("default", t_new)
        if args.sweep:
            for gu in MOE_SWEEP_GATE_UP:
                for dn in MOE_SWEEP_DOWN:
                    fn = partial(moe_over_slots_triton, gate_up_config=gu, down_config=dn)
                    e = rel_rms(fn(x, routes[0], wts, pool), ref)
                    tc = graph_us([partial(fn, x, r, wts, pool, out=out) for r in routes]) if e < TOL_MOE else float("inf")
                    say(f"  sweep moe b{batch} gate_up {gu} down {dn}: {tc:.2f} us err {e:.1e}")
                    if tc < best[1]:
                        best = (f"{gu} {dn}", tc)
        experts = sum(len(torch.unique(r)) for r in routes) / len(routes)
        gbs = experts * per_expert / (t_new * 1e-6) / 1e9
        rows.append((f"per-pair, batch {batch}", experts, t_new, gbs, t_eager, None, err, t_old, err_old, best))
        before = f", before {t_old:.2f} us" if base else ""
        say(f"moe batch {batch}: {t_new:.2f} us ({gbs:.0f} GB/s){before}, eager {t_eager:.1f} us, err {err:.1e}")
    for batch in (MOE_GROUPED_TOKENS if "grouped" in args.only else ()):
        x = torch.randn(batch, hid, device=DEV.type, dtype=X_DTYPE)
        scores = torch.randn(batch, n_slots, device=DEV.type)
        route = torch.topk(scores, top_k, dim=-1).indices
        wts = torch.softmax(torch.randn(batch, top_k, device=DEV.type), -1).to(X_DTYPE)
        out = torch.empty_like(x)
        ref = moe_over_slots_ref(x, route, wts, pool)
        err = rel_rms(moe_over_slots_triton(x, route, wts, pool, out=torch.full_like(x, float("nan")), grouped=True), ref)
        if not err < TOL_MOE:
            failures.append(("moe grouped", batch, err))
        t_grp = do_bench(partial(moe_over_slots_triton, x, route, wts, pool, out=out, grouped=True), return_mode="median") * 1e3
        t_pair = do_bench(partial(moe_over_slots_triton, x, route, wts, pool, out=out, grouped=False), return_mode="median") * 1e3
        best = ("default", t_grp)
        if args.sweep:
            for cfg in GROUPED_SWEEP:
                fn = partial(moe_over_slots_triton, grouped=True, grouped_config=cfg)
                try:
                    e = rel_rms(fn(x, route, wts, pool), ref)
                    tc = do_bench(partial(fn, x, route, wts, pool, out=out), return_mode="median") * 1e3
                except Exception as exc:  # noqa: BLE001
                    say("  sweep grouped failed:", cfg, type(exc).__name__, str(exc)[:120])
                    continue
                say(f"  sweep grouped T{batch} {cfg}: {tc:.1f} us err {e:.1e}")
                if tc < best[1] and e < TOL_MOE:
                    best = (str(cfg), tc)
        experts = len(torch.unique(route))
        rows.append((f"grouped, {batch} tokens", experts, t_grp, experts * per_expert / (t_grp * 1e-6) / 1e9, None, t_pair, err,
                     None, None, best))
        say(f"moe grouped T{batch}: {t_grp:.1f} us vs per-pair {t_pair:.1f} us, err {err:.1e}")
    return rows


def _dry_run_setup() -> None:
    import os
    import time

    global DEV, copies_for, DECODE_SHAPES, PREFILL, MOE, GEMV_SWEEP, DOT_SMALL_SWEEP, DOT_MID_SWEEP, DOT_SWEEP, graph_us, do_bench
    global GEMV_M8_SWEEP, MOE_SWEEP_GATE_UP, MOE_SWEEP_DOWN, GROUPED_SWEEP, MOE_GROUPED_TOKENS, X_DTYPE
    assert os.environ.get("TRITON_INTERPRET") == "1", "--dry-run needs TRITON_INTERPRET=1 (set before triton is imported)"
    os.environ["FT_TRITON_INTERPRET_TEST"] = "1"
    DEV = torch.device("cpu")
    X_DTYPE = torch.float16
    copies_for = lambda *a, **kw: 2  # noqa: E731
    DECODE_SHAPES = [(nm, n // 32, k // 16) for nm, n, k in DECODE_SHAPES[:6:3]]  # (two of the 80B's: the script, not the kernels)
    PREFILL = ("attn_q", 64, 64, 32)
    MOE = (16, 64, 32, 4)
    MOE_GROUPED_TOKENS = (24,)
    GEMV_SWEEP, DOT_SMALL_SWEEP, DOT_SWEEP = GEMV_SWEEP[:1], DOT_SMALL_SWEEP[:1], DOT_SWEEP[:1]
    GEMV_M8_SWEEP = GEMV_M8_SWEEP[:1]
    DOT_MID_SWEEP = DOT_MID_SWEEP[:1]
    MOE_SWEEP_GATE_UP, MOE_SWEEP_DOWN, GROUPED_SWEEP = MOE_SWEEP_GATE_UP[:1], MOE_SWEEP_DOWN[:1], GROUPED_SWEEP[:1]

    def cpu_us(calls, **_):
        t0 = time.perf_counter()
        for fn in calls[:2]:
            fn()
        return (time.perf_counter() - t0) * 1e6 / min(2, len(calls))

    graph_us = cpu_us
    do_bench = lambda fn, **_: cpu_us([fn]) / 1e3  # noqa: E731


def _table(say, header: list[str], rows: list[list[str]]) -> None:
    say("")
    say("| " + " | ".join(header) + " |")
    say("|" + "---|" * len(header))
    for r in rows:
        say("| " + " | ".join(r) + " |")


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def print_tables(say, before: bool, dec, pre, moe, router) -> None:
    """Markdown tables of the rows; the "before" columns (the --baseline-rev kernels) only when `before`."""
    if dec:
        head = ["shape", "N x K", "M", "us", "GB/s", "of 4.3 TB/s"] + (["before us", "after/before"] if before else [])
        rows = [[name, nk, str(m), f"{us:.2f}", f"{gbs:.0f}", f"{frac:.0%}"]
                + ([_f(us_old, ".2f"), "-" if us_old is None else f"{us_old / us:.2f}x"] if before else [])
                + [f"{us_ref:.2f}", f"{us_ref / us:.2f}x", f"{e:.1e}", f"{best[0]} ({best[1]:.2f})"]
                for name, nk, m, us, gbs, frac, us_old, us_ref, e, best in dec]
        _table(say, head + ["torch bf16 us", "vs torch", "rel RMS", "best swept (us)"], rows)
    if pre:
        head = ["prefill GEMM", "N x K", "M", "us", "TFLOP/s"] + (["before us"] if before else [])
        rows = [[name, nk, str(m), f"{us:.1f}", f"{flops / us / 1e6:.0f}"] + ([_f(us_old, ".1f")] if before else [])
                + [f"{us_ref:.1f}", f"{flops / us_ref / 1e6:.0f}", f"{us_ref / us:.2f}", f"{e:.1e}", f"{best[0]} ({best[1]:.1f})"]
                for name, nk, m, us, us_old, us_ref, flops, e, best in pre]
        _table(say, head + ["torch bf16 us", "torch TFLOP/s", "of torch", "rel RMS", "best swept"], rows)
    if moe:
        head = [f"fused MoE, {MOE[3]} of {MOE[0]} experts", "distinct experts", "us", "GB/s", "eager us", "per-pair path us",
                "rel RMS"] + (["before us", "before rel RMS"] if before else [])
        rows = [[name, f"{ex:.1f}", f"{us:.2f}", f"{gbs:.0f}", _f(eager, ".1f"), _f(pair, ".1f"), f"{e:.1e}"]
                + ([_f(us_old, ".2f"), _f(e_old, ".1e")] if before else []) + [f"{best[0]} ({best[1]:.2f})"]
                for name, ex, us, gbs, eager, pair, e, us_old, e_old, best in moe]
        _table(say, head + ["best swept (us)"], rows)
        say("(per-pair rows in CUDA graphs, the before kernels too; grouped rows eager, against the per-pair path eager)")
    if router:
        _table(say, [f"router (softmax, top-k, renormalize), {MOE[0]} experts, top-{MOE[3]}, batch 1", "Triton us",
                     "torch ops us", "weights rel RMS"],
               [["one launch vs the torch reference", f"{router[1]:.2f}", f"{router[2]:.2f}", f"{router[3]:.1e}"]])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time the block configurations in the *_SWEEP lists")
    ap.add_argument("--only", default="decode,prefill,moe,grouped")
    ap.add_argument("--sweep-skip-m1", action="store_true", help="no M = 1 GEMV sweep")
    ap.add_argument("--decode-m", default="1,8", metavar="M[,M...]",
                    help="rows of x of the decode rows (past 16: the tl.dot tile, swept over DOT_MID_SWEEP)")
    ap.add_argument("--decode-shapes", default="", metavar="NAME[,NAME...]", help="only these DECODE_SHAPES")
    ap.add_argument("--log", default=None)
    ap.add_argument("--interleaved", action="store_true",
                    help="M = 8: the 'before' column is the 16-row tl.dot tile without the halves (HALVES off)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, Triton interpreter, shapes / 16, one sweep entry each: checks the script, not the kernels")
    ap.add_argument("--baseline-rev", default=None, metavar="REV",
                    help="git revision whose kernels fill the 'before' columns (omitted without it)")
    ap.add_argument("--baseline-nvfp4", default=None, metavar="PATH",
                    help=f"the NVFP4 kernel module's file in REV (default: the first of {BASELINE_PATHS['nvfp4']} there)")
    ap.add_argument("--baseline-moe", default=None, metavar="PATH",
                    help=f"the MoE kernel module's file in REV (default: the first of {BASELINE_PATHS['moe']} there)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME",
                    help="a named kernel variant in force for the whole run (ft.kernels.options.VARIANTS); repeatable")
    ap.add_argument("--model-defaults", choices=["flash-next"], default=None,
                    help="the kernel options a model chooses in force too (flash-next: its fp16 rows on the tiles)")
    args = ap.parse_args()
    if args.dry_run:
        _dry_run_setup()
    model = {}
    if args.model_defaults == "flash-next":
        from ft.model.qwen3_8_flash_next import FlashNextModel

        model = dict(FlashNextModel.kernel_defaults)
    set_kernel_options(variant(*args.variant, **model))  # (before any launch; unknown names fail here)
    base = None
    if args.baseline_rev:
        base = load_baseline(args.baseline_rev, {"nvfp4": args.baseline_nvfp4, "moe": args.baseline_moe})
    log = open(args.log, "w") if args.log else None  # noqa: SIM115 (open for the whole run)

    def say(*a):
        print(*a, flush=True)
        if log:
            print(*a, file=log, flush=True)

    say(DEV, torch.cuda.get_device_name() if DEV.type == "cuda" else "", torch.__version__, triton.__version__,
        "variants:", args.variant or "none", "model defaults:", args.model_defaults or "none")
    if base:
        say("before:", args.baseline_rev, {name: m.__file__ for name, m in base.items()})
    torch.manual_seed(0)
    failures = []
    only = args.only.split(",")
    dec = decode_rows(args, base, say, failures) if "decode" in only else []
    pre = prefill_rows(args, base, say, failures) if "prefill" in only else []
    moe = moe_rows(args, base, say, failures) if "moe" in only else []
    router = router_row(say, failures) if "moe" in only else None
    print_tables(say, base is not None or args.interleaved, dec, pre, moe, router)
    if failures:
        say("FAILURES:", failures)
        sys.exit(1)
    say(f"all correctness checks passed (rel RMS < {TOL_BF16:g} linear, < {TOL_MOE:g} MoE)")


if __name__ == "__main__":
    main()
