"""Warm-up: run throwaway requests through the engine before the server says ready.

On a GPU the first request of each shape pays for what no earlier one did: Triton compiles the
kernels it reaches (seconds each, holding the GIL), a decode batch's first step at a new bucket
captures its CUDA graph, a short prefill's first one at a new token bucket captures its pieces,
and sampling with penalties, logprobs or a grammar reaches kernels plain greedy decode does not.
`warm_up` makes those first times happen at startup: a prefill at every prefill-graph token bucket
and eager prefills (a whole chunk, at most `EAGER_PREFILL_TOKENS`, and one per class of the MoE's
grouped passes, `moe_pass_lengths`), on a GPU one prompt whose
last chunk runs over a long cached prefix (`long_prefix_length`: the prefix kernels' shapes and
cuDNN's plans for the library prefill attention, `ft.kernels.attention.library_prefill`), a decode
batch at every graph bucket (largest first), prompts prefilling in steps beside decoding streams
(`mixed_steps`: short ones in each small class of a step's tokens, and one of a length that is not a multiple of
16 beside two streams and beside one), a ramp of streams admitted one a step (`ramp_streams`: a prompt beside
every count of decoding rows), and one request of each sampling variant; then it puts back what the requests
left: no request, no prefix-cache entry, counters at zero. Its cost is paid once per process (and less on a
restart: Triton keeps what it compiled in its cache directory, `~/.triton/cache` or $TRITON_CACHE_DIR).

It runs on the thread that owns the engine (the server's engine thread, before "ready").
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

from ft.kernels.attention import LIBRARY_GRANULE_KEYS
from ft.kernels.moe import GROUPED_SHORT_TOKENS, PER_PAIR_MAX_TOKENS
from ft.engine.base.sampling_params import SamplingParams
from ft.errors import RequestError

__all__ = ["WarmupReport", "warm_up"]

WARMUP_TIMEOUT_S = 1800.0
"""Longest a warm-up may take before it gives up (a hung step is a bug, not a slow card)."""

EAGER_PREFILL_TOKENS = 4096
"""Longest warm-up prompt outside the prefill graphs (the whole chunk when it is shorter)."""

LONG_PREFIX_TAIL = 256
"""Tokens of the warm-up's long prompt after its first `LIBRARY_GRANULE_KEYS` (its last chunk's)."""

STREAM_PREFILL_STEPS = 4096
"""Most steps the warm-up waits for streams' prompts to prefill before a mixed step (a long prompt in small chunks
takes tens; the bound only keeps a broken engine from holding startup forever)."""

MIXED_STREAMS = 2
"""Decoding streams beside the warm-up's mixed-step prompts (`mixed_steps`)."""

SHORT_MIXED_TOKENS = (13, 29, 61, 125)
"""Short prompts the warm-up prefills beside `MIXED_STREAMS` decoding streams: steps of 15, 31, 63 and 127 tokens,
one in each power-of-two class under 128 by which a kernel may size its tiles from the step's tokens (the
HyperConnection's fused read up to 64 tokens, the per-pair MoE up to 128). The decode graphs reach these classes
with decode steps alone and the prefill graphs with prompts alone; a mixed step runs eagerly."""


def mixed_prompt_length(chunk: int, room: int) -> int:
    """Tokens of the warm-up's long prompt that prefills in a step beside decoding streams: the chunk less 7, a
    length that no bucket has and that is not a multiple of 16 (a mixed step cuts prompts at its token budget less
    the decode rows, so users' chunks start and end anywhere; a kernel that specializes such a length compiles on
    their request path: session 27 saw 3.3 s stalls of every stream through `ft serve`). 0 for none, where that is
    under 17 tokens or does not fit `room` with the streams."""
    n = chunk - 7
    return n if n >= 17 and n + MIXED_STREAMS * 16 <= room else 0


def mixed_steps(chunk: int, room: int) -> tuple[tuple[int, int], ...]:
    """(decoding streams, prompt tokens) of the warm-up's mixed steps, each a prompt prefilled beside streams
    that decode: the `SHORT_MIXED_TOKENS` shorter than the long prompt (`mixed_prompt_length`), then the long one
    beside `MIXED_STREAMS` streams and beside one (a step's decoding rows come first, so one row puts the prompts'
    per-sequence tensors at an odd offset: session 60 saw kernels compile for it after ready at c10). Each where it
    fits a chunk and the KV `room` beside its streams."""
    long = mixed_prompt_length(chunk, room)
    short = tuple((MIXED_STREAMS, n) for n in SHORT_MIXED_TOKENS
                  if n < (long or chunk) and n + MIXED_STREAMS * 16 <= room)
    return (*short, *(((MIXED_STREAMS, long), (1, long)) if long else ()))


RAMP_MAX_STREAMS = 256
"""Most streams the warm-up's ramp admits (`ramp_streams`): the tile and warp choices that follow the decoding rows'
count stop changing well before (the Gated DeltaNet decode's by 3-5 rows, a step's token classes by 128), and a
server of a thousand running requests should not take a thousand warm-up steps."""


def ramp_streams(max_running: int, page_size: int, room: int) -> int:
    """Streams the warm-up admits one a step, each a 4-token prompt that then decodes until the last has: stream k's
    prompt prefills in a mixed step beside k decoding rows, so that every count of decoding rows up to
    `max_running` - 1 runs once eagerly beside a prompt. The eager decode rows' kernels choose their tiles and warps
    by that count (the Gated DeltaNet decode's value block and warps), and on Flash-Next launch without the PDL
    the decode graphs capture with: session 60's GPU test saw one compile after ready at 5 decoding rows. As many
    as `room` KV tokens hold (each stream's page(s) for 4 + `max_running` + 1 tokens), `RAMP_MAX_STREAMS` at most."""
    count = min(max_running, RAMP_MAX_STREAMS)
    while count > 1 and count * -(-(4 + count + 1) // page_size) * page_size > room:
        count -= 1
    return count if count > 1 else 0


def moe_pass_lengths(chunk: int) -> tuple[int, ...]:
    """One eager prompt length per class of the MoE's grouped prefill passes a chunk of up to `chunk`
    tokens reaches (each class its own compiled tiles): up to `GROUPED_SHORT_TOKENS` tokens (the short
    tile) and, for a longer chunk, the chunk itself (the long tile); below `PER_PAIR_MAX_TOKENS` the
    per-pair kernels, which the decode batches and the short sampling prompts reach. Where the prefill
    graphs run, their buckets cover the short class too; an offloaded engine has none (on the H200's
    offload benchmark a 1K prompt took 2.5-3 s more when only longer prompts had run before it, and
    not when a 1K prompt had)."""
    return tuple(sorted({n for n in (min(chunk, GROUPED_SHORT_TOKENS), chunk) if n > PER_PAIR_MAX_TOKENS}))


def long_prefix_length(device_type: str, limit: int) -> int:
    """Tokens of the warm-up's prompt over a long cached prefix, or 0 for none: on CUDA, when a
    prompt of `LIBRARY_GRANULE_KEYS` + `LONG_PREFIX_TAIL` tokens fits `limit` (the KV room and the
    context), its last chunk starts at the library prefill's granule. Not on the CPU: there is no
    library path, and 16K tokens there cost minutes for nothing."""
    n = LIBRARY_GRANULE_KEYS + LONG_PREFIX_TAIL
    return n if device_type == "cuda" and n <= limit else 0


_SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@dataclass(frozen=True)
class WarmupReport:
    requests: int
    prefill_lengths: tuple[int, ...]  # prompt lengths prefilled (one request each)
    decode_batches: tuple[int, ...]  # decode batch sizes stepped (every graph bucket on CUDA)
    variants: tuple[str, ...]  # sampling variants run
    seconds: float
    ramp: int = 0  # streams admitted one a step (`ramp_streams`): mixed steps beside 1 .. ramp - 1 decoding rows

    def line(self) -> str:
        return (f"warm-up done in {self.seconds:.1f} s: {self.requests} requests, prefills of "
                f"{', '.join(map(str, self.prefill_lengths)) or 'none'} tokens, decode batches "
                f"{', '.join(map(str, self.decode_batches))}, "
                + (f"mixed steps beside 1 to {self.ramp - 1} decoding rows, " if self.ramp > 1 else "")
                + f"sampling {', '.join(self.variants)}")


def warm_up(engine: Any, say: Callable[[str], None] | None = None) -> WarmupReport:
    """Run the warm-up requests on `engine` (idle: nothing queued or running), then leave it as it
    was (no request, no prefix-cache entry, counters zero). `say` gets a line as each phase starts. The engine's
    slow-step watch (`ft.engine.core.slow_steps`), if on, is paused meanwhile (every warm-up step is a first time)
    and judges afresh after it."""
    if engine.has_work:
        raise RuntimeError("warm-up needs an idle engine")
    watch = getattr(engine, "slow_steps", None)
    watching = watch is not None and not watch.paused
    if watching:
        watch.pause()
    try:
        return _warm_up(engine, say)
    finally:
        if watching:
            watch.resume()


def _warm_up(engine: Any, say: Callable[[str], None] | None) -> WarmupReport:
    t0 = time.monotonic()
    say = say or (lambda line: None)
    vocab = engine.model_config.vocab_size
    next_id = [1]

    def prompt(n: int) -> list[int]:  # ids no other warm-up prompt starts with: the prefix cache serves none
        start = next_id[0]
        next_id[0] += n + 1
        return [(start + i) * 7919 % vocab for i in range(n)]

    requests = [0]

    def run(prompts: list[list[int]], params: SamplingParams) -> None:
        seqs = [engine.add_request(p, params) for p in prompts]
        requests[0] += len(seqs)
        engine.run_until_done(seqs, timeout_s=WARMUP_TIMEOUT_S)

    def beside(stream_prompts: list[list[int]], params: SamplingParams, n: int) -> None:
        """A prompt of n tokens prefilled in a step beside streams that decode (a mixed step): the streams first
        prefill (a step or a few chunks) and take their first token."""
        streams = [engine.add_request(p, params) for p in stream_prompts]
        for _ in range(STREAM_PREFILL_STEPS):
            if all(q.output_ids or q.is_finished for q in streams):
                break
            engine.step()
        late = engine.add_request(prompt(n), greedy)
        requests[0] += len(streams) + 1
        engine.run_until_done([*streams, late], timeout_s=WARMUP_TIMEOUT_S)

    room = engine.pools.kv.num_tokens - 2 * engine.config.page_size  # (a prompt plus its decoded tokens)
    limit = min(room, engine.context_limit - 4)
    runner = engine.runner
    # eager prefills (past the graphs' buckets) up to EAGER_PREFILL_TOKENS: their kernels compile by
    # shape class (a longer chunk adds time, not classes): the chunk, and one per MoE pass class
    chunk = min(engine.config.max_prefill_length or 0, EAGER_PREFILL_TOKENS)
    graph_tokens = runner.prefill_graphs.buckets if runner.prefill_graphs is not None else []
    lengths = tuple(sorted({n for n in [*graph_tokens, chunk, *moe_pass_lengths(chunk)] if 0 < n <= limit}))
    if lengths:
        say(f"warm-up: prefills of {', '.join(map(str, lengths))} tokens")
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    for n in lengths:
        run([prompt(n)], greedy)
    long = long_prefix_length(engine.device.type, limit)
    if long and limit < long + 2 * engine.config.page_size + SHORT_MIXED_TOKENS[0]:
        say(f"warm-up: a prompt of {long} tokens (a chunk over a long cached prefix)")
        run([prompt(long)], greedy)
        lengths = (*lengths, long)
    elif long:
        say(f"warm-up: a prompt of {long} tokens (a chunk over a long cached prefix), then decoding beside a "
            "prompt (a mixed step)")
        # its decode row over the long context runs eagerly beside the short prompt: the split decode attention at
        # a long context's split count and launch options (a register cap past two waves of programs), which the
        # graphs reach only with their own launch (PDL on Flash-Next)
        beside([prompt(long)], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
               SHORT_MIXED_TOKENS[0])
        lengths = (*lengths, long)

    max_bs = engine.config.max_running_requests
    # the graphs' buckets, and the largest batch, which runs eagerly when it is past them (--cuda-graph-max-bs or
    # --cuda-graph-bs below --max-running-requests)
    buckets = sorted({*(runner.graphs.buckets if runner.graphs is not None else [1]), max_bs})
    per_seq = 4 + 3  # a 4-token prompt and its tokens: one page each
    batches = tuple(b for b in sorted(buckets, reverse=True) if b <= max_bs and b * engine.config.page_size <= room
                    and b * per_seq <= room)
    say(f"warm-up: decode batches of {', '.join(map(str, batches))}")
    steps = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)  # two decode steps: capture, replay
    for b in batches:
        run([prompt(4) for _ in range(b)], steps)

    mixed = mixed_steps(chunk, room) if max_bs > MIXED_STREAMS else ()
    if mixed:
        say(f"warm-up: prompts of {', '.join(str(n) for _, n in mixed)} tokens beside decoding streams "
            f"({', '.join(str(k) for k, _ in mixed)}: mixed steps)")
        decoding = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        for count, n in mixed:
            beside([prompt(4) for _ in range(count)], decoding, n)
        lengths = tuple(sorted({*lengths, *(n for _, n in mixed)}))

    ramp = ramp_streams(max_bs, engine.config.page_size, room)
    if ramp:
        say(f"warm-up: {ramp} streams admitted one a step (mixed steps beside 1 to {ramp - 1} decoding rows)")
        along = SamplingParams(max_new_tokens=ramp + 1, temperature=0.0, ignore_eos=True)
        streams = []
        for _ in range(ramp):
            streams.append(engine.add_request(prompt(4), along))
            engine.step()
        requests[0] += ramp
        engine.run_until_done(streams, timeout_s=WARMUP_TIMEOUT_S)

    variants = {
        "sampled": SamplingParams(max_new_tokens=3, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=1,
                                  ignore_eos=True),
        "penalties": SamplingParams(max_new_tokens=3, temperature=0.0, repetition_penalty=1.1, presence_penalty=0.5,
                                    frequency_penalty=0.5, logit_bias=((1, -1.0),), ignore_eos=True),
        "logprobs": SamplingParams(max_new_tokens=3, temperature=0.0, logprobs=5, prompt_logprobs=1, ignore_eos=True),
        "grammar": SamplingParams(max_new_tokens=3, temperature=0.0, grammar=("json_schema", _SCHEMA)),
    }
    say(f"warm-up: sampling ({', '.join(variants)})")
    ran = []
    for name, params in variants.items():
        if name == "grammar" and engine.tokenizer is None:
            continue
        try:
            for b in (1, 2) if max_bs >= 2 else (1,):
                run([prompt(4) for _ in range(b)], params)
        except RequestError as e:  # structured output refused on this server (its requests are told so too)
            if name != "grammar":
                raise
            say(f"warm-up: {name} skipped: {e}")
            continue
        ran.append(name)
    _forget(engine)
    if getattr(engine, "mamba_demand", None) is not None:  # the decode batches grew it to max_running_requests
        engine.mamba_demand.shrink("after the warm-up")
    if getattr(engine, "loan", None) is not None and engine.cache.lent < engine.loan_bytes:
        engine.loan.lend("after the warm-up")  # a long warm-up prompt recalled it: out again before ready
    return WarmupReport(requests[0], lengths, batches, tuple(ran), time.monotonic() - t0, ramp)


def _forget(engine: Any) -> None:
    """What the warm-up requests left behind, put back: their prefix-cache entries (and so their
    pages and mamba slots), the token counters, the prefix cache's and the expert cache's figures.
    The experts they brought in stay (a cache as good as any), so do the graphs and compiled kernels, and
    the pinned blocks their prefixes' states took in host memory (torch's host cache keeps freed ones, so
    the first real requests' saves should allocate none: not measured)."""
    engine.prefix_cache.clear()
    engine.prefix_cache.hit_tokens = engine.prefix_cache.query_tokens = engine.prefix_cache.host_failures = 0
    for key in engine.counters:
        engine.counters[key] = 0
    engine.scheduler.num_preemptions = 0
    experts = engine.pools.experts
    if experts is not None:
        experts.collect()
        experts.stats.hits = experts.stats.misses = experts.stats.bytes_loaded = 0
