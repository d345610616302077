"""Library attention backends against ft's paged prefill kernel, at long cached prefixes. Not a test.

    PYTHONPATH=. python3 bench/attention_backends.py [--starts 61440,258048] [--chunk 4096]

The question: would a library kernel (torch SDPA's cuDNN, flash or memory-efficient backends) run
the bulk of a long chunked prefill's attention (a chunk of queries against the cached prefix: no
mask) faster than `paged_prefill_attention_triton`? The library kernels take contiguous K/V, so
each row also times the gather of the prefix out of the paged cache. The flagship's full-attention
layer: 16 query heads, 2 KV heads, head dim 256, bf16. TFLOP/s count the prefix part only
(4 * T * start * D * Hq); ft's row is the whole chunk (prefix and the causal diagonal) over its
own FLOPs. Rows that a backend refuses print the reason. Table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ft.kernels.attention.prefill_kernel import paged_prefill_attention_triton  # noqa: E402


def time_ms(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", default="61440,258048")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    dev = torch.device("cuda")
    t, hq, hkv, d, page = args.chunk, 16, 2, 256, 64
    scale = d ** -0.5
    rows = []
    for start in (int(s) for s in args.starts.split(",")):
        n = start + t
        gen = torch.Generator(device=dev).manual_seed(n)
        pages = -(-n // page)
        table = torch.randperm(pages, device=dev, generator=gen)
        kv = torch.randn(pages, 2, page, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
        q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
        full = 4.0 * (t * start + t * (t + 1) // 2) * d * hq
        prefix = 4.0 * t * start * d * hq
        ms = time_ms(lambda: paged_prefill_attention_triton(q, kv[:, 0], kv[:, 1], table, start, scale), args.repeat)
        rows.append((start, "ft paged prefill (whole chunk)", ms, full / ms / 1e9))
        pos = torch.arange(start, device=dev)

        def gather():  # [1, Hkv, start, D] each, in position order
            k = kv[table[pos // page], 0, pos % page].permute(1, 0, 2)[None]
            v = kv[table[pos // page], 1, pos % page].permute(1, 0, 2)[None]
            return k, v

        ms = time_ms(gather, args.repeat)
        rows.append((start, "gather the prefix (K and V)", ms, float("nan")))
        k, v = gather()
        qs = q.permute(1, 0, 2)[None]  # [1, Hq, T, D]
        ref = None
        for label, backend, gqa in (("cudnn, enable_gqa", SDPBackend.CUDNN_ATTENTION, True),
                                    ("cudnn, K/V expanded", SDPBackend.CUDNN_ATTENTION, False),
                                    ("flash, K/V expanded", SDPBackend.FLASH_ATTENTION, False),
                                    ("flash, enable_gqa", SDPBackend.FLASH_ATTENTION, True),
                                    ("efficient, K/V expanded", SDPBackend.EFFICIENT_ATTENTION, False)):
            ke, ve = (k, v) if gqa else (k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1))

            def call(_k=ke, _v=ve, _b=backend, _g=gqa):
                with sdpa_kernel(_b):
                    return sdpa(qs, _k, _v, scale=scale, enable_gqa=_g)

            try:
                ms = time_ms(call, args.repeat)
                out = call().float()
            except Exception as exc:  # noqa: BLE001 (a refused backend is a row, not the end)
                print(f"start {start}: {label}: refused: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            ref = out if ref is None else ref
            err = ((out - ref).norm() / ref.norm()).item()
            rows.append((start, f"{label} (prefix only), vs first {err:.1e}", ms, prefix / ms / 1e9))
            print(f"start {start}: {label}: {ms:.3f} ms {prefix / ms / 1e9:.0f} TFLOP/s", flush=True)
        try:  # the log-sum-exp a merge with the diagonal's part would need
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(qs, k.repeat_interleave(hq // hkv, 1),
                                                                     v.repeat_interleave(hq // hkv, 1), None, True,
                                                                     0.0, False, False, scale=scale)
            print(f"start {start}: cudnn op with log-sum-exp: {[tuple(o.shape) for o in out[:2]]}", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"start {start}: cudnn op with log-sum-exp: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        kv = k = v = None  # free before the next prefix's tensors
        torch.cuda.empty_cache()
    print(f"\nchunk {t} queries, {hq} q heads, {hkv} kv heads, head dim {d}, bf16; torch {torch.__version__}, "
          f"cudnn {torch.backends.cudnn.version()}")
    print("| prefix | what | ms | TFLOP/s |\n|---|---|---|---|")
    for start, label, ms, tf in rows:
        print(f"| {start:,} | {label} | {ms:.3f} | {tf:.0f} |")


if __name__ == "__main__":
    main()
