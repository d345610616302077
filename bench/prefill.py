"""Flagship prefill speed and time to first token, all experts resident. Not a test.

    PYTHONPATH=. python3 bench/prefill.py [--lengths 1024,4096,16384] [--chunk 4096]
                                          [--profile 4096] [--attention both|triton|reference]

Synthetic NVFP4 Qwen3-Next-80B-A3B on the GPU (`bench/configs/qwen3-next-80b-a3b.json`), the
resident MoE backend, one request at a time with a prompt of each length (distinct token ids per
run, so the prefix cache never helps) and `max_new_tokens=1`: the time from `add_request` to the
first token is the time to first token (TTFT), and length / TTFT the prefill throughput. Each
length runs once to warm (Triton compiles, allocator), then `--repeat` timed runs (the median);
with `--warm LEN` one LEN-token prompt warms instead (for 256K prompts, whose warm run would
double the bench).

`--attention both` times every length with the reference prefill attention and with the Triton
kernel in the same run (before / after). `--profile LEN` profiles one prefill of LEN tokens
(torch.profiler) and prints GPU time per kernel family, then the copies' and casts' GPU time by the
line of `ft/` that asked for them (the ATen op, its input shapes, the two innermost `ft/`
frames above it). Each timed length runs once more to read the caching allocator's peak over what it held before
(the "transient MiB" column: the forward's activations and workspaces), printed beside the engine's activation
reserve, which should hold it. Prints a table last.

`--decoding N` keeps N requests decoding (prompts of `--decoding-context` tokens, started once each length has
been timed alone: the table's "alone" rows, so that one run says what the decoding rows add) beside every
timed prompt: each prefill chunk then runs as a mixed step with N decoding rows, as in a server under load
(issue 40's c32 8K / 1K row). `--decoding-rows-as batch|prefills|both`: those rows as one
decode batch in the attention and Gated DeltaNet layers (the default) or each as a one-token prefill (the
former path).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ft.kernels.attention as attention  # noqa: E402
from bench.variant_args import DEFINE_HELP, define_variants  # noqa: E402
from ft.engine.core.engine import Engine  # noqa: E402
from ft.engine.base.engine_config import EngineConfig  # noqa: E402
from ft.engine.base.sampling_params import SamplingParams  # noqa: E402

# kernel-name fragments -> family, first match wins (names of Triton kernels and torch's ATen kernels)
FAMILIES = [
    # ("prefill_kernel": the Triton attention's, whose "fill" would count it a copy below)
    ("moe", ("moe", "expert", "grouped", "slot")), ("attention", ("attn", "attention", "flash", "prefill_kernel")),
    ("gated delta", ("delta", "gdn", "chunk")), ("conv1d", ("conv",)),
    ("gemm / gemv", ("gemm", "gemv", "nvfp4", "dense", "matmul", "mm_", "cutlass", "sm90_xmma", "nvjet")),
    ("norm / rope", ("norm", "rope", "rms")), ("copies / casts", ("copy", "cast", "fill", "cat", "index")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "softmax", "exp", "mul", "add")),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="bench/configs/qwen3-next-80b-a3b.json")
    ap.add_argument("--lengths", default="1024,4096,16384", help="prompt lengths to time")
    ap.add_argument("--chunk", type=int, default=4096, help="tokens per prefill chunk (--max-prefill-length)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--attention", default="both", choices=["both", "triton", "reference"])
    ap.add_argument("--profile", type=int, default=0, metavar="LEN", help="profile one prefill of LEN tokens")
    ap.add_argument("--kv-cache-dtype", default="bf16")
    ap.add_argument("--warm", type=int, default=0, metavar="LEN",
                    help="warm once with a LEN-token prompt before all lengths (default: each length warms itself)")
    ap.add_argument("--grouped-configs", default="", metavar="CFG;CFG",
                    help="time the lengths once per grouped-MoE tile, e.g. '64,64,64,4,4;32,64,128,4,3,1' (BLOCK_M, "
                         "BLOCK_N, BLOCK_K, warps, stages[, SWAP_AB]) for every pass; default: the library's choice by pass "
                         "length (grouped_config_for)")
    ap.add_argument("--moe-bytes", action="store_true",
                    help="the grouped MoE's byte-wise weight decode (variant moe-bytes) instead of the library's "
                         "default, the word decode (until session 30 this bench ran the byte decode unless given "
                         "--moe-words)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME",
                    help="a named kernel variant (ft.kernels.options.VARIANTS) for the whole run, e.g. "
                         "qsa-prefill-select-torch, or one --define names; repeatable")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=JSON",
                    help="for --variant NAME, " + DEFINE_HELP + ", e.g. t64='{\"qsa.one_split_tile\": [64, 4, 3]}'")
    ap.add_argument("--library", default="on", choices=["on", "off", "both"],
                    help="long-prefix chunks on cuDNN (PrefillAttentionOptions.library_on_cuda); both: off, then on")
    ap.add_argument("--host-profile", type=int, default=0, metavar="LEN",
                    help="cProfile one prefill of LEN tokens (the host's side: where the Python time goes)")
    ap.add_argument("--prefill-graph-max-tokens", type=int, default=None, metavar="N",
                    help="one-request prefills up to N tokens replay CUDA graphs (0: off; default: the engine's)")
    ap.add_argument("--grouped-max-tokens", default="", metavar="N[,N...]",
                    help="time the lengths once per grouped-MoE pass length (MoeOptions.grouped_max_tokens: "
                         "a chunk's pairs in passes of at most N tokens; default: the library's)")
    ap.add_argument("--spin-up", type=float, default=3.0, metavar="S",
                    help="seconds of prefills before anything is timed (default 3)")
    ap.add_argument("--decoding", type=int, default=0, metavar="N",
                    help="requests decoding beside every timed prompt (each chunk a mixed step with N decode rows)")
    ap.add_argument("--decoding-context", type=int, default=8192, metavar="C",
                    help="prompt tokens of each decoding request (--decoding; default 8192)")
    ap.add_argument("--decoding-rows-as", default="batch", choices=["batch", "prefills", "both"],
                    help="the decoding rows of a mixed step as one decode batch (the engine's way) or each as a "
                         "one-token prefill (the former path); both: each length under both, one process")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    from ft.kernels.options import kernel_options, set_kernel_options, variant

    define_variants(args.define)
    set_kernel_options(variant(*(["moe-bytes"] if args.moe_bytes else []), *args.variant))
    grouped = [tuple(int(v) for v in c.split(",")) for c in args.grouped_configs.split(";") if c.strip()] or [None]
    pass_tokens = [int(v) for v in args.grouped_max_tokens.split(",") if v.strip()] or [None]
    t0 = time.perf_counter()
    decoding_tokens = args.decoding * (args.decoding_context + DECODE_STEPS_AT_MOST)
    eng = Engine(EngineConfig(model=f"synthetic:{args.config}", device="cuda", dtype="bfloat16",
                              moe_backend="resident", num_tokens=max(lengths + [args.profile]) + 1024 + decoding_tokens,
                              mamba_cache_size=4 + args.decoding, max_running_requests=1 + args.decoding,
                              max_prefill_length=args.chunk,
                              enable_prefix_cache=False, kv_cache_dtype=args.kv_cache_dtype,
                              **({} if args.prefill_graph_max_tokens is None else
                                 {"prefill_graph_max_tokens": args.prefill_graph_max_tokens})))
    print(f"engine up in {time.perf_counter() - t0:.1f} s, geometry {eng.cache.geometry}", flush=True)
    modes = ["reference", "triton"] if args.attention == "both" else [args.attention]
    rows, base = [], [0]
    peaks: dict[tuple[str, int], int] = {}  # (label, prompt): the caching allocator's peak over what it held before
    row_forms = {"batch": [True], "prefills": [False], "both": [False, True]}[args.decoding_rows_as] \
        if args.decoding else [True]
    # the GPU's clocks: right after the engine's build (tens of seconds of host work) the first
    # length timed slow twice in one session (1K: 155 and 182 ms against 103-112 later); keep the
    # device busy for a while before anything is timed
    t_busy = time.perf_counter()
    while time.perf_counter() - t_busy < args.spin_up:
        ttft(eng, min(lengths), base)
    if args.decoding:  # each length alone first, in this process: what the decoding rows add to a chunk
        set_kernel_options(kernel_options().with_(**{"prefill_attention.triton_on_cuda": modes[-1] == "triton"}))
        for n in lengths:
            ttft(eng, n, base)  # warm
            t = statistics.median([ttft(eng, n, base) for _ in range(args.repeat)])
            rows.append((f"{modes[-1]} alone", n, t, n / t))
            print(f"{modes[-1]} alone {n}: TTFT {t * 1e3:.1f} ms, {n / t:,.0f} tok/s", flush=True)
    start_decoding(eng, args.decoding, args.decoding_context, base)
    libs = {"on": [True], "off": [False], "both": [False, True]}[args.library]
    library_pass = kernel_options().moe.grouped_max_tokens
    for mode, cfg, lib, gmt, as_batch in ((m, c, b, g, r) for m in modes for c in grouped for b in libs
                                          for g in pass_tokens for r in row_forms):
        eng.runner.mixed_decode_rows = as_batch
        set_kernel_options(kernel_options().with_(**{"prefill_attention.triton_on_cuda": mode == "triton",
                                                     "prefill_attention.library_on_cuda": lib,
                                                     "moe.grouped_tile": cfg,  # None: by the pass's length
                                                     "moe.grouped_max_tokens": gmt or library_pass}))
        label = (mode if cfg is None else f"{mode} {cfg}") + ("" if args.library != "both" else
                                                              " +cudnn prefix" if lib else " triton only")
        label += f" pass {gmt}" if gmt else ""
        label += "" if not args.decoding else f" +{args.decoding} decoding" + ("" if as_batch else " as prefills")
        if args.warm:
            ttft(eng, args.warm, base)
        for n in lengths:
            if not args.warm:
                ttft(eng, n, base)  # warm
            cpu: list[float] = []
            times = [ttft(eng, n, base, cpu) for _ in range(args.repeat)]
            t = statistics.median(times)
            rows.append((label, n, t, n / t))
            peaks[label, n] = transient_peak(eng, n, base)
            each = ", ".join(f"{w * 1e3:.1f}/{c * 1e3:.1f}" for w, c in zip(times, cpu))
            print(f"{label} {n}: TTFT {t * 1e3:.1f} ms, {n / t:,.0f} tok/s (each run wall/process CPU ms: {each}); "
                  f"transient peak {peaks[label, n] / 2**20:,.0f} MiB", flush=True)
    last = kernel_options().with_(**{"prefill_attention.triton_on_cuda": modes[-1] == "triton", "moe.grouped_tile": None,
                                     "moe.grouped_max_tokens": pass_tokens[-1] or library_pass})
    if args.host_profile:
        set_kernel_options(last)
        host_profile_prefill(eng, args.host_profile, base)
    if args.profile:
        set_kernel_options(last)
        profile_prefill(eng, args.profile, base)
    warm = f"warmed with {args.warm} tokens" if args.warm else "each length warmed once"
    pg = eng.runner.prefill_graphs
    print("\nprefill graphs: " + ("off" if pg is None else f"buckets up to {pg.buckets[-1]} tokens, {pg.captures} "
                                   f"captured in {pg.capture_s:.2f} s, {pg.replays} replays, "
                                   f"{pg.reserved_bytes / 2**20:.0f} MiB reserved by the captures against "
                                   f"{eng.prefill_graph_reserve / 2**20:.0f} MiB set aside for them"
                                   + (f", DISABLED: {pg.disabled}" if pg.disabled else "")))
    print(f"\nchunk {args.chunk} tokens, kv {args.kv_cache_dtype}, median of {args.repeat}, {warm}, cuDNN prefix "
          f"path {args.library} (from {attention.LIBRARY_GRANULE_KEYS} cached positions; refused: "
          f"{attention._library_refused[:1] or 'no'})")
    reserved_for = min(eng.config.max_prefill_length, eng.context_limit)
    print(f"activation reserve {eng.reserve / 2**20:,.0f} MiB (for {reserved_for} tokens); transient: the caching "
          "allocator's peak over a prompt's prefill, beside what it held before")
    print(f"{'attention [grouped MoE tile]':<40} {'prompt':>7} {'TTFT ms':>9} {'prefill tok/s':>14} "
          f"{'transient MiB':>14}")
    for mode, n, t, tps in rows:
        peak = f"{peaks[mode, n] / 2**20:,.0f}" if (mode, n) in peaks else "-"
        print(f"{mode:<40} {n:>7} {t * 1e3:>9.1f} {tps:>14,.0f} {peak:>14}")


def transient_peak(eng, n: int, base: list[int]) -> int:
    """Bytes the caching allocator held at most during one more prefill of `n` tokens beyond what it held before
    it (the forward's activations and workspaces, against `eng.reserve`)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ttft(eng, n, base)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


DECODE_STEPS_AT_MOST = 4096
"""KV tokens each `--decoding` request may grow by while the bench runs (it stops decoding there)."""


def start_decoding(eng, n: int, context: int, base: list[int]) -> None:
    """n requests with fresh `context`-token prompts, stepped until each decodes; they keep decoding (up to
    DECODE_STEPS_AT_MOST tokens) beside whatever the bench times next."""
    if not n:
        return
    vocab = eng.model_config.vocab_size
    seqs = []
    for _ in range(n):
        start = 1000 + base[0] % 50000
        base[0] += 7919
        prompt = [(start + i * 37) % min(150000, vocab - 10) + 10 for i in range(context)]
        seqs.append(eng.add_request(prompt, SamplingParams(max_new_tokens=DECODE_STEPS_AT_MOST, temperature=0.0,
                                                           ignore_eos=True)))
    t0 = time.perf_counter()
    while not all(s.output_ids for s in seqs):
        eng.step()
    print(f"{n} requests of {context} tokens decoding (prefilled in {time.perf_counter() - t0:.1f} s)", flush=True)


def ttft(eng, n: int, base: list[int], cpu: list[float] | None = None) -> float:
    """Seconds from add_request to the first token of a fresh n-token prompt; with `cpu`, appends the
    process's CPU seconds over the same span (all threads): close to the wall time, the prefill
    waits on the host (a short prompt); far below it, on the GPU."""
    start = 1000 + base[0] % 50000
    base[0] += 7919
    vocab = eng.model_config.vocab_size
    prompt = [(start + i * 31) % min(150000, vocab - 10) + 10 for i in range(n)]  # the flagship's ids as before
    torch.cuda.synchronize()
    c0 = time.process_time()
    t0 = time.perf_counter()
    seq = eng.add_request(prompt, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    while not seq.output_ids:
        eng.step()
    t = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    eng.run_until_done([seq])
    return t


def host_profile_prefill(eng, n: int, base: list[int]) -> None:
    """cProfile of one n-token prefill (after a warm one): the Python functions by own time and by
    cumulative time, so that a host-bound prefill shows which launches and which code cost it."""
    import cProfile
    import io
    import pstats

    ttft(eng, n, base)
    prof = cProfile.Profile()
    prof.enable()
    t = ttft(eng, n, base)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    print(f"\nhost profile of one {n}-token prefill (wall {t * 1e3:.1f} ms under cProfile)")
    print(out.getvalue())


def profile_prefill(eng, n: int, base: list[int]) -> None:
    from torch.profiler import ProfilerActivity, profile

    ttft(eng, n, base)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as prof:
        t = ttft(eng, n, base)
        torch.cuda.synchronize()
    events = prof.key_averages()
    cuda = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in cuda)
    fam: dict[str, float] = defaultdict(float)
    for e in cuda:
        name = e.key.lower()
        fam[next((f for f, keys in FAMILIES if any(k in name for k in keys)), "other")] += e.self_device_time_total
    print(f"\nprofile of one {n}-token prefill: wall {t * 1e3:.1f} ms, GPU {total / 1e3:.1f} ms, "
          f"{sum(e.count for e in cuda)} kernels")
    for f, us in sorted(fam.items(), key=lambda kv: -kv[1]):
        print(f"  {f:<16} {us / 1e3:>9.2f} ms {us / max(total, 1):>7.1%}")
    print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=70))
    print_copy_sites(prof.events(), total)


COPY_OPS = ("aten::copy_", "aten::cat", "aten::index", "aten::index_select", "aten::gather", "aten::fill_",
            "aten::zero_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::index_put_", "aten::scatter_")


def print_copy_sites(events, total_us: float, rows: int = 25) -> None:
    """The copy-family ATen ops' GPU time (their kernels', us) by (op, input shapes, the two innermost `ft/`
    frames):
    where a prefill moves bytes it does not compute on. Nested ops count once, at the outermost copy op."""
    sites: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.name not in COPY_OPS or (e.cpu_parent is not None and e.cpu_parent.name in COPY_OPS):
            continue
        us = e.device_time_total  # its kernels' and its children's
        if not us:
            continue
        # with_stack: the Python frames, "file(line): name", are the op's `stack` (innermost first) on some
        # torch versions, its ancestor events on others
        frames = [f[f.rfind("ft/") + 3:] for f in (e.stack or []) if "ft/" in f][:2]
        up = e.cpu_parent
        while up is not None and len(frames) < 2:
            if "ft/" in up.name and "(" in up.name:
                frames.append(up.name[up.name.rfind("ft/") + 3:])
            up = up.cpu_parent
        frame = " < ".join(frames) or "?"
        key = (e.name, str(e.input_shapes)[:60], frame[:110])
        sites[key][0] += us
        sites[key][1] += 1
    print(f"\ncopies and casts by call site ({sum(v[0] for v in sites.values()) / 1e3:.1f} ms of {total_us / 1e3:.1f}):")
    for (name, shapes, frame), (us, count) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"  {us / 1e3:>8.2f} ms {count:>5}x  {name:<18} {frame:<110} {shapes}")


if __name__ == "__main__":
    main()
