"""The paged prefill attention kernel alone: one chunk of queries against a long cached prefix. Not a test.

    PYTHONPATH=. python3 bench/prefill_attention.py [--starts 0,61440,258048] [--chunk 4096]
        [--variants LABELS] [--extra 'LABEL=KIND:JSON'] [--ft-root _before]

The flagship's full-attention layer (16 query heads, 2 KV heads, head dim 256, pages of 64 tokens
in a shuffled order): one prefill chunk of `--chunk` tokens at positions start .. start+chunk-1,
causal over the cached prefix and the chunk itself, as the engine's chunked prefill calls it.
Each variant is a `prefill_config` override (block sizes, warps, stages) over a bf16 or NVFP4
cache; `--ft-root` imports `ft` from another tree (the "before" side of a before/after run in
one process family: run the script twice). Timed eagerly with CUDA events (each call runs for
milliseconds), median of `--repeat`. TFLOP/s counts the causal work only: 4 * D * Hq flops per
(query, visible key) pair. At start 0, torch's scaled_dot_product_attention (flash) on contiguous
K/V with the heads expanded is the reference ceiling. Prints each variant's difference from the
first variant of its cache kind. Table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

VARIANTS = [  # (label, cache kind, config overrides)
    ("default", "bf16", {}),  # the library's choice (since 2026-12-01: causal split + lazy maxima)
    ("one loop", "bf16", {"CAUSAL_SPLIT": False, "LAZY_RESCALE": False, "NVFP4_F16": False}),
    ("one loop w4 M8 N64", "bf16", {"CAUSAL_SPLIT": False, "LAZY_RESCALE": False, "num_warps": 4, "BLOCK_M": 8,
                                    "BLOCK_N": 64}),
    ("nvfp4 default", "nvfp4", {}),  # causal split + fp16 dots
    ("nvfp4 one loop", "nvfp4", {"CAUSAL_SPLIT": False, "LAZY_RESCALE": False, "NVFP4_F16": False}),
    ("causal split", "bf16", {"CAUSAL_SPLIT": True, "LAZY_RESCALE": False, "NVFP4_F16": False}),
    ("nvfp4 causal split", "nvfp4", {"CAUSAL_SPLIT": True, "LAZY_RESCALE": False, "NVFP4_F16": False}),
    ("causal split lazy", "bf16", {"CAUSAL_SPLIT": True, "LAZY_RESCALE": True}),
    ("causal split lazy N32", "bf16", {"CAUSAL_SPLIT": True, "LAZY_RESCALE": True, "BLOCK_N": 32}),
    ("causal split lazy s3", "bf16", {"CAUSAL_SPLIT": True, "LAZY_RESCALE": True, "num_stages": 3}),
    ("nvfp4 causal split lazy", "nvfp4", {"CAUSAL_SPLIT": True, "LAZY_RESCALE": True, "NVFP4_F16": False}),
    # fp16 dots over tiles decoded in fp16 a word at a time (session 12, static SASS only: the main loop
    # 1,754 -> 1,118 instructions per 64 keys, 88 bytes of spills; 681 per 32 keys and no spill at N 32)
    ("nvfp4 split f16", "nvfp4", {"CAUSAL_SPLIT": True, "NVFP4_F16": True, "LAZY_RESCALE": False}),
    ("nvfp4 split f16 lazy", "nvfp4", {"CAUSAL_SPLIT": True, "NVFP4_F16": True, "LAZY_RESCALE": True}),
    ("nvfp4 split f16 N32", "nvfp4", {"CAUSAL_SPLIT": True, "NVFP4_F16": True, "BLOCK_N": 32, "LAZY_RESCALE": False}),
    ("nvfp4 split f16 N32 lazy", "nvfp4", {"CAUSAL_SPLIT": True, "NVFP4_F16": True, "BLOCK_N": 32, "LAZY_RESCALE": True}),
    # ft.kernels.attention.library_prefill: cuDNN over the prefix in segments (keys), merged by log-sum-exp
    ("cudnn prefix", "library", {}),  # the dispatcher's granule and segment (LIBRARY_*)
    ("cudnn prefix seg 32K", "library", {"segment_keys": 32768}),
    ("cudnn prefix seg 128K", "library", {"segment_keys": 131072}),
    ("cudnn prefix one segment", "library", {"segment_keys": 1 << 30}),
    ("cudnn prefix granule 8K", "library", {"granule": 8192}),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", default="0,61440,258048", help="cached prefix lengths before the chunk")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--hq", type=int, default=16)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variants", default=None, help="comma-separated labels (default: all)")
    ap.add_argument("--extra", action="append", default=[], metavar="LABEL=KIND:JSON",
                    help='another variant, e.g. \'w8 N16=bf16:{"num_warps": 8, "BLOCK_N": 16}\'')
    ap.add_argument("--ft-root", default=None, help="import ft from this tree instead of this checkout's")
    ap.add_argument("--label", default="", help="a prefix for every row (e.g. before / after)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 at small shapes")
    args = ap.parse_args()
    if args.ft_root and not (Path(args.ft_root) / "ft").is_dir():  # else `import ft` would find this checkout's
        ap.error(f"--ft-root {args.ft_root}: no ft package there (on the device: name it in carry)")
    sys.path.insert(0, str(Path(args.ft_root).resolve() if args.ft_root else Path(__file__).resolve().parent.parent))
    import torch

    from ft.kernels.attention.prefill_kernel import paged_prefill_attention_triton
    from ft.kernels.attention.reference import NVFP4_CACHE, quantize_kv

    variants = list(VARIANTS)
    for spec in args.extra:
        label, _, rest = spec.partition("=")
        kind, _, cfg = rest.partition(":")
        variants.append((label, kind, json.loads(cfg or "{}")))
    wanted = set(args.variants.split(",")) | {s.partition("=")[0] for s in args.extra} if args.variants else None
    variants = [v for v in variants if not wanted or v[0] in wanted]
    dev = torch.device(args.device)
    t, hq, hkv, d, page = args.chunk, args.hq, args.hkv, args.head_dim, args.page
    scale = d ** -0.5

    first_ms: list[float] = []

    def time_ms(fn) -> float:
        if dev.type != "cuda":  # smoke run: one call, wall clock
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        first_ms.append((time.perf_counter() - t0) * 1e3)  # a new shape's first call (compile, library plans)
        times = []
        for _ in range(args.repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    rows = []
    for start in (int(s) for s in args.starts.split(",")):
        n = start + t
        gen = torch.Generator(device=dev).manual_seed(n)
        pages = -(-n // page)
        table = torch.randperm(pages, device=dev, generator=gen)
        kv = torch.randn(pages, 2, page, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
        q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
        kv_scale = torch.tensor([0.02, 0.02], device=dev)
        caches = {"bf16": kv, "library": kv}
        if any(kind == "nvfp4" for _, kind, _ in variants):
            caches["nvfp4"] = torch.stack([quantize_kv(kv[:, i].float(), kv_scale[i], NVFP4_CACHE) for i in (0, 1)], 1)
        pairs = t * start + t * (t + 1) // 2
        flops = 4.0 * pairs * d * hq
        first: dict[str, torch.Tensor] = {}
        for label, kind, cfg in variants:
            cache = caches[kind]
            kvs = kv_scale if kind == "nvfp4" else None

            def call(_c=cache, _cfg=cfg, _kvs=kvs, _kind=kind):
                if _kind == "library":
                    from ft.kernels.attention import LIBRARY_GRANULE_KEYS, library_segment_keys
                    from ft.kernels.attention.library_prefill import library_prefill_attention

                    seg = _cfg.get("segment_keys") or library_segment_keys(_c[:, 0])
                    return library_prefill_attention(q, _c[:, 0], _c[:, 1], table, start, scale, segment_keys=seg,
                                                     granule=_cfg.get("granule", LIBRARY_GRANULE_KEYS))
                return paged_prefill_attention_triton(q, _c[:, 0], _c[:, 1], table, start, scale, _kvs, config=_cfg)

            try:
                ms = time_ms(call)
            except Exception as exc:  # noqa: BLE001 (a tile the compiler rejects is a row, not the end)
                print(f"start {start}: {label}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            out = call().float()
            ref = first.setdefault("bf16" if kind == "library" else kind, out)
            err = ((out - ref).norm() / ref.norm()).item()
            rows.append((start, label, ms, flops / ms / 1e9, err))
            print(f"start {start}: {label}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, vs first {err:.1e} "
                  f"(first call {first_ms[-1] if first_ms else float('nan'):.1f} ms)", flush=True)
        if start == 0 and dev.type == "cuda":
            qs = q.transpose(0, 1)[None]  # [1, Hq, T, D]
            # contiguous K/V in position order: gather each position's row from its page
            pos = torch.arange(n, device=dev)
            ks = kv[table[pos // page], 0, pos % page].transpose(0, 1).repeat_interleave(hq // hkv, 0)[None]
            vs = kv[table[pos // page], 1, pos % page].transpose(0, 1).repeat_interleave(hq // hkv, 0)[None]
            from torch.nn.attention import SDPBackend, sdpa_kernel
            try:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    sd = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)  # noqa: E731
                    ms = time_ms(sd)
                    err = ((sd()[0].transpose(0, 1).float() - first["bf16"]).norm() / first["bf16"].norm()).item() \
                        if "bf16" in first else float("nan")
                rows.append((start, "torch sdpa flash (contiguous)", ms, flops / ms / 1e9, err))
                print(f"start 0: torch sdpa flash: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, vs first {err:.1e}",
                      flush=True)
            except RuntimeError as exc:
                print(f"start 0: torch sdpa flash: failed: {str(exc)[:200]}", flush=True)
            del qs, ks, vs
        del kv, caches, first
        torch.cuda.empty_cache()
    print(f"\n{args.label + ': ' if args.label else ''}chunk {t} tokens, {hq} q heads, {hkv} kv heads, head dim {d}, "
          f"page {page}: one layer's prefill attention")
    print("| prefix (start) | variant | ms | TFLOP/s (causal) | rel diff vs first of its cache |")
    print("|---|---|---|---|---|")
    for start, label, ms, tf, err in rows:
        print(f"| {start:,} | {args.label + ' ' if args.label else ''}{label} | {ms:.3f} | {tf:.0f} | {err:.1e} |")


if __name__ == "__main__":
    main()
