"""Offloaded decode on one GPU against two (tensor parallelism), each card emulating the same size. Not a test.

    PYTHONPATH=. python3 bench/tp_decode.py [--card 16GiB] [--kv 65536] [--tokens 1024] [--batches 1,8]

Synthetic NVFP4 Qwen3-Next-80B-A3B with its routing drawn from the calibrated trace (as
bench/ladder.py), the offload backend in read-through mode, bf16 KV fixed at --kv tokens, every
card limited to --card (`--gpu-memory-limit`). For --tensor-parallel-size 1 and 2: one engine;
at each batch size, that many greedy requests decode --tokens tokens after a 32-token prompt
(total tok/s over the decode), rank 0's expert slots and hit rate, and each rank's slots.
Prints a table last, with two cards' speed over one card's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from ft.engine.engine import Engine
from ft.engine.engine_config import EngineConfig
from ft.engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="bench/configs/qwen3-next-80b-a3b.json")
    ap.add_argument("--card", default="16GiB")
    ap.add_argument("--kv", type=int, default=65536)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes to run")
    args = ap.parse_args()
    cfg = json.loads(Path(args.config).read_text())
    cfg["routing_trace"] = True
    tmp = Path(tempfile.mkdtemp()) / "traced.json"
    tmp.write_text(json.dumps(cfg))
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for tp in (int(t) for t in args.tp.split(",")):
        t0 = time.perf_counter()
        eng = Engine(EngineConfig(model=f"synthetic:{tmp}", device="cuda", dtype="bfloat16", moe_backend="offload",
                                  gpu_memory_limit=args.card, num_tokens=args.kv, max_running_requests=max(batches),
                                  max_prefill_length=1024, cuda_graph_max_bs=max(batches), tensor_parallel_size=tp))
        try:
            slots = [eng.pools.experts.num_slots]
            if eng.cache.peers is not None:
                slots += [d["geometry"]["moe_slots"] for d in eng.cache.peers.describes]
            print(f"tp {tp}: engine up in {time.perf_counter() - t0:.1f} s, slots per rank {slots}", flush=True)
            for b in batches:
                decode(eng, b, 8)  # compiles the kernels and captures this bucket's graph outside the timed rows
                tok_s, hit = decode(eng, b, args.tokens)
                rows.append((tp, b, slots, hit, tok_s))
                print(f"tp {tp} batch {b}: {tok_s:.1f} tok/s, hit rate {hit:.1%}", flush=True)
        finally:
            eng.close()
            del eng
            torch.cuda.empty_cache()
    one = {b: t for tp, b, _, _, t in rows if tp == 1}
    print("\n| GPUs | batch | expert slots per rank | hit rate (rank 0) | tok/s (total) | vs one GPU |")
    print("|---|---|---|---|---|---|")
    for tp, b, slots, hit, tok_s in rows:
        ratio = f"{tok_s / one[b]:.2f}x" if one.get(b) else "-"
        print(f"| {tp} | {b} | {', '.join(f'{s:,}' for s in slots)} | {hit:.1%} | {tok_s:.1f} | {ratio} |")


def decode(eng: Engine, batch: int, tokens: int) -> tuple[float, float]:
    """`batch` greedy requests of `tokens` new tokens each: (total tok/s over the decode steps, hit rate)."""
    experts = eng.pools.experts
    vocab = eng.model_config.vocab_size
    seqs = [eng.add_request([(1000 + 37 * r + i) % vocab for i in range(32)],
                            SamplingParams(max_new_tokens=tokens + 1, temperature=0.0, ignore_eos=True))
            for r in range(batch)]
    while not all(s.output_ids for s in seqs):
        eng.step()
    experts.collect()
    h0, m0 = experts.stats.hits, experts.stats.misses
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    done0 = sum(len(s.output_ids) for s in seqs)
    while not all(s.is_finished for s in seqs):
        eng.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    experts.collect()
    hits, misses = experts.stats.hits - h0, experts.stats.misses - m0
    return (sum(len(s.output_ids) for s in seqs) - done0) / elapsed, hits / max(1, hits + misses)


if __name__ == "__main__":
    main()
