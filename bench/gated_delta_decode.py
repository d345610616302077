"""Gated DeltaNet's decode step (`gated_delta_decode_triton`: the conv launch, then the recurrent kernel) at the
models' shapes: us a layer per kernel in a CUDA graph, the recurrent kernel's state traffic against the copy
ceiling, and with --sweep its launch choices (`GatedDeltaOptions.decode_launch`: BLOCK_V x warps). Not a test.

    PYTHONPATH=. python3 bench/gated_delta_decode.py [--batches 1,8] [--models flash-next,80b] [--sweep]

Shapes: Qwen3-Next-80B (Hk 16, Hv 32) and Qwen3.8-Flash-Next (Hk 16, Hv 48), Dk = Dv = 128, conv width 4,
bf16 activations, fp32 states. Each call of a graph reads its own copy of the state pool (the copies span
several times L2, as a step's 36 layers do), so the state comes from HBM. Every configuration's output and
new state are checked against the torch reference first. Prints a table last.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from bench.gpu_timing import COPY_CEILING_GBS, copies_for, graph_us, kernel_us, rel_rms
from ft.kernels.gated_delta import gated_delta_decode_ref
from ft.kernels.gated_delta.kernel import delta_config, gated_delta_decode_triton
from ft.kernels.options import use_kernel_options, variant

DEV, DTYPE = "cuda", torch.bfloat16
MODELS = {"80b": (16, 32), "flash-next": (16, 48)}  # (Hk, Hv); Dk = Dv = D
D, W = 128, 4
TOL = 2e-2  # o is rounded to bf16 (~4e-3 typical); the state stays fp32 (~1e-6)


def layer(hk: int, hv: int, batch: int, gen: torch.Generator) -> dict:
    """One layer's decode inputs for `batch` sequences in slots 0..batch-1 of a pool of `batch` slots."""
    c = 2 * hk * D + hv * D
    return {"mixed": (torch.randn(batch, c, device=DEV, generator=gen) * 2).to(DTYPE),
            "b": torch.randn(batch, hv, device=DEV, generator=gen).to(DTYPE),
            "a": torch.randn(batch, hv, device=DEV, generator=gen).to(DTYPE),
            "conv": (torch.randn(batch, c, W - 1, device=DEV, generator=gen) * 2).to(DTYPE),
            "ssm": torch.randn(batch, hv, D, D, device=DEV, generator=gen) * 0.3,
            "weight": (torch.randn(c, W, device=DEV, generator=gen) * 0.4).to(DTYPE),
            "a_log": torch.randn(hv, device=DEV, generator=gen) * 0.5,
            "dt_bias": torch.randn(hv, device=DEV, generator=gen) * 0.5,
            "slots": torch.arange(batch, device=DEV, dtype=torch.int32)}


def step(x: dict, conv: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
    return gated_delta_decode_triton(x["mixed"], x["b"], x["a"], conv, ssm, x["weight"], x["a_log"], x["dt_bias"],
                                     x["slots"])


def check(x: dict) -> float:
    """rel RMS of o and of the new state against the reference (each from the same starting states)."""
    conv, ssm = x["conv"].clone(), x["ssm"].clone()
    got = step(x, conv, ssm)
    conv_r, ssm_r = x["conv"].clone(), x["ssm"].clone()
    want = gated_delta_decode_ref(x["mixed"], x["b"], x["a"], conv_r, ssm_r, x["weight"], x["a_log"], x["dt_bias"],
                                  x["slots"])
    return max(rel_rms(got, want), rel_rms(ssm, ssm_r))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--models", default="flash-next,80b")
    ap.add_argument("--sweep", action="store_true", help="also time BLOCK_V in 16..128 x 1..8 warps")
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows, failures = [], []
    for name in args.models.split(","):
        hk, hv = MODELS[name]
        for batch in (int(b) for b in args.batches.split(",")):
            x = layer(hk, hv, batch, gen)
            state_bytes = x["ssm"].numel() * 4
            copies = copies_for(state_bytes)
            pools = [(x["conv"].clone(), x["ssm"].clone()) for _ in range(copies)]
            calls = [lambda c=c, s=s: step(x, c, s) for c, s in pools]
            rule = delta_config(batch, hv, D, D)
            tiles = [()]
            if args.sweep:
                tiles += [(("BLOCK_V", bv), ("num_warps", nw)) for bv, nw in itertools.product((16, 32, 64, 128),
                                                                                             (1, 2, 4, 8))
                          if (bv, nw) != (rule["BLOCK_V"], rule["num_warps"])]
            for tile in tiles:
                with use_kernel_options(variant(**{"gated_delta.decode_launch": tile})):
                    try:
                        err = check(x)
                    except Exception as exc:  # noqa: BLE001 (a tile the compiler or the GPU refuses)
                        print(f"{name} B{batch} {dict(tile)}: refused ({type(exc).__name__}: {str(exc)[:100]})")
                        continue
                    if not err < TOL:
                        failures.append((name, batch, tile, err))
                        continue
                    us = graph_us(calls)
                    split = kernel_us(calls[:4])
                label = dict(tile) or {"BLOCK_V": rule["BLOCK_V"], "num_warps": rule["num_warps"], "rule": True}
                # the recurrent kernel reads and writes the state once
                gbs = 2 * state_bytes / (us * 1e-6) / 1e9
                rows.append((name, batch, label, us, gbs, err, split))
                print(f"{name} B{batch} {label}: {us:.2f} us a layer ({split}), err {err:.1e}", flush=True)
    print(f"\nGated DeltaNet decode, a layer (conv + recurrent kernels), bf16, fp32 states, D {D}; "
          f"state GB/s counts its read and write over the whole layer's time")
    print(f"{'model':<11} {'B':>3} {'BLOCK_V':>7} {'warps':>5} {'us':>8} {'state GB/s':>10} {'of copy':>8} {'err':>8}")
    best: dict[tuple[str, int], tuple] = {}
    for name, batch, label, us, gbs, err, _ in rows:
        mark = " (rule)" if label.get("rule") else ""
        print(f"{name:<11} {batch:>3} {label['BLOCK_V']:>7} {label['num_warps']:>5} {us:>8.2f} {gbs:>10.0f} "
              f"{gbs / COPY_CEILING_GBS:>8.1%} {err:>8.1e}{mark}")
        if (name, batch) not in best or us < best[(name, batch)][0]:
            best[(name, batch)] = (us, label)
    for (name, batch), (us, label) in best.items():
        print(f"best {name} B{batch}: {label} {us:.2f} us")
    if failures:
        raise SystemExit(f"configurations off the reference: {failures}")


if __name__ == "__main__":
    main()
