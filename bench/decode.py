"""Flagship decode speed, all experts resident, eager and under CUDA graphs. Not a test.

    PYTHONPATH=. python3 bench/decode.py [--tokens 64] [--batches 1,8] [--profile STEPS] [--gpu-time STEPS] [--ncu-window STEPS]
                                         [--replay-span REPLAYS]
                                         [--context 32,131072] [--kv-cache-dtype nvfp4] [--modes graphs]

Synthetic NVFP4 Qwen3-Next-80B-A3B on the GPU (`bench/configs/qwen3-next-80b-a3b.json`), the
resident MoE backend (every expert in a device slot: no host traffic), greedy decode at each
batch size after a short prompt, first eagerly then replaying CUDA graphs (same engine, same
run). Reports tokens/s and the ratio to the roofline: the bytes one step must read
(`bytes_per_step`) at 4.3 TB/s. `--context` sets the prompt lengths (decode after a long prefill:
each step reads the whole KV of its sequence), `--kv-cache-dtype` the KV cache's dtype. Each row times
`--tokens` decode steps with every sequence of the batch running (all prompts prefilled first; the rows
prefilled first keep decoding meanwhile, with a margin of steps so that none ends in the timed ones).
Prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.variant_args import DEFINE_HELP, define_variants  # noqa: E402
from ft.kernels.options import DEFAULTS, VARIANTS, kernel_options, set_kernel_options, variant  # noqa: E402
from ft.engine.core.engine import Engine  # noqa: E402
from ft.engine.base.engine_config import EngineConfig  # noqa: E402
from ft.engine.base.sampling_params import SamplingParams  # noqa: E402

COPY_BW = 4.3e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="bench/configs/qwen3-next-80b-a3b.json")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8", help="decode batch sizes to time")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after the timed runs, profile this many decode steps (torch.profiler) and print the top ops")
    ap.add_argument("--context", default="32", help="prompt lengths (tokens before decode starts)")
    ap.add_argument("--kv-cache-dtype", default="bf16", choices=("bf16", "fp8", "nvfp4"))
    ap.add_argument("--modes", default="eager,graphs", help="eager, graphs (both with overlapped decode off), overlap (graphs with overlapped decode, the "
                         "default on CUDA), pdl (overlap with every kernel launched with "
                         "programmatic dependent launch, variant pdl; graphs and overlap keep the engine's default, "
                         "PDL inside the decode graphs where the model chooses it, Qwen3.8-Flash-Next, and MODE:no-pdl "
                         "launches none with it; see ft.kernels.pdl); a list, repeats allowed (an A/B in one process); "
                         "MODE:VARIANT runs MODE with a named kernel variant on top (graphs captured again), e.g. "
                         "graphs,graphs:nvfp4-lanes-triton,graphs,graphs:nvfp4-lanes-triton")
    ap.add_argument("--attention-programs", type=int, default=0, metavar="N",
                    help="split-K decode attention: aim at N programs (DecodeAttentionOptions.split_target_programs; max_splits raised to "
                         "match) instead of the library default")
    ap.add_argument("--combine-block-d", type=int, default=0, metavar="N",
                    help="the split-K decode attention's combine: N columns per program (DecodeAttentionOptions.combine_block_d; default "
                         "the library's)")
    ap.add_argument("--prmt", type=int, default=0, metavar="BLOCK_N",
                    help="the NVFP4 decode attention's byte-permute halves (NVFP4_PRMT, the default) at BLOCK_N keys a "
                         "step instead of the library's")
    ap.add_argument("--no-prmt", action="store_true",
                    help="the NVFP4 decode attention without the byte-permute halves (NVFP4_F16, the default before)")
    ap.add_argument("--no-halves", action="store_true",
                    help="the small-M NVFP4 tl.dot tile without the byte-permute halves (kernel variant nvfp4-dot-interleaved; the default "
                         "before)")
    ap.add_argument("--profile-context", default="32", metavar="N[,N...]",
                    help="--profile's prompt lengths (the decode steps profiled attend to N tokens), one profile each")
    ap.add_argument("--no-small-m-gemv", action="store_true",
                    help="M = 3..8 projections on the 16-row tl.dot tile everywhere (kernel variant nvfp4-tile-small-m)")
    ap.add_argument("--pdl", action="store_true",
                    help="launch every kernel with programmatic dependent launch (kernel variant pdl)")
    ap.add_argument("--no-lanes-ptx", action="store_true",
                    help="the whole-K GEMV / decode MoE tiles decode words in Triton, not inline PTX (kernel variant nvfp4-lanes-triton)")
    ap.add_argument("--ngram-table", default="auto", choices=("auto", "host", "disk"),
                    help="Qwen3.8-Flash-Next's n-gram table in pinned host memory or read from disk by the host each "
                         "step (--ngram-table of ft serve; a process per choice for an A/B)")
    ap.add_argument("--memory-ratio", type=float, default=None,
                    help="--memory-ratio of ft serve: the share of the free memory after the weights the pools and "
                         "the reserve may take (default: the engine's headroom rule); e.g. 0.97 fits Qwen3.8-Flash-"
                         "Next's 48 layers resident on an 80 GB card")
    ap.add_argument("--overlap-decode", action=argparse.BooleanOptionalAction, default=True,
                    help="the profiles (--profile, --cprofile) with overlapped decode (EngineConfig.overlap_decode); "
                         "default on, as the engine's default on CUDA")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME",
                    help="a named kernel variant (ft.kernels.options.VARIANTS, e.g. moe-decode-per-pair); repeatable")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=JSON",
                    help="for --modes' MODE:NAME, " + DEFINE_HELP
                    + ", e.g. gu='{\"moe.decode_gate_up_two_tiles\": [4, 0, 2]}'")
    ap.add_argument("--gpu-time", type=int, default=0, metavar="STEPS",
                    help="after each mode's timed run at each batch, profile this many decode steps (CUDA activity "
                         "only) and add the GPU's busy ms a step to the table, with each mode's largest per-kernel "
                         "changes against the first mode: an A/B of kernel variants that the host's jitter does "
                         "not blur (tok/s moves 2-4%% between rounds of one process)")
    ap.add_argument("--replay-span", type=int, default=0, metavar="REPLAYS",
                    help="after each graph mode's timed run at each batch, replay the batch's decode graph this many "
                         "times back to back between two CUDA events and add its ms a replay to the table: the "
                         "device's step with the launch gaps inside the graph but none of the host's (the A/B for "
                         "PDL, which GPU busy time cannot judge: a kernel's time then includes its wait)")
    ap.add_argument("--ncu-window", type=int, default=0, metavar="STEPS",
                    help="after the timed runs, run this many decode steps at each batch (context --profile-context's "
                         "first) between cudaProfilerStart and Stop, for `ncu --profile-from-start off`: the kernels "
                         "of those steps only (bench/ncu_kernels.py sums them)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="STEPS",
                    help="after the timed runs, run this many decode steps under cProfile at each --profile-context "
                         "length and print the host functions by own time (what a step's host work grows with)")
    ap.add_argument("--prmt-maxnreg", type=int, default=-1, metavar="R",
                    help="hold the NVFP4 split-K decode attention to R registers a thread when its grid holds more "
                         "than two programs an SM (DecodeAttentionOptions.prmt_maxnreg; 0 off); pair it with --attention-programs")
    ap.add_argument("--prmt-programs-per-sm", type=int, default=-1, metavar="P",
                    help="the NVFP4 decode attention's split count aims at P programs an SM (DecodeAttentionOptions.prmt_programs_per_sm; "
                         "0: the split rule's own target)")
    ap.add_argument("--prmt-warps", type=int, default=0, metavar="W",
                    help="warps per program of the NVFP4 decode attention (DecodeAttentionOptions.prmt_warps) instead of the library's")
    ap.add_argument("--prmt-stages", type=int, default=0, metavar="S",
                    help="the byte-permute halves' pipeline stages (DecodeAttentionOptions.prmt_stages) instead of the library's")
    args = ap.parse_args()
    define_variants(args.define)
    att = DEFAULTS.decode_attention
    changes = {key: value for key, value, given in (
        ("decode_attention.prmt_programs_per_sm", args.prmt_programs_per_sm, args.prmt_programs_per_sm >= 0),
        ("decode_attention.prmt_warps", args.prmt_warps, bool(args.prmt_warps)),
        ("decode_attention.prmt_maxnreg", args.prmt_maxnreg, args.prmt_maxnreg >= 0),
        ("decode_attention.prmt_stages", args.prmt_stages, bool(args.prmt_stages)),
        ("decode_attention.nvfp4_prmt", not args.no_prmt, bool(args.prmt or args.no_prmt)),
        ("decode_attention.prmt_block_n", args.prmt or att.prmt_block_n, bool(args.prmt)),
        ("decode_attention.combine_block_d", args.combine_block_d, bool(args.combine_block_d)),
        ("decode_attention.split_target_programs", args.attention_programs, bool(args.attention_programs)),
        ("decode_attention.max_splits", max(att.max_splits, args.attention_programs // 2), bool(args.attention_programs)),
    ) if given}
    flagged = [name for flag, name in ((args.no_small_m_gemv, "nvfp4-tile-small-m"), (args.pdl, "pdl"),
                                       (args.no_lanes_ptx, "nvfp4-lanes-triton"),
                                       (args.no_halves, "nvfp4-dot-interleaved")) if flag]
    set_kernel_options(variant(*flagged, *args.variant, **changes))
    base_options = kernel_options()
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m.split(":")[0] not in ("eager", "graphs", "overlap", "pdl")
           or any(v not in VARIANTS for v in m.split(":")[1:])]
    if not contexts or min(contexts) < 1 or not modes or bad:
        raise SystemExit("--context takes positive lengths, --modes eager, graphs, overlap and/or pdl (repeats allowed), "
                         f"each optionally :VARIANT[:VARIANT] (ft.kernels.options.VARIANTS); got {bad or modes}")
    t0 = time.perf_counter()
    chunk = 4096 if max(contexts) > 1024 else 1024
    # (each row's KV: its prompt, the timed steps, the warm steps and the margin `started_batch` gives it)
    row_tokens = max(contexts) + args.tokens + 64 + prefill_margin(max(batches), max(contexts), chunk)
    eng = Engine(EngineConfig(model=f"synthetic:{args.config}", device="cuda", dtype="bfloat16",
                              moe_backend="resident",
                              num_tokens=max(16384, row_tokens * max(batches)),
                              mamba_cache_size=2 * max(batches), max_running_requests=max(batches),
                              max_prefill_length=chunk,
                              cuda_graph_max_bs=max(batches), kv_cache_dtype=args.kv_cache_dtype,
                              overlap_decode=args.overlap_decode, ngram_table=args.ngram_table,
                              memory_ratio=args.memory_ratio))
    print(f"engine up in {time.perf_counter() - t0:.1f} s, geometry {eng.cache.geometry}", flush=True)
    graphs = eng.runner.graphs
    rows = []
    for ctx in contexts:
        vocab = eng.model_config.vocab_size
        prompt = [(1000 + j) % vocab for j in range(ctx)]  # any config's vocabulary (the flagship's: the same ids)
        for spec in modes:
            # "overlap": graphs with overlapped decode, switched on this engine (an A/B in one process);
            # "pdl": overlap with every launch PDL (variant "pdl", the graphs captured again);
            # "MODE:VARIANT": MODE with a named kernel variant on top of the flags' options (captured again)
            mode, *extra = spec.split(":")
            set_variants(graphs, base_options, extra + (["pdl"] if mode == "pdl" else []))
            eng.runner.graphs = graphs if mode in ("graphs", "overlap", "pdl") else None
            eng.config = dataclasses.replace(eng.config, overlap_decode=mode in ("overlap", "pdl"))
            for b in batches:
                tok_s, step_ms = timed_decode(eng, prompt, b, args.tokens)
                roof = COPY_BW / bytes_per_step(eng, b, len(prompt) + args.tokens) * b
                gpu = gpu_step_time(eng, prompt, b, args.gpu_time) if args.gpu_time else None
                span = replay_span_ms(eng, prompt, b, args.replay_span) \
                    if args.replay_span and eng.runner.graphs is not None else None
                rows.append((ctx, spec, b, tok_s, step_ms, roof, gpu, span))
                print(f"context {ctx} {spec} batch {b}: {tok_s:.1f} tok/s"
                      + (f", GPU busy {gpu[0]:.3f} ms a step" if gpu else "")
                      + (f", {span:.3f} ms a replay" if span is not None else ""), flush=True)
    set_variants(graphs, base_options, [])
    eng.runner.graphs = graphs
    eng.config = dataclasses.replace(eng.config, overlap_decode=args.overlap_decode)
    if args.profile:
        for n in (int(c) for c in args.profile_context.split(",")):
            for b in batches:
                print(f"\n== profile: context {n}, batch {b}")
                profile_steps(eng, [(1000 + j) % eng.model_config.vocab_size for j in range(n)], args.profile, b)
    if args.ncu_window:
        n = int(args.profile_context.split(",")[0])
        for b in batches:
            ncu_window_steps(eng, [(1000 + j) % eng.model_config.vocab_size for j in range(n)], args.ncu_window, b)
    if args.cprofile:
        for n in (int(c) for c in args.profile_context.split(",")):
            print(f"\n== cProfile: context {n}, batch {batches[0]}")
            host_profile_steps(eng, [(1000 + j) % eng.model_config.vocab_size for j in range(n)], args.cprofile,
                               batches[0])
    if graphs is None:  # (a model whose steps are not captured yet: Qwen3.8-Flash-Next)
        print(f"\nno decode graphs ({eng.model_config.architecture} runs eagerly); overlapped decode steps "
              f"{eng.overlapped_steps}")
    else:
        print(f"\ngraphs captured {graphs.captures} ({graphs.capture_s:.2f} s), replayed {graphs.replays}; "
              f"overlapped decode steps {eng.overlapped_steps}")
    if graphs is not None and graphs.disabled:
        print(f"decode graphs were turned off: {graphs.disabled}")
    print(f"kv cache dtype: {args.kv_cache_dtype}; split-K decode attention aims at "
          f"{kernel_options().decode_attention.split_target_programs} programs, at most "
          f"{kernel_options().decode_attention.max_splits} splits")
    label = Path(args.config).stem.removesuffix(".json") + " (syn.)"
    mw = max([7] + [len(m) for m in modes])
    if args.gpu_time:
        print_kernel_changes(rows)
    gpu_cols = f" {'GPU busy ms':>11} {'kernels':>7}" if args.gpu_time else ""
    gpu_cols += f" {'replay ms':>9}" if args.replay_span else ""
    print(f"\n{'model':<26} {'context':>8} {'mode':<{mw}} {'batch':>5} {'tok/s':>9} {'ms/step':>8} {'roofline tok/s':>14} "
          f"{'ratio':>7}{gpu_cols}")
    for ctx, mode, b, tok_s, step_ms, roof, gpu, span in rows:
        extra = f" {gpu[0]:>11.3f} {gpu[1]:>7.0f}" if gpu else (f" {'':>11} {'':>7}" if args.gpu_time else "")
        extra += (f" {span:>9.3f}" if span is not None else f" {'-':>9}") if args.replay_span else ""
        print(f"{label:<26} {ctx:>8} {mode:<{mw}} {b:>5} {tok_s:>9.2f} {step_ms:>8.2f} {roof:>14.0f} "
              f"{tok_s / roof:>7.2%}{extra}")


def set_variants(graphs, base, names: list[str]) -> None:
    """The kernel options `base` with the named variants on top, for the next launches; the decode graphs
    are captured again when they change (a graph keeps the launches it captured)."""
    want = base.with_(**{k: v for name in names for k, v in VARIANTS[name].items()})
    if want != kernel_options():
        set_kernel_options(want)
        if graphs is not None:
            graphs.invalidate()


def timed_decode(eng, prompt: list[int], batch: int, tokens: int) -> tuple[float, float]:
    """(tokens/s over the batch, ms per step) of `tokens` greedy decode steps with every row running, after each
    request's first tokens (`started_batch`: a long prompt's prefill does not end in the timed steps, nor do its
    early rows finish there)."""
    seqs = started_batch(eng, prompt, batch, tokens)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(tokens):
        eng.step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t1
    running = sum(not s.is_finished for s in seqs)
    eng.run_until_done(seqs)
    if running < batch:
        raise RuntimeError(f"timed_decode: {batch - running} of {batch} rows finished inside the timed steps")
    return batch * tokens / dt, dt / max(1, tokens) * 1e3


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

    seqs = started_batch(eng, prompt, batch, steps)
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
    gpu = sorted(((e.self_device_time_total / steps, e.key) for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA), reverse=True)
    print("GPU us per step by kernel: " + ", ".join(f"{name[:40]} {us:.1f}" for us, name in gpu[:14]))
    span, busy, exposed = gpu_timeline(prof)
    print(f"GPU timeline: {span / steps / 1e3:.3f} ms a step, kernels busy {busy / steps / 1e3:.3f}, idle "
          f"{(span - busy) / steps / 1e3:.3f} ms, of which in gaps over {IDLE_GAP_US} us (nothing queued: the "
          f"host's time on the critical path) {exposed / steps / 1e3:.3f} ms")
    print(events.table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60))
    print(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60))
    eng.run_until_done(seqs)


def ncu_window_steps(eng, prompt, steps: int, batch: int) -> None:
    """`steps` decode steps of `batch` fresh sequences between cudaProfilerStart and cudaProfilerStop (what `ncu
    --profile-from-start off` profiles), the bucket's graph captured or its kernels warm before."""
    seqs = started_batch(eng, prompt, batch, steps)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    eng.run_until_done(seqs)


def gpu_step_time(eng, prompt, batch: int, steps: int) -> tuple[float, float, dict[str, float]]:
    """(GPU busy ms a step: the union of the kernels' intervals, kernels a step, {kernel: us a step}) over
    `steps` decode steps of `batch` fresh sequences under torch.profiler (CUDA activity only), after
    two steps that capture or warm the bucket's graph."""
    from torch.profiler import ProfilerActivity, profile

    seqs = started_batch(eng, prompt, batch, steps)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    cuda = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_kernel = {e.key: e.self_device_time_total / steps for e in cuda}
    _, busy, _ = gpu_timeline(prof)
    eng.run_until_done(seqs)
    return busy / steps / 1e3, sum(e.count for e in cuda) / steps, per_kernel


def prefill_margin(batch: int, context: int, chunk: int) -> int:
    """Decode steps a batch's early rows may take while its later rows' prompts prefill (`batch` prompts of
    `context` tokens in chunks of at most `chunk`, twice over for steps whose chunk is cut by running
    decodes), and 8 more."""
    return 2 * -(-batch * context // chunk) + 8


def started_batch(eng, prompt, batch: int, steps: int) -> list:
    """`batch` fresh greedy sequences (the prompt's ids shifted by the row) stepped until each has three tokens
    (the bucket's graph captured or its kernels warm), each then with at least `steps` steps left: the rows
    prefilled first decode while the others' prompts prefill, and a margin (`prefill_margin`) keeps them running
    through the steps the caller times, so those steps hold the whole batch."""
    margin = prefill_margin(batch, len(prompt), eng.config.max_prefill_length)
    seqs = [eng.add_request([t + i for t in prompt], SamplingParams(max_new_tokens=steps + 3 + margin,
                                                                    temperature=0.0, ignore_eos=True))
            for i in range(batch)]
    while any(len(s.output_ids) < 3 for s in seqs):
        eng.step()
    return seqs


def replay_span_ms(eng, prompt, batch: int, replays: int) -> float | None:
    """ms a replay of the decode graph of `batch` fresh sequences' bucket, replayed `replays` times back to back
    between two CUDA events after two steps that capture it (None: no graph for it, e.g. the capture failed).
    Each replay reruns the step on the buffers as they are (its sequences' states move on; they are dropped
    after), so this times the device alone: the graph's kernels and the launch gaps inside it."""
    seqs = started_batch(eng, prompt, batch, 8)
    graphs = eng.runner.graphs
    bucket = graphs.bucket(batch)
    graph = graphs.graph(bucket) if bucket is not None else None
    span = None
    # a paged n-gram table's gated rows (`RowsBuffer.gate`): each replay waits for the host to let it go
    gated = eng.runner.ngram_rows if eng.runner.ngram_rows is not None and eng.runner.ngram_rows.gated else None
    if graph is not None:
        torch.cuda.synchronize()
        graph.replay()  # (one untimed: the first replay after a capture uploads the graph)
        if gated is not None:
            gated.release(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        if gated is not None:  # (the replays are queued: each is let go once the one before passed its gate)
            gated.release(replays)
        torch.cuda.synchronize()
        span = start.elapsed_time(end) / replays
    eng.run_until_done(seqs)
    return span


def print_kernel_changes(rows: list, top: int = 6) -> None:
    """For each row with GPU times, the kernels whose us a step moved most against the first mode's row
    at the same context and batch."""
    first: dict[tuple[int, int], tuple] = {}
    for ctx, mode, b, *_, gpu, _span in rows:
        if gpu is None:
            continue
        base = first.setdefault((ctx, b), (mode, gpu))
        if base[0] == mode and base[1] is gpu:
            continue
        names = set(gpu[2]) | set(base[1][2])
        moved = sorted(((gpu[2].get(k, 0.0) - base[1][2].get(k, 0.0), k) for k in names), key=lambda d: -abs(d[0]))
        print(f"context {ctx} batch {b}, {mode} against {base[0]}: GPU busy {gpu[0] - base[1][0]:+.3f} ms a step; "
              + ", ".join(f"{k[:36]} {d:+.1f} us" for d, k in moved[:top]))


IDLE_GAP_US = 5.0
"""Gaps between kernels longer than this (us) count as the device waiting on the host; inside a
graph replay consecutive kernels start ~1-2 us apart."""


def gpu_timeline(prof) -> tuple[float, float, float]:
    """(span, busy, exposed) in us over a profile's CUDA kernels: first start to last end, the union
    of the kernels' intervals, and the sum of the idle gaps longer than `IDLE_GAP_US`."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return 0.0, 0.0, 0.0
    busy = exposed = 0.0
    end = spans[0][0]
    for a, b in spans:
        if a - end > IDLE_GAP_US:
            exposed += a - end
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return end - spans[0][0], busy, exposed


def host_profile_steps(eng, prompt, steps: int, batch: int = 1) -> None:
    """The host side of `steps` decode steps under cProfile: the 16 functions with the most own time
    (per step, us), and the steps' wall time with and without the profiler's overhead."""
    import cProfile
    import pstats

    seqs = started_batch(eng, prompt, batch, 2 * steps + 2)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    plain = (time.perf_counter() - t0) / steps * 1e3
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    prof.disable()
    profiled = (time.perf_counter() - t0) / steps * 1e3
    print(f"{steps} steps: {plain:.3f} ms a step, {profiled:.3f} ms under cProfile")
    stats = pstats.Stats(prof)
    rows = sorted(((tt, nc, f"{fn[0].rsplit('/', 1)[-1]}:{fn[1]}:{fn[2]}") for fn, (_, nc, tt, _, _) in
                   stats.stats.items()), reverse=True)[:16]
    for tt, nc, name in rows:
        print(f"  {tt / steps * 1e6:9.1f} us/step {nc / steps:7.1f} calls/step  {name}")
    eng.run_until_done(seqs)


if __name__ == "__main__":
    main()
