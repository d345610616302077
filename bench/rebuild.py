"""The seeds' rebuild scenario on the flagship geometry, on the GPU. Not a test.

    python bench/rebuild.py [--config bench/configs/qwen3-next-80b-a3b.json]

Synthetic NVFP4 weights for Qwen3-Next-80B-A3B generated on the device (nothing downloaded),
a 16 GiB card emulated with --gpu-memory-limit, the seed's boot geometry (moe 512 slots, kv
262144 tokens in bf16 — FreeToken has no NVFP4 KV cache yet —, mamba 8) and a cache budget
that this geometry nearly fills, so that growing the MoE pool before the KV pool shrinks would
not fit. Runs the seed's two resizes, back to the boot geometry, and both again (warm), then
generates a few tokens. For each rebuild: end-to-end time, the plan's peak, the pools' peak
physical bytes (mapped chunks, sampled after every step), the device's peak use over its use
outside the pools, and whether the pools stay within the plan's peak (the planner counts the
allocator's 2 MiB chunks per tensor: no slack) and the device within it plus the stated slack
(the caching allocator's own temporaries outside the pools).
"""

from __future__ import annotations

import argparse
import time

import torch

from ft.engine.core.engine import Engine
from ft.engine.base.engine_config import EngineConfig
from ft.engine.base.sampling_params import SamplingParams
from ft.units import format_bytes

GIB = 1024**3
SLACK = 4 * 1024**2  # the caching allocator's temporaries outside the pools (relocation copies, events)


def mib(n: int) -> str:
    return f"{n / 1024**2:,.0f}"


def device_used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="bench/configs/qwen3-next-80b-a3b.json")
    ap.add_argument("--cache-budget", default="7.6GiB")
    args = ap.parse_args()
    t0 = time.perf_counter()
    eng = Engine(EngineConfig(
        model=f"synthetic:{args.config}", device="cuda", dtype="bfloat16", gpu_memory_limit="16GiB",
        cache_budget=args.cache_budget, moe_cache_size=512, num_tokens=262144, mamba_cache_size=8,
        max_running_requests=1, max_prefill_length=4096,
    ))
    print(f"engine up in {time.perf_counter() - t0:.1f} s; vmm={eng.cache.storage.use_vmm}; "
          f"budget {format_bytes(eng.cache.budget.budget_bytes)}; boot {eng.cache.geometry}; "
          f"costs {eng.cache.layout.unit_costs()}; storage {eng.describe()['storage']}", flush=True)
    lay = eng.cache.layout
    boot = eng.cache.geometry
    back = dict(moe=boot.moe_slots, kv=boot.kv_tokens, mamba=boot.mamba_slots)
    seed1, seed2 = dict(moe=1024, kv=65536), dict(moe=1400, kv=8192, mamba=4)
    targets = [  # both of the seed's resizes start from the boot geometry, as in the seed
        ("seed 1: moe 1024, kv 65536 (cold)", seed1), ("back to boot", back),
        ("seed 2: moe 1400, kv 8192, mamba 4 (cold)", seed2), ("back to boot", back),
        ("seed 1 (warm)", seed1), ("back to boot", back), ("seed 2 (warm)", seed2),
    ]
    rows = []
    for label, tgt in targets:
        before = eng.cache.geometry
        plan = eng.cache.plan_resize(**tgt)
        grow_first = lay.nbytes(before) + max(0, lay.pool_bytes("moe", plan.target.moe_slots) - lay.pool_bytes("moe", before.moe_slots))
        used0 = device_used()
        outside = used0 - eng.cache.storage.mapped_bytes()  # everything but the pools
        peak = [used0]
        eng.cache.rebuilder.observer = lambda step: peak.append(device_used())
        t = time.perf_counter()
        entry = eng.cache.rebuild(**tgt)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        peak.append(device_used())
        bound = max(lay.nbytes(before), lay.nbytes(plan.target))
        device_peak_pools = max(peak) - outside
        rows.append((label, entry["status"], dt * 1e3, plan.peak_bytes, entry["measured_peak_bytes"],
                     device_peak_pools, bound, grow_first > eng.cache.budget.budget_bytes,
                     entry["measured_peak_bytes"] <= plan.peak_bytes == bound
                     and device_peak_pools <= plan.peak_bytes + SLACK))
    seq = eng.add_request(list(range(1000, 1016)), SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    t = time.perf_counter()
    eng.run_until_done([seq])
    gen_s = time.perf_counter() - t
    print(f"\nafter the rebuilds: generated {len(seq.output_ids)} tokens in {gen_s:.1f} s "
          f"(torch reference kernels), finite logits: {bool(torch.isfinite(eng.last_logits).all())}")
    print(f"budget {format_bytes(eng.cache.budget.budget_bytes)}, card 16 GiB emulated on {torch.cuda.get_device_name()}, "
          f"slack {format_bytes(SLACK)}")
    print(f"{'rebuild':<42} {'status':<6} {'ms':>6} {'plan peak':>9} {'pools peak':>10} {'device peak':>11} "
          f"{'max(old,new)':>12} {'grow-first':>10} {'within':>6}   (MiB)")
    for r in rows:
        print(f"{r[0]:<42} {r[1]:<6} {r[2]:>6.1f} {mib(r[3]):>9} {mib(r[4]):>10} {mib(r[5]):>11} {mib(r[6]):>12} "
              f"{'OOM' if r[7] else 'fits':>10} {str(r[8]):>6}")


if __name__ == "__main__":
    main()
