"""Gated DeltaNet prefill kernels at the flagship's shapes: accuracy against the fp32 torch references
and time per layer, for the default configurations and a few alternatives. Not a test.

    PYTHONPATH=. python3 bench/gated_delta_prefill.py [--quick]

Qwen3-Next-80B-A3B's linear attention: Hk 16, Hv 32, Dk = Dv = 128, conv width 4, C = 8192, bf16
activations, fp32 states in a pool of 24 slots. Batches: 4,096 tokens in 3 sequences, 16,384 in one,
16,384 in 16 of 1,024. Times are medians of `triton.testing.do_bench` (ms). The packed conv, the
chunk kernels (prep = UT transform, state = the pass over chunks), and the per-sequence torch
references the model ran before (conv + chunked rule per sequence) for comparison. Prints a table last.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

import ft.kernels.conv1d.kernel as conv_kernel
import ft.kernels.gated_delta.chunk_kernel as chunk_kernel
from ft.kernels.conv1d import causal_conv1d_ref
from ft.kernels.gated_delta import chunk_gated_delta_rule_ref
from ft.kernels.options import use_kernel_options, variant

DEV, DTYPE = "cuda", torch.bfloat16
HK, HV, D, W = 16, 32, 128, 4
C = 2 * HK * D + HV * D
SLOTS = 24
BATCHES = {"4096 in 3": (2, 1535, 2559), "16384 in 1": (16384,), "16384 in 16": (1024,) * 16}


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def inputs(lengths: tuple[int, ...], seed: int = 0) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    t = sum(lengths)
    cu = torch.tensor((0, *lengths), device=DEV).cumsum(0).to(torch.int32)
    slots = torch.randperm(SLOTS, device=DEV, generator=gen)[: len(lengths)]
    mixed = (torch.randn(t, C + 4096, device=DEV, generator=gen) * 2).to(DTYPE)[:, :C]
    y = F.silu(torch.randn(t, C, device=DEV, generator=gen) * 2).to(DTYPE)
    kd = HK * D
    g = -F.softplus(torch.randn(t, HV, device=DEV, generator=gen)) * torch.logspace(-3, 0, HV, device=DEV)
    return {"cu": cu, "slots": slots, "mixed": mixed, "weight": (torch.randn(C, W, device=DEV) * 0.4).to(DTYPE),
            "conv": (torch.randn(SLOTS, C, W - 1, device=DEV) * 2).to(DTYPE),
            "ssm": torch.randn(SLOTS, HV, D, D, device=DEV) * 0.3,
            "q": y[:, :kd].view(t, HK, D), "k": y[:, kd:2 * kd].view(t, HK, D), "v": y[:, 2 * kd:].view(t, HV, D),
            "g": g, "beta": torch.randn(t, HV, device=DEV, generator=gen).to(DTYPE).sigmoid()}


def chunk(x: dict, ssm: torch.Tensor) -> torch.Tensor:
    return chunk_kernel.chunk_gated_delta_rule_varlen_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], ssm, x["cu"],
                                                             x["slots"])


def reference(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 o and states of the chunked reference, per sequence."""
    ssm = x["ssm"].clone()
    o = torch.empty(x["v"].shape, device=DEV)
    cu = x["cu"].tolist()
    for i, slot in enumerate(x["slots"].tolist()):
        sl = slice(cu[i], cu[i + 1])
        o_i, ssm[slot] = chunk_gated_delta_rule_ref(*(x[n][None, sl] for n in ("q", "k", "v", "g", "beta")),
                                                    ssm[slot:slot + 1])
        o[sl] = o_i[0]
    return o, ssm


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def time_chunk(x: dict) -> tuple[float, float]:
    """(prep + state, prep alone) ms: the whole call by `do_bench`, the prep kernel's share of the
    kernels' device time from the profiler over 20 calls."""
    ssm = x["ssm"].clone()
    total = time_ms(lambda: chunk(x, ssm))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            chunk(x, ssm)
        torch.cuda.synchronize()
    kernels = {e.key: e.device_time_total for e in prof.key_averages()}
    prep = sum(t for name, t in kernels.items() if "_chunk_prep_kernel" in name)
    state = sum(t for name, t in kernels.items() if "_chunk_state_kernel" in name)
    return total, total * prep / max(prep + state, 1e-9)


def old_path_ms(x: dict) -> float:
    """The model's prefill before: per sequence, the conv and the chunked rule as torch references."""
    cu, slots = x["cu"].tolist(), x["slots"].tolist()
    conv, ssm = x["conv"].clone(), x["ssm"].clone()

    def run():
        for i, slot in enumerate(slots):
            sl = slice(cu[i], cu[i + 1])
            causal_conv1d_ref(x["mixed"][None, sl], conv[slot:slot + 1], x["weight"])
            chunk_gated_delta_rule_ref(*(x[n][None, sl] for n in ("q", "k", "v", "g", "beta")), ssm[slot:slot + 1])
    return time_ms(run)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="defaults only, no alternative configurations")
    args = ap.parse_args()
    rows = []
    for name, lengths in BATCHES.items():
        x = inputs(lengths)
        o_ref, ssm_ref = reference(x)
        for solve in ("tf32",) if args.quick else ("tf32", "tf32x3", "ieee"):
            with use_kernel_options(variant(**{"gated_delta.solve_precision": solve})):
                ssm = x["ssm"].clone()
                o = chunk(x, ssm)
                err_o, err_s = rel_rms(o, o_ref), rel_rms(ssm[x["slots"]], ssm_ref[x["slots"]])
                total, prep = time_chunk(x)
            rows.append((name, f"chunk, solve {solve}", total, prep, total - prep, err_o, err_s))
            print(rows[-1], flush=True)
        conv = x["conv"].clone()
        with use_kernel_options(variant("conv1d-tiles")):  # the tile kernel (wider windows take it)
            y_tiles = conv_kernel.causal_conv1d_varlen_triton(x["mixed"], x["conv"].clone(), x["weight"], x["cu"],
                                                              x["slots"])
            rows.append((name, "conv tiles", time_ms(lambda: conv_kernel.causal_conv1d_varlen_triton(
                x["mixed"], conv, x["weight"], x["cu"], x["slots"])), 0, 0, 0, 0))
        print(rows[-1], flush=True)
        # the rows kernel (the default): its y against the tiles' (err o column), then its time
        for launch in ((),) if args.quick else ((), (("BLOCK_T", 32),), (("BLOCK_T", 128),), (("BLOCK_C", 512),),
                                                   (("num_stages", 2),), (("num_stages", 4),)):
            with use_kernel_options(variant(**{"conv1d.rows_launch": launch})):
                y_rows = conv_kernel.causal_conv1d_varlen_triton(x["mixed"], x["conv"].clone(), x["weight"], x["cu"],
                                                                x["slots"])
                changed = "".join(f" {k[6:] if k.startswith('BLOCK_') else k} {v}" for k, v in launch)
                label = "conv rows" + (changed or " (default)")
                rows.append((name, label, time_ms(lambda: conv_kernel.causal_conv1d_varlen_triton(
                    x["mixed"], conv, x["weight"], x["cu"], x["slots"])), 0, 0, rel_rms(y_rows, y_tiles), 0))
            print(rows[-1], flush=True)
        if not args.quick:
            for bt, bc, nw in ((16, 128, 8), (16, 64, 4), (32, 64, 4), (64, 64, 8), (32, 256, 8)):
                launch = (("BLOCK_T", bt), ("BLOCK_C", bc), ("num_warps", nw))
                with use_kernel_options(variant("conv1d-tiles", **{"conv1d.varlen_launch": launch})):
                    rows.append((name, f"conv T{bt} C{bc} w{nw}", time_ms(lambda: conv_kernel.causal_conv1d_varlen_triton(
                        x["mixed"], conv, x["weight"], x["cu"], x["slots"])), 0, 0, 0, 0))
                print(rows[-1], flush=True)
            for bv, nw, ns in ((16, 4, 2), (16, 8, 2), (32, 4, 2), (32, 8, 1), (32, 8, 3), (64, 8, 2)):
                launch = (("BLOCK_V", bv), ("num_warps", nw), ("num_stages", ns))
                with use_kernel_options(variant(**{"gated_delta.state_launch": launch})):
                    ssm = x["ssm"].clone()
                    err_o = rel_rms(chunk(x, ssm), o_ref)
                    total, prep = time_chunk(x)
                rows.append((name, f"chunk, state V{bv} w{nw} s{ns}", total, prep, total - prep, err_o, 0))
                print(rows[-1], flush=True)
            for nw, ns in ((4, 2), (8, 1), (8, 3)):
                with use_kernel_options(variant(**{"gated_delta.prep_launch": (("num_warps", nw), ("num_stages", ns))})):
                    total, prep = time_chunk(x)
                rows.append((name, f"chunk, prep w{nw} s{ns}", total, prep, total - prep, 0, 0))
                print(rows[-1], flush=True)
        if name == "4096 in 3":
            rows.append((name, "before: torch references per sequence", old_path_ms(x), 0, 0, 0, 0))
    print(f"\n{'batch':<12} {'variant':<40} {'total ms':>9} {'prep ms':>8} {'state ms':>9} {'o err':>9} {'ssm err':>9}")
    for r in rows:
        print(f"{r[0]:<12} {r[1]:<40} {r[2]:9.4f} {r[3]:8.4f} {r[4]:9.4f} {r[5]:9.2e} {r[6]:9.2e}")


if __name__ == "__main__":
    main()
