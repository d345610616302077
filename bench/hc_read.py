"""A HyperConnection read's low-rank projections and gated mean at decode sizes: cuBLAS against the
Triton forms. Not a test.

    PYTHONPATH=. python3 bench/hc_read.py [--tokens 1,2,4,8,16] [--forms cublas,dot,fma]

Qwen3.8-Flash-Next's shape (4 streams of 2,560, rank 320, bf16): per read, N mix_in^T ([T, 10,240] by
[324, 10,240]), SiLU, by up ([10,240, 320]) and the gated mean over the streams. cublas: the model's
torch GEMMs (`hc_read_lowrank_ref`: addmm with 1 / C in alpha, F.linear) then `hc_mix_triton` (the
path above `READ_MAX_TOKENS`); dot / fma: `hc_read_triton`'s forms (`READ_FORMS`). Each call reads
its own copy of the weights (`bench.gpu_timing.copies_for`: several times the L2, as the 97 reads of
a decode step do), timed as a replayed CUDA graph (`graph_us`); the per-kernel split from the
profiler. Prints a table last: us per read and the weights' bytes over that time.
"""

from __future__ import annotations

import argparse

import torch

from bench.gpu_timing import copies_for, graph_us, kernel_us, rel_rms
from ft.kernels.hyper_connection import hc_read_lowrank_ref, hc_read_ref
from ft.kernels.hyper_connection.kernel import READ_FORMS, hc_mix_triton, hc_read_triton

C, D, RANK = 4, 2560, 320


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--forms", default="cublas," + ",".join(READ_FORMS))
    args = ap.parse_args()
    dev = "cuda"
    width = C * D
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=dev) * scale).to(torch.bfloat16)  # noqa: E731
    weight_bytes = ((RANK + C) * width + width * RANK) * 2
    copies = copies_for(weight_bytes)
    weights = [(r(RANK + C, width, scale=0.02), r(width, RANK, scale=0.05)) for _ in range(copies)]
    rows = []
    for t in [int(x) for x in args.tokens.split(",")]:
        n = r(t, width)
        want, want_gate = hc_read_ref(n.float(), weights[0][0].float(), weights[0][1].float(), RANK, C)
        for form in args.forms.split(","):
            if form == "cublas":
                def read(mi, up):
                    gl, gate = hc_read_lowrank_ref(n, mi, up, RANK, C)
                    return hc_mix_triton(gl, n, C), gate
            else:
                def read(mi, up, form=form):
                    return hc_read_triton(n, mi, up, RANK, C, form)
            u, gate = read(*weights[0])
            err = max(rel_rms(u, want), rel_rms(gate, want_gate))
            calls = [lambda w=w: read(*w) for w in weights]
            us = graph_us(calls)
            split = kernel_us(calls[:32])
            rows.append((t, form, us, weight_bytes / us / 1e3, err, split))
            print(f"T {t} {form}: {us:.2f} us a read, {weight_bytes / us / 1e3:.0f} GB/s, error {err:.2e}; {split}",
                  flush=True)
    print(f"\nweights {weight_bytes / 1e6:.1f} MB a read, {copies} copies\n")
    print("| tokens | form | us a read | GB/s | relative RMS vs fp32 |")
    print("|---|---|---|---|---|")
    for t, form, us, gbs, err, _ in rows:
        print(f"| {t} | {form} | {us:.2f} | {gbs:.0f} | {err:.1e} |")


if __name__ == "__main__":
    main()
