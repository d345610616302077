"""Flagship decode speed at batch 1, all experts resident (kernels issue). Not a test.

    PYTHONPATH=. python3 bench/decode.py [--tokens 64]

Synthetic NVFP4 Qwen3-Next-80B-A3B on the GPU (`bench/configs/qwen3-next-80b-a3b.json`), the
resident MoE backend (every expert in a device slot: no host traffic), greedy decode at batch 1
after a short prompt. Reports tokens/s and the ratio to the roofline: bytes read per token
(resident weights except the embedding table and all of lm_head, the 10 routed experts of each
of 48 layers, and the KV and state read) at 4.3 TB/s. Prints a table last.
"""

from __future__ import annotations

import argparse
import time

import torch

from ft.engine.engine import Engine
from ft.engine.engine_config import EngineConfig
from ft.engine.sampling_params import SamplingParams

COPY_BW = 4.3e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="bench/configs/qwen3-next-80b-a3b.json")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after the timed run, profile this many decode steps (torch.profiler) and print the top ops")
    args = ap.parse_args()
    t0 = time.perf_counter()
    eng = Engine(EngineConfig(model=f"synthetic:{args.config}", device="cuda", dtype="bfloat16",
                              moe_backend="resident", num_tokens=8192, mamba_cache_size=2,
                              max_running_requests=1, max_prefill_length=1024))
    print(f"engine up in {time.perf_counter() - t0:.1f} s, geometry {eng.cache.geometry}", flush=True)
    c = eng.model_config
    prompt = list(range(1000, 1032))
    warm = eng.add_request(prompt, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    eng.run_until_done([warm])
    seq = eng.add_request(prompt[::-1], SamplingParams(max_new_tokens=args.tokens, temperature=0.0, ignore_eos=True))
    while not seq.output_ids:
        eng.step()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    eng.run_until_done([seq])
    torch.cuda.synchronize()
    dt = time.perf_counter() - t1
    tok_s = (len(seq.output_ids) - 1) / dt
    embed = c.vocab_size * c.hidden_size * 2
    resident = eng.model.resident_bytes - embed  # one embedding row is read, not the table
    experts = len(c.moe_layers) * c.num_experts_per_tok * eng.cache.layout.unit_costs().expert_slot
    state = eng.cache.layout.unit_costs().mamba_slot * 2  # every linear layer's state, read and written
    kv = eng.cache.layout.unit_costs().kv_page * (len(prompt) + args.tokens) // eng.cache.layout.unit_costs().page_size
    per_token = resident + experts + state + kv
    roof = COPY_BW / per_token
    if args.profile:
        profile_steps(eng, prompt, args.profile)
    print(f"\n{'model':<26} {'batch':>5} {'tokens':>6} {'tok/s':>8} {'bytes/token':>12} {'roofline tok/s':>14} {'ratio':>7}")
    print(f"{'qwen3-next-80b-a3b (syn.)':<26} {1:>5} {len(seq.output_ids):>6} {tok_s:>8.2f} {per_token / 1e9:>10.2f} GB "
          f"{roof:>14.0f} {tok_s / roof:>7.2%}")


def profile_steps(eng, prompt, steps: int) -> None:
    """Where a decode step's time goes: host time per op, GPU kernel time, launches per step."""
    from torch.profiler import ProfilerActivity, profile

    seq = eng.add_request(prompt, SamplingParams(max_new_tokens=steps + 2, temperature=0.0, ignore_eos=True))
    while len(seq.output_ids) < 2:
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"\nprofile: {steps} decode steps, {kernels / steps:.0f} GPU kernels per step, "
          f"{gpu_us / steps / 1e3:.2f} ms GPU time per step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    eng.run_until_done([seq])


if __name__ == "__main__":
    main()
