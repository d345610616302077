"""Qwen3.8-Flash-Next's PLE layer over a prefill chunk: its time and the memory it takes beside its inputs, in the
Triton form (`ft.kernels.engram.ple_prefill`, its key/value GEMM included; the engine's with variant
ple-prefill-triton) and in the model's torch form (`ft.model.layers.engram.ple_delta_batched`, the engine's
default) in token chunks of the default size or unchunked.
Not a test.

    PYTHONPATH=. python3 bench/ple_prefill.py [--tokens 4096,16384] [--forms triton,default,whole] [--repeat 5]

The released model's geometry (4 HyperConnection streams of 2,560, an embedding of 16 x 160, a 4-tap conv at
dilation 3), bf16, one sequence with an empty history, random weights (the layer's cost does not depend on
them). `--forms`: "triton", or the torch form's chunks: "default" (`ple_chunk_tokens`), "whole" (one chunk: the
form before chunks) or a token count.
Prints the median ms of `--repeat` calls after a warm one, and the caching allocator's peak over the inputs
(MiB, `torch.cuda.max_memory_allocated` less what was allocated before the call). Table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.nn.functional as F  # noqa: E402

from ft.kernels.engram import ple_prefill  # noqa: E402
from ft.model.layers.engram import PLEWeights, ple_chunk_tokens, ple_delta_batched  # noqa: E402


def _mib(peak: float | None) -> str:
    return "-" if peak is None else f"{peak:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--forms", default="triton,default,whole")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt, c, d, e, k = torch.bfloat16, 4, 2560, 2560, 4
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(dt)

    w = PLEWeights(key_proj=rand(c * d, e, scale=0.02), value_proj=rand(d, e, scale=0.02), norm_key=rand(c * d, scale=0.1),
                   norm_query=rand(c * d, scale=0.1), norm_conv=rand(c * d, scale=0.1), conv=rand(c * d, k, scale=0.3),
                   streams=c)
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        emb, streams = rand(t, e), rand(t, c, d)
        hist = torch.zeros(1, w.history, c * d, dtype=dt, device=dev)
        cu = torch.tensor([0, t], device=dev)
        key_value = torch.cat([w.key_proj, w.value_proj])
        for name in args.forms.split(","):
            chunk = t if name == "triton" else {"default": ple_chunk_tokens(c, d), "whole": t}.get(name) or int(name)

            def form():
                if name == "triton":
                    return ple_prefill(streams.reshape(t, c * d), F.linear(emb, key_value), hist, cu, w.norm_key,
                                       w.norm_query, w.norm_conv, w.conv, c, w.dilation, w.eps)
                return ple_delta_batched(emb, streams, w, hist, cu, chunk_tokens=chunk)

            form()  # warm (allocator, kernels)
            times, peak = [], None  # (MiB; the CPU has no allocator's peak)
            for _ in range(args.repeat):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    out = form()
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end))
                    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                else:
                    import time
                    t0 = time.perf_counter()
                    out = form()
                    times.append((time.perf_counter() - t0) * 1e3)
                del out
            rows.append((t, name, min(chunk, t), statistics.median(times), peak))
            print(f"{t} tokens, {name} ({min(chunk, t)}): {rows[-1][3]:.3f} ms, peak {_mib(peak)} MiB", flush=True)
    print(f"\n{'tokens':>7} {'form':>8} {'chunk':>6} {'ms':>9} {'peak MiB':>9} {'KiB/token':>9}")
    for t, name, chunk, ms, peak in rows:
        per_token = "-" if peak is None else f"{peak * 1024 / t:.1f}"
        print(f"{t:>7} {name:>8} {chunk:>6} {ms:>9.3f} {_mib(peak):>9} {per_token:>9}")


if __name__ == "__main__":
    main()
