"""Offloaded decode on one GPU against two (tensor parallelism), each card emulating the same size. Not a test.

    PYTHONPATH=. python3 bench/tp_decode.py [--card 16GiB] [--kv 65536] [--tokens 1024] [--batches 1,8]

Synthetic NVFP4 Qwen3-Next-80B-A3B with its routing drawn from the calibrated trace (as
bench/ladder.py), the offload backend in read-through mode, bf16 KV fixed at --kv tokens, every
card limited to --card (`--gpu-memory-limit`). For --tensor-parallel-size 1 and 2: one engine;
at each batch size, that many greedy requests decode --tokens tokens after a 32-token prompt
(total tok/s over the decode), rank 0's expert slots and hit rate, each rank's slots, and the
host time rank 0 spends per step sending the workers their step inputs (gloo). `--profile STEPS`
then profiles that many decode steps on rank 0 (torch.profiler: its host ops and GPU kernels, the
all-reduces among them). Prints a table last, with two cards' speed over one card's.
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
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (give a small --config)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after each engine's rows, profile this many batch-1 decode steps on rank 0")
    args = ap.parse_args()
    cfg = json.loads(Path(args.config).read_text())
    cfg["routing_trace"] = True
    tmp = Path(tempfile.mkdtemp()) / "traced.json"
    tmp.write_text(json.dumps(cfg))
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for tp in (int(t) for t in args.tp.split(",")):
        t0 = time.perf_counter()
        eng = Engine(EngineConfig(model=f"synthetic:{tmp}", device=args.device,
                                  dtype="bfloat16" if args.device == "cuda" else "float32", moe_backend="offload",
                                  gpu_memory_limit=args.card, num_tokens=args.kv, max_running_requests=max(batches),
                                  max_prefill_length=1024, cuda_graph_max_bs=max(batches), tensor_parallel_size=tp))
        try:
            slots = [eng.pools.experts.num_slots]
            if eng.cache.peers is not None:
                slots += [d["geometry"]["moe_slots"] for d in eng.cache.peers.describes]
            print(f"tp {tp}: engine up in {time.perf_counter() - t0:.1f} s, slots per rank {slots}", flush=True)
            for b in batches:
                decode(eng, b, 8)  # compiles the kernels and captures this bucket's graph outside the timed rows
                c0, n0 = (eng.tp.broadcast_s, eng.tp.broadcasts) if eng.tp else (0.0, 0)
                tok_s, hit = decode(eng, b, args.tokens)
                control_ms = (eng.tp.broadcast_s - c0) / max(1, eng.tp.broadcasts - n0) * 1e3 if eng.tp else 0.0
                rows.append((tp, b, slots, hit, tok_s, control_ms))
                print(f"tp {tp} batch {b}: {tok_s:.1f} tok/s, hit rate {hit:.1%}, control {control_ms:.3f} ms per "
                      "message", flush=True)
            if args.profile:
                from bench.decode import profile_steps

                profile_steps(eng, [(1000 + i) % eng.model_config.vocab_size for i in range(32)], args.profile)
        finally:
            eng.close()
            del eng
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    one = {b: t for tp, b, _, _, t, _ in rows if tp == 1}
    print("\n| GPUs | batch | expert slots per rank | hit rate (rank 0) | tok/s (total) | vs one GPU | control ms/message |")
    print("|---|---|---|---|---|---|---|")
    for tp, b, slots, hit, tok_s, control_ms in rows:
        ratio = f"{tok_s / one[b]:.2f}x" if one.get(b) else "-"
        print(f"| {tp} | {b} | {', '.join(f'{s:,}' for s in slots)} | {hit:.1%} | {tok_s:.1f} | {ratio} | "
              f"{control_ms:.3f} |")


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
    _sync()
    t0 = time.perf_counter()
    done0 = sum(len(s.output_ids) for s in seqs)
    while not all(s.is_finished for s in seqs):
        eng.step()
    _sync()
    elapsed = time.perf_counter() - t0
    experts.collect()
    hits, misses = experts.stats.hits - h0, experts.stats.misses - m0
    return (sum(len(s.output_ids) for s in seqs) - done0) / elapsed, hits / max(1, hits + misses)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
