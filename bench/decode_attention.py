"""The paged decode attention kernel alone, at long contexts: bf16 against NVFP4 KV caches. Not a test.

    PYTHONPATH=. python3 bench/decode_attention.py [--contexts 4096,32768,131072] [--batch 1]

The flagship's full-attention layer (16 query heads, 2 KV heads, head dim 256, the engine's page
of 64 tokens, pages in a shuffled order): one decode step's attention of one layer, the split
count the engine uses for that context (`decode_split_count`), timed as CUDA-graph replays
over enough layer copies that every call reads HBM (`bench/gpu_timing.py`). Variants: the bf16
cache; the NVFP4 cache with whole dequantized tiles (`tiles`) and with q's even and odd columns
against the low and high nibbles (`halves`), fp16 dots over tiles decoded in fp16 a word at a time
(`f16`, the default 2026-12-01), the halves decoded straight to fp16 by byte permutes in inline
PTX (`prmt`, the default since 2026-12-02), each at a few block sizes; `--extra` adds
variants (any `decode_config` key, and "splits" to override the split count). (The CUDA-core loop over
32-bit words, `NVFP4_FMA`, whose spills were 2 KB and whose first run did not finish, was deleted in
session 23.) Prints us per call, the
KV bytes read per second, and each NVFP4 variant's difference from the reference. Table last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_timing import copies_for, graph_us, kernel_us, rel_rms  # noqa: E402
from ft.kernels.attention import paged_decode_attention_ref  # noqa: E402
from ft.kernels.attention.kernel import paged_decode_attention_triton  # noqa: E402
from ft.kernels.attention.decode_tuning import decode_split_count  # noqa: E402
from ft.kernels.options import kernel_options  # noqa: E402
from ft.kernels.attention.reference import NVFP4_CACHE, quantize_kv  # noqa: E402
from ft.kernels.attention.split import decode_attention_workspace  # noqa: E402

VARIANTS = [  # (label, cache, config overrides)
    ("bf16", "bf16", {}),
    ("nvfp4 default", "nvfp4", {}),  # since 2026-12-02: the halves decoded by byte permutes (NVFP4_PRMT), 64 keys, 3 stages
    # the split-K combine with one program per head (before session 14: the combine's columns apart)
    ("bf16 combine whole head", "bf16", {"COMBINE_BLOCK_D": 256}),
    ("nvfp4 combine whole head", "nvfp4", {"COMBINE_BLOCK_D": 256}),
    ("nvfp4 tiles", "nvfp4", {"NVFP4_PRMT": False, "NVFP4_HALVES": False, "NVFP4_F16": False}),
    ("nvfp4 tiles N64", "nvfp4", {"NVFP4_PRMT": False, "NVFP4_HALVES": False, "NVFP4_F16": False, "BLOCK_N": 64}),
    ("nvfp4 halves", "nvfp4", {"NVFP4_PRMT": False, "NVFP4_HALVES": True, "NVFP4_F16": False}),
    ("nvfp4 halves N64", "nvfp4", {"NVFP4_PRMT": False, "NVFP4_HALVES": True, "NVFP4_F16": False, "BLOCK_N": 64}),
    # fp16 dots over tiles decoded in fp16 a word at a time (session 12; static SASS: the loop 1,765 -> 1,025
    # instructions per 32 tokens against the halves; not measured yet)
    ("nvfp4 f16", "nvfp4", {"NVFP4_PRMT": False, "NVFP4_F16": True, "BLOCK_N": 32}),
    ("nvfp4 f16 N64", "nvfp4", {"NVFP4_PRMT": False, "NVFP4_F16": True, "BLOCK_N": 64}),
    # the halves decoded straight to fp16 by byte permutes in inline PTX (session 15)
    ("nvfp4 prmt N32", "nvfp4", {"NVFP4_PRMT": True, "BLOCK_N": 32}),
    ("nvfp4 prmt N64", "nvfp4", {"NVFP4_PRMT": True, "BLOCK_N": 64}),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hq", type=int, default=16)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--variants", default=None, help="comma-separated labels (default: all)")
    ap.add_argument("--extra", action="append", default=[], metavar="LABEL=KIND:JSON",
                    help='another variant, e.g. \'halves w8=nvfp4:{"NVFP4_HALVES": true, "num_warps": 8}\'')
    ap.add_argument("--profile", action="store_true",
                    help="also each variant's GPU time per kernel (torch.profiler over graph replays)")
    args = ap.parse_args()
    for spec in args.extra:
        label, _, rest = spec.partition("=")
        kind, _, cfg = rest.partition(":")
        VARIANTS.append((label, kind, json.loads(cfg or "{}")))
    dev = torch.device("cuda")
    b, hq, hkv, d, page = args.batch, args.hq, args.hkv, args.head_dim, args.page
    wanted = set(args.variants.split(",")) | {s.partition("=")[0] for s in args.extra} if args.variants else None
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        gen = torch.Generator(device=dev).manual_seed(ctx)
        pages_per_seq = -(-ctx // page)
        n_pages = b * pages_per_seq
        table = torch.randperm(n_pages, device=dev, generator=gen).view(b, pages_per_seq)
        lens = torch.full((b,), ctx, dtype=torch.int64, device=dev)
        q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
        kv = torch.randn(n_pages, 2, page, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
        scale = torch.tensor([0.02, 0.02], device=dev)  # K and V layer scales: amax 6 * 448 * 0.02 covers randn
        kv4 = torch.stack([quantize_kv(kv[:, i].float(), scale[i], NVFP4_CACHE) for i in (0, 1)], dim=1)
        caches = {"bf16": kv, "nvfp4": kv4}
        ref = paged_decode_attention_ref(q.float(), kv4[:, 0], kv4[:, 1], table, lens, d ** -0.5, kv_scale=scale)
        for label, kind, cfg in VARIANTS:
            if wanted and label not in wanted:
                continue
            cfg = dict(cfg)
            prmt = kind == "nvfp4" and cfg.get("NVFP4_PRMT", kernel_options().decode_attention.nvfp4_prmt)
            splits = cfg.pop("splits", None) or decode_split_count(b, hkv, ctx, dev, prmt)  # "splits": an override
            ws = decode_attention_workspace(b, hq, d, splits, dev)
            cache = caches[kind]
            nbytes = cache.numel() * cache.element_size()
            copies = [cache] + [cache.clone() for _ in range(copies_for(nbytes) - 1)]
            out = torch.empty_like(q)
            kvs = scale if kind == "nvfp4" else None

            def call(c, _cfg=cfg, _kvs=kvs, _out=out, _splits=splits, _ws=ws):
                return lambda: paged_decode_attention_triton(q, c[:, 0], c[:, 1], table, lens, d ** -0.5,
                                                             splits=_splits, workspace=_ws, out=_out, config=_cfg,
                                                             kv_scale=_kvs)

            us = graph_us([call(c) for c in copies])
            if args.profile:
                print(f"context {ctx}: {label}: {kernel_us([call(c) for c in copies])}", flush=True)
            call(cache)()
            err = rel_rms(out.float(), ref) if kind == "nvfp4" else float("nan")
            rows.append((ctx, label, splits, us, nbytes / us / 1e3, err))
            print(f"context {ctx}: {label}: {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s, rel rms {err:.2e}", flush=True)
            del copies
        del kv, kv4, caches
        torch.cuda.empty_cache()
    print(f"\nbatch {b}, {hq} q heads, {hkv} kv heads, head dim {d}, page {page}: one layer's decode attention")
    print("| context | variant | splits | us | KV GB/s | rel RMS vs reference |")
    print("|---|---|---|---|---|---|")
    for ctx, label, splits, us, gbs, err in rows:
        print(f"| {ctx:,} | {label} | {splits} | {us:.1f} | {gbs:.0f} | {err:.1e} |")


if __name__ == "__main__":
    main()
