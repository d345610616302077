"""Flagship decode speed, all experts resident, eager and under CUDA graphs. Not a test.

    PYTHONPATH=. python3 bench/decode.py [--tokens 64] [--batches 1,8] [--profile STEPS]

Synthetic NVFP4 Qwen3-Next-80B-A3B on the GPU (`bench/configs/qwen3-next-80b-a3b.json`), the
resident MoE backend (every expert in a device slot: no host traffic), greedy decode at each
batch size after a short prompt, first eagerly then replaying CUDA graphs (same engine, same
run). Reports tokens/s and the ratio to the roofline: the bytes one step must read
(`bytes_per_step`) at 4.3 TB/s. Prints a table last.
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
    ap.add_argument("--batches", default="1,8", help="decode batch sizes to time")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after the timed runs, profile this many decode steps (torch.profiler) and print the top ops")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    eng = Engine(EngineConfig(model=f"synthetic:{args.config}", device="cuda", dtype="bfloat16",
                              moe_backend="resident", num_tokens=16384, mamba_cache_size=2 * max(batches),
                              max_running_requests=max(batches), max_prefill_length=1024,
                              cuda_graph_max_bs=max(batches)))
    print(f"engine up in {time.perf_counter() - t0:.1f} s, geometry {eng.cache.geometry}", flush=True)
    graphs = eng.runner.graphs
    prompt = list(range(1000, 1032))
    rows = []
    for mode in ("eager", "graphs"):
        eng.runner.graphs = graphs if mode == "graphs" else None
        for b in batches:
            tok_s, step_ms = timed_decode(eng, prompt, b, args.tokens)
            roof = COPY_BW / bytes_per_step(eng, b, len(prompt) + args.tokens) * b
            rows.append((mode, b, tok_s, step_ms, roof))
            print(f"{mode} batch {b}: {tok_s:.1f} tok/s", flush=True)
    eng.runner.graphs = graphs
    if args.profile:
        for b in batches:
            profile_steps(eng, prompt, args.profile, b)
    print(f"\ngraphs captured {graphs.captures} ({graphs.capture_s:.2f} s), replayed {graphs.replays}")
    print(f"\n{'model':<26} {'mode':<7} {'batch':>5} {'tok/s':>9} {'ms/step':>8} {'roofline tok/s':>14} {'ratio':>7}")
    for mode, b, tok_s, step_ms, roof in rows:
        print(f"{'qwen3-next-80b-a3b (syn.)':<26} {mode:<7} {b:>5} {tok_s:>9.2f} {step_ms:>8.2f} {roof:>14.0f} "
              f"{tok_s / roof:>7.2%}")


def timed_decode(eng, prompt: list[int], batch: int, tokens: int) -> tuple[float, float]:
    """(tokens/s over the batch, ms per step) of greedy decode after each request's first token."""
    seqs = [eng.add_request([t + i for t in prompt], SamplingParams(max_new_tokens=tokens, temperature=0.0,
                                                                    ignore_eos=True)) for i in range(batch)]
    while any(not s.output_ids for s in seqs):
        eng.step()
    for _ in range(3):  # warm: the first steps of a bucket capture its graph
        eng.step()
    done = sum(len(s.output_ids) for s in seqs)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    steps = 0
    while any(not s.is_finished for s in seqs):
        eng.step()
        steps += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t1
    return (sum(len(s.output_ids) for s in seqs) - done) / dt, dt / max(1, steps) * 1e3


def bytes_per_step(eng, batch: int, context: int) -> int:
    """The fewest bytes one decode step reads: resident weights except the embedding table (one
    row is read) and all of lm_head, the routed experts the batch selects (at most all), the
    linear-attention state (read and written) and the KV of each sequence."""
    c, costs = eng.model_config, eng.cache.layout.unit_costs()
    resident = eng.model.resident_bytes - c.vocab_size * c.hidden_size * 2
    experts = len(c.moe_layers) * min(c.num_experts, batch * c.num_experts_per_tok) * costs.expert_slot
    state = batch * costs.mamba_slot * 2
    kv = batch * costs.kv_page * context // costs.page_size
    return resident + experts + state + kv


def profile_steps(eng, prompt, steps: int, batch: int = 1) -> None:
    """Where a decode step's time goes at `batch` sequences: host time per op, GPU kernel time, launches per step."""
    from torch.profiler import ProfilerActivity, profile

    seqs = [eng.add_request([t + i for t in prompt], SamplingParams(max_new_tokens=steps + 4, temperature=0.0,
                                                                    ignore_eos=True)) for i in range(batch)]
    while any(len(s.output_ids) < 2 for s in seqs):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"\nprofile at batch {batch}: {steps} decode steps, {kernels / steps:.0f} GPU kernels per step, "
          f"{gpu_us / steps / 1e3:.2f} ms GPU time per step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60))
    print(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60))
    eng.run_until_done(seqs)


if __name__ == "__main__":
    main()
