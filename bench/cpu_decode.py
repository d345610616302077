"""Demo-model decode speed on the CPU (issue: engine core). Not a test.

    python bench/cpu_decode.py [--tokens 128] [--threads N]

Runs the built-in demo model greedy at batch 1 with the default (offload, auto-sized expert
cache) and the resident backend, and prints a table: prefill time, decode tokens/s, expert
hit rate. Target: >= 20 decode tokens/s on the 2-core CI machine.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from ft.engine.core.engine import Engine
from ft.engine.base.engine_config import EngineConfig
from ft.engine.base.sampling_params import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def run(label: str, tokens: int, **opts) -> dict:
    eng = Engine(EngineConfig(**opts))
    ids = eng.tokenizer.encode(PROMPT)
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    eng.run_until_done([eng.add_request(ids, SamplingParams(max_new_tokens=8, temperature=0.0))])  # warm-up
    seq = eng.add_request(ids + [5], params)
    t0 = time.perf_counter()
    while not seq.output_ids:
        eng.step()
    t1 = time.perf_counter()
    while not seq.is_finished:
        eng.step()
    t2 = time.perf_counter()
    st = eng.pools.experts.stats
    return {
        "config": label, "prompt": len(ids) + 1, "prefill_s": t1 - t0,
        "decode_tok_s": (len(seq.output_ids) - 1) / (t2 - t1),
        "moe_slots": eng.cache.geometry.moe_slots, "hit_rate": st.hit_rate,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [
        run("offload, auto slots", args.tokens),
        run("offload, 16 slots", args.tokens, moe_cache_size=16, num_tokens=1024),
        run("resident", args.tokens, moe_backend="resident", num_tokens=1024, gpu_memory_limit="192MiB"),
    ]
    print(f"\nmachine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}")
    print(f"{'config':<22} {'prompt':>6} {'prefill s':>9} {'decode tok/s':>12} {'moe slots':>9} {'hit rate':>8}")
    for r in rows:
        print(f"{r['config']:<22} {r['prompt']:>6} {r['prefill_s']:>9.3f} {r['decode_tok_s']:>12.1f} "
              f"{r['moe_slots']:>9} {r['hit_rate']:>8.1%}")


if __name__ == "__main__":
    main()
