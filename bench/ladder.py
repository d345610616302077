"""The seed's ladder table on this machine: offloaded decode speed at each KV rung of an emulated card.

    PYTHONPATH=. python3 bench/ladder.py [--cards 32GiB,16GiB] [--rungs 65536,131072,262144]
                                         [--tokens 128,1024,4096] [--policy auto] [--chunks 1024,16384]
                                         [--no-mapped-victims] [--variant NAME]

Synthetic NVFP4 Qwen3-Next-80B-A3B (`bench/configs/qwen3-next-80b-a3b.json` with its routing drawn
from the calibrated trace, `ft.tools.routing_trace.CALIBRATED`: ~68% / 79% LRU hits at 12.5% /
25% of the experts cached), or another model (`--config`; the seeds' Qwen3.8-Flash-Next:
`bench/configs/qwen3.8-flash-next-small-table.json`, its n-gram table cut to 1M rows a head so that
host memory holds it beside the experts), the offload backend in read-through mode (misses read from
pinned host memory inside the CUDA graph), bf16 KV (`--kv-cache-dtype`; the seed's table ran NVFP4),
the KV ladder on with automatic moves off. For each emulated card (`--gpu-memory-limit`) one engine;
for each rung a manual ladder move (a live rebuild: the expert slots fill what KV leaves), then one
greedy request decodes max(--tokens) tokens after a 32-token prompt; tok/s is reported over the first
128, 1,024 and 4,096 generated tokens of that request (each window includes the cold start of its cache: a new request routes
by a new trace). Per rung: expert slots, hit rate and the bytes read from host memory per token
over the whole request, and the ratio of tok/s to this machine's bounds for that traffic: the
overlapped bound, max(HBM bytes / 4.3 TB/s, host bytes / 50 GB/s) per token, and the serial floor
(issue 39), HBM bytes / 4.3 TB/s + host bytes / 50 GB/s: what a step that reads its misses after its
other bytes, as the engine's does, could reach at best. The ladder's gain is each rung's
tok/s over the 256K rung's (the fixed 256K geometry of the seed: KV fixed at 256K tokens, slots
filling the rest, is exactly that rung's geometry). "policy ms/token": the read-through policy's own host time
(`ReadThrough.host_s`: begin_step and end_step without the collect's wait for the step before, which runs behind
the device). "card left GiB": what of the emulated card the process never took by the driver's count after the
rung's request (`card_left`: the budget's headroom, less what the run used of it). Prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from ft.engine.core.engine import Engine
from ft.engine.base.engine_config import EngineConfig
from ft.engine.base.sampling_params import SamplingParams

HBM_BW = 4.3e12
HOST_BW = 50e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="bench/configs/qwen3-next-80b-a3b.json")
    ap.add_argument("--cards", default="32GiB,16GiB")
    ap.add_argument("--rungs", default="65536,131072,262144", help="KV tokens of the rungs to measure")
    ap.add_argument("--tokens", default="128,1024,4096", help="windows of generated tokens (the largest is decoded)")
    ap.add_argument("--policy", default="auto", choices=["auto", "lru", "lfu"],
                    help="the expert policy (default: the engine's, auto: lfu under read-through since session 31)")
    ap.add_argument("--mapped-victims", action=argparse.BooleanOptionalAction, default=None,
                    help="--expert-mapped-victims: a victim stays a hit until a miss claims its slot "
                         "(default: the engine's, on under read-through since session 33)")
    ap.add_argument("--kv-cache-dtype", default="bf16", choices=["bf16", "fp8", "nvfp4"],
                    help="the KV cache's dtype (the seed's table: nvfp4 for Qwen3.8-Flash-Next)")
    ap.add_argument("--step", type=int, default=32768, help="the ladder's step size")
    ap.add_argument("--chunks", default="1024",
                    help="--max-prefill-length of each engine (one engine per card and chunk: what a chunk's reserve "
                         "costs decode; 0: the card's default)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after each rung's row, profile this many decode steps there (GPU kernels and timeline)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="STEPS",
                    help="after each card's rows, the host time of this many decode steps by function (cProfile)")
    ap.add_argument("--memory-ratios", default="auto", metavar="R[,R...]",
                    help="--memory-ratio of each engine, or auto for the default headroom (several: one engine per "
                         "ratio and card, in the order given, an A/B of the headroom; rows say which)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script on a small config")
    ap.add_argument("--pdl", action="store_true",
                    help="launch the decode kernels with programmatic dependent launch (kernel variant pdl)")
    ap.add_argument("--overlap-ab", action="store_true",
                    help="each rung twice on the same engine, overlapped decode off then on (an A/B in one process)")
    ap.add_argument("--overlap-decode", action=argparse.BooleanOptionalAction, default=None,
                    help="overlapped decode over the read-through offload (default: the engine's, on on CUDA "
                         "since session 31; until then off for offload)")
    ap.add_argument("--lend-prefill-reserve", action=argparse.BooleanOptionalAction, default=None,
                    help="the prefill reserve's loan to the expert slots (default: the engine's, on for offload on "
                         "CUDA since session 35); --no-lend-prefill-reserve gives the rows before it")
    ap.add_argument("--embedding-on-host", action=argparse.BooleanOptionalAction, default=None,
                    help="the token embedding in host memory (default: the engine's, on for offload on CUDA); "
                         "--no-embedding-on-host keeps it on the device (the rows before session 30)")
    ap.add_argument("--ngram-table", default="auto", choices=["auto", "host", "disk"],
                    help="where a Qwen3.8-Flash-Next config's n-gram table lives (the engine's --ngram-table: disk "
                         "writes the synthetic table to a temporary file and reads its rows through the page cache)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME",
                    help="a named kernel variant for every engine (ft.kernels.options.VARIANTS, e.g. "
                         "pdl); repeatable")
    args = ap.parse_args()
    if args.pdl or args.variant:
        from ft.kernels.options import set_kernel_options, variant

        set_kernel_options(variant(*(["pdl"] if args.pdl else []), *args.variant))
    cfg = json.loads(Path(args.config).read_text())
    cfg["routing_trace"] = True
    tmp = Path(tempfile.mkdtemp()) / "traced.json"
    tmp.write_text(json.dumps(cfg))
    windows = sorted(int(t) for t in args.tokens.split(","))
    rungs = [int(r) for r in args.rungs.split(",")]
    rows = []
    ratios = [None if r == "auto" else float(r) for r in args.memory_ratios.split(",")]
    engines = [(card, int(c), ratio) for card in args.cards.split(",") for c in args.chunks.split(",")
               for ratio in ratios]
    for card, chunk, ratio in engines:
        t0 = time.perf_counter()
        eng = Engine(EngineConfig(model=f"synthetic:{tmp}", device=args.device, dtype="bfloat16", moe_backend="offload",
                                  gpu_memory_limit=card, enable_kv_ladder=True, ladder_step_size=args.step,
                                  max_running_requests=1, max_prefill_length=chunk or None, cuda_graph_max_bs=1,
                                  memory_ratio=ratio,
                                  expert_policy=args.policy, expert_mapped_victims=args.mapped_victims,
                                  kv_cache_dtype=args.kv_cache_dtype,
                                  overlap_decode=args.overlap_decode,
                                  embedding_on_host=args.embedding_on_host, ngram_table=args.ngram_table,
                                  lend_prefill_reserve=args.lend_prefill_reserve))
        eng.ladder.auto = False
        measure(eng, [16])  # NOTE: compiles the kernels and captures the graph outside the timed rows
        print(f"{card}: engine up in {time.perf_counter() - t0:.1f} s, rungs {eng.ladder.rungs}, "
              f"chunk {eng.config.max_prefill_length}", flush=True)
        from ft.serve_cmd import describe  # (the server's startup banner: where the card's bytes go)

        print("\n".join(describe(eng, "-").splitlines()[:-1]), flush=True)
        if len(args.chunks.split(",")) > 1:  # several chunks: rows say which
            card = f"{card} chunk {eng.config.max_prefill_length}"
        if len(ratios) > 1:  # several ratios: rows say which
            card = f"{card} ratio {'auto' if ratio is None else f'{ratio:g}'}"
        for kv in rungs:
            if kv not in eng.ladder.rungs:
                print(f"{card}: no rung at {kv} tokens (rungs {eng.ladder.rungs})", flush=True)
                continue
            try:
                eng.move_ladder(eng.ladder.rungs.index(kv), "bench")
            except Exception as e:  # noqa: BLE001 - a rung this card cannot reach is a row, not a crash
                print(f"{card} rung {kv}: {type(e).__name__}: {e}", flush=True)
                rows.append((card, kv, None))
                continue
            if eng.loan is not None and eng.cache.lent < eng.loan_bytes:  # the move recalled it: out again
                eng.loan.lend("bench/ladder.py: before the row")  # before the row, not 2 s into it
            for overlap in (False, True) if args.overlap_ab else (eng.config.overlap_decode,):
                eng.config = dataclasses.replace(eng.config, overlap_decode=overlap)
                label = card + (" overlap" if overlap else " plain") * args.overlap_ab
                r = measure(eng, windows)
                r["slots"] = eng.pools.experts.num_slots
                r["overlapped_steps"] = eng.overlapped_steps
                rows.append((label, kv, r))
                print(f"{label} kv {kv}: {r}", flush=True)
                if args.profile:
                    from bench.decode import profile_steps

                    print(f"\n== profile: {label}, KV rung {kv}")
                    profile_steps(eng, [(1000 + i) % eng.model_config.vocab_size for i in range(32)], args.profile)
        if args.cprofile:
            host_profile(eng, args.cprofile)
        del eng
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    table(rows, windows)


def measure(eng, windows: list[int]) -> dict:
    """One request decoding max(windows) tokens: tok/s over each window of generated tokens (after
    the first, which the prefill makes), and the whole request's hit rate and host bytes per token."""
    experts = eng.pools.experts
    n = max(windows)
    vocab = eng.model_config.vocab_size
    seq = eng.add_request([(1000 + i) % vocab for i in range(32)], SamplingParams(max_new_tokens=n + 1, temperature=0.0,
                                                                  ignore_eos=True))
    while not seq.output_ids:
        eng.step()
    experts.collect()
    h0, m0, b0 = experts.stats.hits, experts.stats.misses, experts.stats.bytes_loaded
    rt = experts.read_through
    p0 = rt.host_s if rt else 0.0
    graphs = eng.runner.graphs
    g0 = graphs.replay_s if graphs else 0.0
    _sync()
    t0 = time.perf_counter()
    marks = {}
    while not seq.is_finished:
        eng.step()
        done = len(seq.output_ids) - 1
        if done in windows and done not in marks:
            _sync()
            marks[done] = done / (time.perf_counter() - t0)
    elapsed = time.perf_counter() - t0
    experts.collect()
    policy_ms = ((rt.host_s if rt else 0.0) - p0) / n * 1e3
    launch_ms = ((graphs.replay_s if graphs else 0.0) - g0) / n * 1e3
    hits, misses = experts.stats.hits - h0, experts.stats.misses - m0
    host_bytes = (experts.stats.bytes_loaded - b0) / n
    hbm = hbm_bytes_per_token(eng)
    bound = 1.0 / max(hbm / HBM_BW, host_bytes / HOST_BW)
    serial = 1.0 / (hbm / HBM_BW + host_bytes / HOST_BW)  # the step's reads and its misses one after the other
    return {"tok_s": {w: round(marks.get(w, 0.0), 2) for w in windows}, "hit_rate": hits / max(1, hits + misses),
            "host_mb_per_token": host_bytes / 1e6, "bound_tok_s": bound, "serial_floor_tok_s": serial,
            "ms_per_token": elapsed / n * 1e3,
            "policy_ms_per_token": policy_ms, "launch_ms_per_token": launch_ms,
            "card_left_gib": card_left(eng) / 2**30}


def card_left(eng) -> float:
    """Bytes of the (emulated) card the process has never taken, after a request (`DeviceMemory.untouched_bytes`:
    the card less the device's use by the driver's count; torch's allocator keeps what it took, so this is about
    the run's least). The headroom the budget holds back from the pools shows here when nothing used it. 0 on the CPU."""
    reading = eng.device_memory.read(fresh=True)
    return float(reading.untouched_bytes) if reading is not None else 0.0


def host_profile(eng, steps: int) -> None:
    """Where the host time of `steps` decode steps goes (cProfile, top functions by own time)."""
    import cProfile
    import pstats

    vocab = eng.model_config.vocab_size
    seq = eng.add_request([(2000 + i) % vocab for i in range(32)], SamplingParams(max_new_tokens=steps + 8,
                                                                               temperature=0.0, ignore_eos=True))
    for _ in range(6):
        eng.step()
    _sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    print(f"\nhost profile: {steps} decode steps, {(time.perf_counter() - t0) / steps * 1e3:.2f} ms per step (profiled)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    eng.run_until_done([seq])


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hbm_bytes_per_token(eng) -> float:
    """Bytes a batch-1 decode step reads from device memory: the resident weights, the routed
    experts' bytes (hits from slots; a miss's bytes are counted once more as its landing write) and
    the shared expert, approximated by the dense weights plus top_k experts per MoE layer."""
    experts = eng.pools.experts
    per_expert = experts.bytes_per_slot
    return eng.model.resident_bytes + eng.model.moe_pairs_per_token * per_expert


def table(rows, windows: list[int]) -> None:
    base = {card: r["tok_s"][max(windows)] for card, kv, r in rows if r and kv == max(k for _, k, _ in rows)}
    head = " | ".join(f"tok/s @{w}" for w in windows)
    print(f"\n| card | KV rung | slots | hit rate | host MB/token | {head} | bound tok/s | of bound | serial floor "
          f"tok/s | of serial | gain vs top rung | policy ms/token | graph launch ms/token | card left GiB |")
    print("|---|---|---|---|---|" + "---|" * len(windows) + "---|---|---|---|---|---|---|---|")
    for card, kv, r in rows:
        if r is None:
            print(f"| {card} | {kv // 1024}K | refused |" + " |" * (len(windows) + 10))
            continue
        last = r["tok_s"][max(windows)]
        cells = " | ".join(f"{r['tok_s'][w]:.1f}" for w in windows)
        gain = f"{last / base[card] - 1:+.1%}" if base.get(card) else "-"
        print(f"| {card} | {kv // 1024}K | {r['slots']:,} | {r['hit_rate']:.1%} | {r['host_mb_per_token']:.0f} | "
              f"{cells} | {r['bound_tok_s']:.0f} | {last / r['bound_tok_s']:.0%} | {r['serial_floor_tok_s']:.0f} | "
              f"{last / r['serial_floor_tok_s']:.0%} | {gain} | {r['policy_ms_per_token']:.2f} | "
              f"{r['launch_ms_per_token']:.2f} | {r['card_left_gib']:.2f} |")


if __name__ == "__main__":
    main()
