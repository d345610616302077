"""Prefill on a card too small for the experts: time to first token, prefill tok/s, the bytes streamed
and the bound, then decode right after. Not a test.

    PYTHONPATH=. python3 bench/offload_prefill.py [--cards 32GiB,16GiB] [--lengths 1024,8192,32768,131072]
        [--modes stream,load] [--load-lengths 1024,8192] [--decode 64] [--chunks 4096,16384] [--pcie-gbs 50]
        [--loaders gather,copy] [--loan-holds 0,2] [--profile LEN] [--config bench/configs/qwen3-next-80b-a3b.json] [--device cuda]

Synthetic NVFP4 Qwen3-Next-80B-A3B, its routing drawn from the calibrated trace (as bench/ladder.py),
the offload backend on an emulated card (`--gpu-memory-limit`), KV for the longest prompt. Per card
one engine; per mode on that engine:
- `stream`: the default, long chunks stream the experts the cache lacks (`ft.memory.prefill_stream`);
- `load`: the path before it (the stream switched off on the same engine: each chunk's experts are
  loaded into the cache, one copy per expert and tensor, evicting others), timed at --load-lengths
  only (it is slow: 616 tok/s at 8K on the 32 GiB card).
`--loaders`: the stream mode's rows once per way of filling a staging page (`prefill_stream.LOADERS`:
`auto`, the engine's default, picks per page; `gather`, one kernel launch per page and tensor; `copy`,
one copy per run of consecutive experts and tensor, the way before it). `--chunks`: the stream mode's lengths once per prefill chunk size (the engine is sized for the largest,
so every size sees the same slots; the load mode runs at the first). Per length, one request with a fresh prompt (distinct ids: no prefix-cache hit) and --decode new
tokens: TTFT (add_request to the first token), prefill tok/s, the bytes the stream copied and its
PCIe bound (bytes / --pcie-gbs GB/s), then decode tok/s over the tokens after the first (with its hit rate and
the expert slots' least and most while it ran: the prefill reserve's loan, recalled by a long prompt, comes
back after its hold, `--loan-holds`: the engine's `loan_hold_s`, 0 by default); then the
same prompt but its last token again (the prefix cache serves all but the last page, a short chunk
that streams nothing) and its decode: the same context without a long prefill, so "decode after /
same context" is what the long prefill did to the cache, apart from the context's own cost. Before the
lengths of a mode, a 32-token prompt's decode (after one more that warms the expert cache) is the baseline of "decode after / after 32". Each mode
warms before its rows (Triton compiles by shape class): a 1,024-token prompt, then one of a chunk
and 1,024 tokens (a whole chunk, then a chunk over a cached prefix; at most the longest length). `--profile LEN`: after the
first card's rows, one LEN-token prompt of the stream mode (first loader) under cProfile (the host's
time by function: what bounds a chunk when the device idles), then another under torch.profiler (the
CUDA time by operation, copies included). Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from ft.engine.core.engine import Engine
from ft.engine.base.engine_config import EngineConfig
from ft.engine.base.sampling_params import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Prompts:
    """Fresh prompts: ids from a counter, so no two requests of a run share a prefix page."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.next = vocab, 1000

    def take(self, n: int) -> list[int]:
        ids = [(self.next + 7 * i) % (self.vocab - 10) + 5 for i in range(n)]
        self.next += 7 * n + 13
        return ids


def one_request(eng: Engine, prompt: list[int], new: int) -> dict:
    """TTFT (s), prefill tok/s, decode tok/s over the tokens after the first; the stream's bytes."""
    stream = eng.pools.experts.prefill_stream if eng.pools.experts is not None else None
    b0 = stream.stats.bytes if stream else 0
    _sync()
    t0 = time.perf_counter()
    seq = eng.add_request(prompt, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
    while not seq.output_ids:
        eng.step()
    _sync()
    t1 = time.perf_counter()
    stats = eng.pools.experts.stats if eng.pools.experts is not None else None
    h0, m0 = (stats.hits, stats.misses) if stats else (0, 0)
    slots = [eng.pools.experts.num_slots] if eng.pools.experts is not None else [0]
    while not seq.is_finished:
        eng.step()
        slots.append(eng.pools.experts.num_slots if eng.pools.experts is not None else 0)
    _sync()
    t2 = time.perf_counter()
    n = len(seq.output_ids) - 1
    hits, misses = (stats.hits - h0, stats.misses - m0) if stats else (0, 0)
    return {"ttft_s": t1 - t0, "prefill_tps": len(prompt) / (t1 - t0), "decode_tps": n / (t2 - t1) if n else None,
            "streamed_bytes": (stream.stats.bytes - b0) if stream else 0,
            "decode_hit_rate": hits / (hits + misses) if hits + misses else None,
            "decode_slots": (min(slots), max(slots))}


def profile(eng: Engine, prompts: Prompts, n: int) -> None:
    """One prompt under cProfile (the host's functions by own time), then one under torch.profiler:
    the wall time, then the CUDA time by operation."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    host = cProfile.Profile()
    host.enable()
    r = one_request(eng, prompts.take(n), 2)
    host.disable()
    print(f"\n== host profile: {n} tokens, TTFT {r['ttft_s']:.2f} s (under cProfile)")
    pstats.Stats(host).sort_stats("tottime").print_stats(30)
    prompt = prompts.take(n)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        r = one_request(eng, prompt, 2)
    print(f"\n== profile: {len(prompt)} tokens, TTFT {r['ttft_s']:.2f} s, streamed {r['streamed_bytes'] / 1e9:.1f} GB")
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60), flush=True)


def set_loader(stream, spec: str) -> None:
    """`name[:programs][:low]`: the stream's loader, the gather's programs, its copy stream's priority
    (high unless `low`: a new stream, so the A/B runs on one engine)."""
    from ft.kernels.host_gather.kernel import COPY_ROWS, CopyRowsOptions
    from ft.memory.prefill_stream import COPY_STREAM_PRIORITY

    name, *opts = spec.split(":")
    stream.loader = name
    programs = next((int(o) for o in opts if o.isdigit()), COPY_ROWS.programs)
    stream.gather_options = CopyRowsOptions(programs=programs, block_words=COPY_ROWS.block_words,
                                            num_warps=COPY_ROWS.num_warps)
    if stream.copy_stream is not None:
        torch.cuda.synchronize()
        stream.copy_stream = torch.cuda.Stream(stream.device, priority=0 if "low" in opts else COPY_STREAM_PRIORITY)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="bench/configs/qwen3-next-80b-a3b.json")
    ap.add_argument("--cards", default="32GiB,16GiB")
    ap.add_argument("--lengths", default="1024,8192,32768,131072")
    ap.add_argument("--modes", default="stream,load", help="stream (the default path), load (the path before it)")
    ap.add_argument("--load-lengths", default="1024,8192", help="lengths the slow load mode times")
    ap.add_argument("--decode", type=int, default=64, help="new tokens per request (decode measured after the first)")
    ap.add_argument("--chunks", default="", help="prefill chunk sizes (default: the card's --max-prefill-length)")
    ap.add_argument("--stream-experts", type=int, default=None, help="--prefill-stream-experts (default: auto)")
    ap.add_argument("--loaders", default="auto",
                    help="how the stream mode fills its pages: auto (the engine's default), gather, copy (several: "
                         "compared); gather:N:low: the gather "
                         "with N programs (CopyRowsOptions.programs), its copy stream at normal priority")
    ap.add_argument("--pcie-gbs", type=float, default=50.0, help="the host link's GB/s for the bound column")
    ap.add_argument("--lend-prefill-reserve", action=argparse.BooleanOptionalAction, default=None,
                    help="the prefill reserve's loan to the expert slots (default: the engine's, on for offload on "
                         "CUDA since session 35: a long prompt recalls it, and it goes out again 2 s after)")
    ap.add_argument("--loan-holds", default="",
                    help="the loan's hold in seconds (EngineConfig.loan_hold_s; several: each length's rows once "
                         "per hold, on the same engine; default: the engine's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", type=int, default=0, metavar="LEN", help="profile one stream-mode prompt of LEN tokens")
    args = ap.parse_args()
    cfg = json.loads(Path(args.config).read_text())
    cfg["routing_trace"] = True
    tmp = Path(tempfile.mkdtemp()) / "traced.json"
    tmp.write_text(json.dumps(cfg))
    lengths = [int(x) for x in args.lengths.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")] if args.chunks else []
    load_lengths = {int(x) for x in args.load_lengths.split(",")}
    rows = []
    for card in args.cards.split(","):
        t0 = time.perf_counter()
        eng = Engine(EngineConfig(model=f"synthetic:{tmp}", device=args.device, dtype="bfloat16", moe_backend="offload",
                                  gpu_memory_limit=card, num_tokens=max(lengths) + 2 * args.decode + 1024,
                                  max_running_requests=1, cuda_graph_max_bs=1, max_prefill_length=max(chunks) if chunks else None,
                                  prefill_stream_experts=args.stream_experts,
                                  lend_prefill_reserve=args.lend_prefill_reserve))
        experts = eng.pools.experts
        stream = experts.prefill_stream
        print(f"{card}: engine up in {time.perf_counter() - t0:.1f} s; {experts.num_slots} slots of "
              f"{experts.total_experts}, chunk {eng.config.max_prefill_length}, staging "
              f"{stream.nbytes / 2**20 if stream else 0:.0f} MiB", flush=True)
        prompts = Prompts(eng.model_config.vocab_size)
        loaders = args.loaders.split(",")
        holds = [float(x) for x in args.loan_holds.split(",")] if args.loan_holds else [None]
        if eng.loan is None and holds != [None]:
            raise SystemExit("--loan-holds: this engine lends no prefill reserve (see --lend-prefill-reserve)")
        runs = [(m, c, ld, h) for m in args.modes.split(",")
                for c in ((chunks or [eng.config.max_prefill_length]) if m == "stream" else (chunks or [None])[:1])
                for ld in (loaders if m == "stream" else ["-"]) for h in holds]
        for mode, chunk, loader, hold in runs:
            if hold is not None:
                eng.loan.hold_s = hold
            experts.prefill_stream = stream if mode == "stream" else None
            if stream is not None and mode == "stream":
                set_loader(stream, loader)
            eng.scheduler.max_prefill = chunk = chunk or eng.config.max_prefill_length
            # warm: compiles a short prompt's shapes, a whole chunk's, and a chunk after a cached prefix
            one_request(eng, prompts.take(1024), 2)
            one_request(eng, prompts.take(min(chunk + 1024, max(lengths))), 2)
            if eng.loan is not None:  # the baseline decodes as after an idle while: the warm-up's long
                time.sleep(eng.loan.hold_s + 0.05)  # prompts recalled the loan, its hold returns it
            # a short prompt's decode warms the expert cache first: the first baseline after start-up, on a cache
            # that had seen two prompts, hit 89.4% against 93% in every later one (session 46)
            one_request(eng, prompts.take(32), args.decode)
            base = one_request(eng, prompts.take(32), args.decode)
            for n in lengths:
                if mode == "load" and n not in load_lengths:
                    continue
                prompt = prompts.take(n)
                r = one_request(eng, prompt, args.decode)
                # the same context without a streamed prefill: the prompt again but its last token, so the
                # prefix cache serves all but its last page (a short chunk: no stream), then the same decode
                again = one_request(eng, prompt[:-1] + [(prompt[-1] + 1) % (eng.model_config.vocab_size - 10) + 5],
                                    args.decode)
                r["decode_same_context"] = again["decode_tps"]
                r["hit_same_context"], r["hit_after_32"] = again["decode_hit_rate"], base["decode_hit_rate"]
                r["slots_after_32"] = base["decode_slots"]
                r.update(card=card, mode=mode, loader=loader, length=n, chunk=chunk, slots=experts.num_slots,
                         hold=eng.loan.hold_s if eng.loan is not None else None,
                         decode_after_32=base["decode_tps"],
                         bound_s=r["streamed_bytes"] / (args.pcie_gbs * 1e9))
                rows.append(r)
                print(json.dumps(r), flush=True)
        experts.prefill_stream = stream
        if args.profile and card == args.cards.split(",")[0]:
            eng.scheduler.max_prefill = eng.config.max_prefill_length
            if stream is not None:
                set_loader(stream, loaders[0])
            profile(eng, prompts, args.profile)
        del eng, experts, stream
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"\n| card | mode | loader | chunk | loan hold s | prompt | TTFT s | prefill tok/s | streamed GB | PCIe bound s ({args.pcie_gbs:.0f} GB/s) | "
          "decode tok/s after | after 32 | ratio | same context, cached prefix | ratio | decode hits after / after 32 "
          "/ same context | slots while decoding after / after 32 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["decode_tps"] / r["decode_after_32"] if r["decode_tps"] and r["decode_after_32"] else float("nan")
        same = r["decode_tps"] / r["decode_same_context"] if r["decode_tps"] and r["decode_same_context"] else float("nan")
        hold = "-" if r["hold"] is None else f"{r['hold']:g}"
        print(f"| {r['card']} | {r['mode']} | {r['loader']} | {r['chunk']:,} | {hold} | {r['length']:,} | {r['ttft_s']:.2f} | {r['prefill_tps']:,.0f} | "
              f"{r['streamed_bytes'] / 1e9:.1f} | {r['bound_s']:.2f} | {r['decode_tps'] or 0:.1f} | "
              f"{r['decode_after_32'] or 0:.1f} | {ratio:.2f} | {r['decode_same_context'] or 0:.1f} | {same:.2f} | "
              f"{_pct(r['decode_hit_rate'])} / {_pct(r['hit_after_32'])} / {_pct(r['hit_same_context'])} | "
              f"{_span(r['decode_slots'])} / {_span(r['slots_after_32'])} |")


def _span(lo_hi: tuple[int, int]) -> str:
    """The expert slots' least and most over a decode (the loan's recall and its return show as a span)."""
    lo, hi = lo_hi
    return f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"


if __name__ == "__main__":
    main()
