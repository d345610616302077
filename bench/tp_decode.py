"""Offloaded decode on one GPU against two (tensor parallelism), each card emulating the same size. Not a test.

    PYTHONPATH=. python3 bench/tp_decode.py [--card 16GiB] [--kv 65536] [--tokens 1024] [--batches 1,8]

Synthetic NVFP4 Qwen3-Next-80B-A3B with its routing drawn from the calibrated trace (as
bench/ladder.py), the offload backend in read-through mode, bf16 KV fixed at --kv tokens, every
card limited to --card (`--gpu-memory-limit`). For --tensor-parallel-size 1 and 2: one engine;
at each batch size, that many greedy requests decode --tokens tokens after a 32-token prompt
(total tok/s over the decode), rank 0's expert slots and hit rate, each rank's slots, and the
host time rank 0 spends per step sending the workers their step inputs (gloo). `--profile STEPS`
then profiles that many decode steps on rank 0 (torch.profiler: its host ops and GPU kernels, the
all-reduces among them); `--host-breakdown STEPS` times rank 0's phases of that many batch-1
steps (schedule, step inputs, send, load, launch, wait, postprocess). Prints a table last, with
two cards' speed over one card's.

`--live TOKENS`: then, for the largest tensor-parallel size, an engine with the KV ladder on
(automatic moves off) at the 64K rung: max(--batches) greedy requests decode TOKENS tokens
undisturbed, then the same requests again while, under load, the engine moves the ladder one rung
up, resizes the expert slots by hand (-256, or a quarter) and moves back down to 64K. Each rebuild's time, status
and every rank's measured peak, the decode speed of both runs, and whether the tokens are equal
(they must: offload reads the same weights whatever the geometry) print as a second table.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ft.engine.core.engine import Engine
from ft.engine.base.engine_config import EngineConfig
from ft.engine.base.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="bench/configs/qwen3-next-80b-a3b.json")
    ap.add_argument("--card", default="16GiB")
    ap.add_argument("--kv", type=int, default=65536)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tp", default="1,2",
                    help="tensor-parallel sizes to run, each in a fresh process; 2:one-shot takes torch's one-shot all-reduce")
    ap.add_argument("--rows-json", default=None, help=argparse.SUPPRESS)  # a child's rows (one --tp)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (give a small --config)")
    ap.add_argument("--live", type=int, default=0, metavar="TOKENS",
                    help="then a ladder move and a resize under load with the largest --tp (see above)")
    ap.add_argument("--host-breakdown", type=int, default=0, metavar="STEPS",
                    help="after each engine's rows, rank 0's host time per batch-1 decode step by phase")
    ap.add_argument("--cprofile", action="store_true",
                    help="with --host-breakdown: also rank 0's host functions by own time (cProfile)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after each engine's rows, profile this many batch-1 decode steps on rank 0")
    args = ap.parse_args()
    cfg = json.loads(Path(args.config).read_text())
    cfg["routing_trace"] = True
    tmp = Path(tempfile.mkdtemp()) / "traced.json"
    tmp.write_text(json.dumps(cfg))
    batches = [int(b) for b in args.batches.split(",")]
    specs = args.tp.split(",")
    if args.rows_json is None:
        # NOTE: every engine in its own process: one closed in this process leaves some device
        # memory behind (fewer expert slots for the next), and torch's one-shot setup works once
        rows = []
        for spec in specs:
            out = Path(tempfile.mkdtemp()) / "rows.json"
            argv = [a for a in sys.argv[1:]]
            subprocess.run([sys.executable, sys.argv[0], *argv, "--tp", spec, "--live", "0", "--rows-json", str(out)],
                           check=True)
            rows += [tuple(r) for r in json.loads(out.read_text())]
        table(rows)
        if args.live:
            live(args, tmp, max(int(t.partition(":")[0]) for t in specs), max(batches))
        return
    rows = []
    for spec in specs:
        tp, _, path = spec.partition(":")  # "2:one-shot": torch's one-shot all-reduce instead of NCCL's
        tp = int(tp)
        os.environ["FT_TP_ALL_REDUCE"] = path or "nccl"  # the worker ranks inherit it
        t0 = time.perf_counter()
        eng = Engine(EngineConfig(model=f"synthetic:{tmp}", device=args.device,
                                  dtype="bfloat16" if args.device == "cuda" else "float32", moe_backend="offload",
                                  gpu_memory_limit=args.card, num_tokens=args.kv, max_running_requests=max(batches),
                                  max_prefill_length=1024, cuda_graph_max_bs=max(batches), tensor_parallel_size=tp))
        try:
            slots = [eng.pools.experts.num_slots]
            if eng.cache.peers is not None:
                slots += [d["geometry"]["moe_slots"] for d in eng.cache.peers.describes]
            path = eng.tp.all_reduce_path if eng.tp else "-"
            print(f"tp {tp}: engine up in {time.perf_counter() - t0:.1f} s, slots per rank {slots}, all-reduce "
                  f"{path}", flush=True)
            for b in batches:
                decode(eng, b, 8)  # compiles the kernels and captures this bucket's graph outside the timed rows
                c0, n0 = (eng.tp.broadcast_s, eng.tp.broadcasts) if eng.tp else (0.0, 0)
                rt = eng.pools.experts.read_through
                e0 = getattr(rt, "early_collects", 0)
                tok_s, hit = decode(eng, b, args.tokens)
                early = getattr(rt, "early_collects", 0) - e0
                control_ms = (eng.tp.broadcast_s - c0) / max(1, eng.tp.broadcasts - n0) * 1e3 if eng.tp else 0.0
                rows.append((tp, path, b, slots, hit, tok_s, control_ms))
                print(f"tp {tp} batch {b}: {tok_s:.1f} tok/s, hit rate {hit:.1%}, control {control_ms:.3f} ms per "
                      f"message, {early} of {args.tokens} steps collected before the step (short of spares)", flush=True)
            if args.host_breakdown:
                host_breakdown(eng, args.host_breakdown, args.cprofile)
            if args.profile:
                from bench.decode import profile_steps

                profile_steps(eng, [(1000 + i) % eng.model_config.vocab_size for i in range(32)], args.profile)
        finally:
            eng.close()
            del eng
            gc.collect()  # NOTE: the engine's objects hold each other: freed only by the cycle collector
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    Path(args.rows_json).write_text(json.dumps(rows))


PHASES = [  # (label, owner attribute path, method): rank 0's work in one decode step, in order
    ("check workers", "", "_check_workers"),
    ("schedule", "scheduler", "schedule"),
    ("step inputs", "runner", "decode_inputs"),
    ("send to workers", "tp", "broadcast"),
    ("collect (offload)", "runner.pools.experts", "collect"),
    ("begin step (offload)", "runner.pools.experts.read_through", "begin_step"),
    ("load buffers", "runner", "load"),
    ("graph key", "runner", "_graph_key"),
    ("graph launch", "runner.graphs", "run"),
    ("eager forward", "runner.model", "forward"),
    ("end step (offload)", "runner.pools.experts.read_through", "end_step"),
    ("sample", "runner", "_sample"),
    ("routing trace draw", "runner.routing", "prefetch"),
    ("wait for the token", "runner", "_to_host"),
    ("postprocess", "", "_postprocess"),
]
"""Before "graph launch" the device idles (the last step's token was waited for); from the launch to
"wait for the token" the host works while the device runs."""


def host_breakdown(eng: Engine, steps: int, cprofile: bool = False) -> None:
    """One greedy request decodes `steps` steps with rank 0's phases timed (wrapping the engine's
    methods on this instance only): ms per step by phase; "other" is the step's rest (sampling's
    launches, pool bookkeeping). "eager forward" is a forward outside a graph (no graphs, on the CPU:
    the whole computation); "wait for the token" is the device's time not hidden behind the host's."""
    spent = {label: 0.0 for label, _, _ in PHASES}
    undo = []
    for label, path, name in PHASES:
        owner = eng
        for attr in filter(None, path.split(".")):
            owner = getattr(owner, attr, None)
        if owner is None:
            continue
        fn = getattr(owner, name)

        def timed(*a, _fn=fn, _label=label, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spent[_label] += time.perf_counter() - t0

        setattr(owner, name, timed)
        undo.append((owner, name))
    vocab = eng.model_config.vocab_size
    seq = eng.add_request([(3000 + i) % vocab for i in range(32)],
                          SamplingParams(max_new_tokens=steps + 9, temperature=0.0, ignore_eos=True))
    while len(seq.output_ids) < 8:  # prefill and the graph's capture, untimed
        eng.step()
    for k in spent:
        spent[k] = 0.0
    _sync()
    prof = None
    if cprofile:  # the host's functions by own time, printed after the table
        import cProfile

        prof = cProfile.Profile()
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    for _ in range(steps):
        eng.step()
    if prof is not None:
        prof.disable()
    _sync()
    total = time.perf_counter() - t0
    for owner, name in undo:
        delattr(owner, name)  # the class's method again
    while not seq.is_finished:
        eng.step()
    print(f"\nrank 0's host time per batch-1 decode step ({steps} steps, ms):")
    print("| phase | ms/step |\n|---|---|")
    for label, v in spent.items():
        print(f"| {label} | {v / steps * 1e3:.3f} |")
    print(f"| other | {(total - sum(spent.values())) / steps * 1e3:.3f} |")
    print(f"| **step** | **{total / steps * 1e3:.3f}** |")
    rt = eng.pools.experts.read_through if eng.pools.experts is not None else None
    if rt is not None and hasattr(rt, "early_collects"):
        print(f"(read-through steps that collected the step before first, short of spares: {rt.early_collects} "
              "since the engine started)")
    if prof is not None:
        import pstats

        print(f"\nrank 0's host functions over those {steps} steps (cProfile: inflated, read the order):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def table(rows) -> None:
    one = {b: t for tp, _, b, _, _, t, _ in rows if tp == 1}
    print("\n| GPUs | all-reduce | batch | expert slots per rank | hit rate (rank 0) | tok/s (total) | vs one GPU | "
          "control ms/message |")
    print("|---|---|---|---|---|---|---|---|")
    for tp, path, b, slots, hit, tok_s, control_ms in rows:
        ratio = f"{tok_s / one[b]:.3f}x" if one.get(b) else "-"
        print(f"| {tp} | {path} | {b} | {', '.join(f'{s:,}' for s in slots)} | {hit:.1%} | {tok_s:.1f} | {ratio} | "
              f"{control_ms:.3f} |")


def live(args, model_json: Path, tp: int, batch: int) -> None:
    """A ladder move up, a manual expert resize and a move back down while `batch` requests decode."""
    eng = Engine(EngineConfig(model=f"synthetic:{model_json}", device=args.device,
                              dtype="bfloat16" if args.device == "cuda" else "float32", moe_backend="offload",
                              gpu_memory_limit=args.card, enable_kv_ladder=True, ladder_step_size=args.kv // 2,
                              max_running_requests=batch, max_prefill_length=1024, cuda_graph_max_bs=batch,
                              tensor_parallel_size=tp, enable_prefix_cache=False))  # both runs prefill alike
    rows, ok = [], True
    try:
        eng.ladder.auto = False
        home = eng.ladder.rungs.index(args.kv)
        eng.move_ladder(home, "bench: the live run's home rung")
        run_live(eng, batch, 8, {}, {})  # compiles and captures outside the timed runs
        calm, calm_s = run_live(eng, batch, args.live, {}, {})
        moe = eng.pools.experts.num_slots
        at = args.live // 4
        cut = min(256, moe // 4)
        moves = {at: ("ladder up", lambda: eng.move_ladder("up", "bench: under load")),
                 2 * at: (f"resize moe -{cut}", lambda: eng.cache.rebuild(moe=eng.pools.experts.num_slots - cut,
                                                                          reason="bench: under load")),
                 3 * at: ("ladder down", lambda: eng.move_ladder(home, "bench: under load"))}
        done: dict = {}
        busy, busy_s = run_live(eng, batch, args.live, moves, done)
        for name, entry, seconds in done.values():
            peaks = ", ".join(f"{r['peak_bytes'] / 2**30:.2f}" for r in entry.get("ranks", [])) or \
                f"{entry.get('measured_peak_bytes', 0) / 2**30:.2f}"
            rows.append((name, entry["status"], entry["from"], entry["to"], seconds * 1e3, peaks))
        equal = calm == busy
        ok = equal and all(r[1] == "ok" for r in rows) and len(rows) == len(moves)
        n = batch * args.live
        print(f"\nlive: tp {tp} ({eng.tp.all_reduce_path if eng.tp else '-'} all-reduce), batch {batch}, {args.live} tokens each, expert slots {moe:,} at the "
              f"{args.kv:,} rung; undisturbed {n / calm_s:.1f} tok/s, with the rebuilds {n / busy_s:.1f} tok/s; "
              f"tokens equal: {equal}")
    finally:
        eng.close()
    print("\n| under load | status | from (moe, kv, mamba) | to | ms (rank 0, whole rebuild) | measured peak per rank GiB |")
    print("|---|---|---|---|---|---|")
    for name, status, frm, to, ms, peaks in rows:
        print(f"| {name} | {status} | {_sizes(frm)} | {_sizes(to)} | {ms:.0f} | {peaks} |")
    if not ok:
        raise SystemExit("live: a rebuild failed or the tokens differ")


def _sizes(g: dict) -> str:
    return f"{g['moe']:,}, {g['kv']:,}, {g['mamba']}"


def run_live(eng: Engine, batch: int, tokens: int, moves: dict, done: dict):
    """`batch` greedy requests of `tokens` tokens; moves[k] = (name, fn) runs when the first request has k
    tokens (its entry and wall time into done[k]). Returns (each request's tokens, seconds)."""
    vocab = eng.model_config.vocab_size
    if eng.runner.routing is not None:  # the same traces for the same requests: a trace is seeded by arrival order
        eng.runner.routing._order = itertools.count(10_000)
    seqs = [eng.add_request([(2000 + 41 * r + i) % vocab for i in range(32)],
                            SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True))
            for r in range(batch)]
    _sync()
    t0 = time.perf_counter()
    while not all(s.is_finished for s in seqs):
        k = len(seqs[0].output_ids)
        if k in moves and k not in done:
            name, fn = moves[k]
            r0 = time.perf_counter()
            entry = fn()
            done[k] = (name, entry, time.perf_counter() - r0)
        eng.step()
    _sync()
    failed = [s.error for s in seqs if getattr(s, "error", None)]
    if failed:
        raise SystemExit(f"live: a request failed: {failed[0]}")
    return [list(s.output_ids) for s in seqs], time.perf_counter() - t0


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
