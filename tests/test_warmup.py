"""The warm-up `ft serve` runs before it says ready (`ft.engine.core.warmup`), on the CPU with the small
"ft-tiny" checkpoint: it reaches every decode batch and prefill length it says, leaves the engine as
it found it (no request, no prefix-cache page, counters zero), and changes no answer; `ft serve
--warmup` runs it before /health says ready, and a CPU server skips it by default. (Its point, the
first request on a GPU as fast as the hundredth, is measured on the device: bench/serve.py.)"""

from __future__ import annotations

import pytest
from server_proc import SERVE_MODEL, ServerProcess, write_serve_checkpoint

from ft.engine import LLM, SamplingParams
from ft.engine.core.warmup import warm_up


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_serve_checkpoint(tmp_path_factory.mktemp("warmup"))


def make(path) -> LLM:
    return LLM(model=str(path), device="cpu", max_running_requests=4, max_prefill_length=96, num_tokens=2048)


def answers(engine) -> list[list[int]]:
    """Greedy and seeded sampled tokens of two prompts, batched."""
    params = [SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)]
    seqs = [engine.add_request(list(range(20 + i, 60 + i)), p) for i, p in enumerate(params)]
    engine.run_until_done(seqs)
    return [s.output_ids for s in seqs]


def test_warm_up_runs_its_shapes_and_leaves_nothing_behind(checkpoint):
    e = make(checkpoint).engine
    running = []
    step = e.step

    mixed = []
    ramp = []
    paused = []

    def recording():  # the running batch after each step; (prompt, decoding rows) of a step beside decodes
        paused.append(e.slow_steps.paused)
        before = {id(q): (q.num_computed, bool(q.output_ids)) for q in e.scheduler.running}
        out = step()
        running.append(len(e.scheduler.running))
        grew = [q for q in e.scheduler.running if q.num_computed > before.get(id(q), (0, False))[0]]
        rows = sum(len(q.prompt_ids) == 4 and before.get(id(q), (0, False))[1] for q in grew)  # had an output
        mixed.extend((len(q.prompt_ids), rows) for q in grew if len(q.prompt_ids) in (13, 29, 61, 89) and rows)
        ramp.extend(rows for q in grew if len(q.prompt_ids) == 4 and id(q) not in before and rows)  # a new stream
        return out

    e.step = recording
    e.slow_steps.resume()  # (as `ft serve` has it once ready; the warm-up pauses it meanwhile)
    lines = []
    report = warm_up(e, lines.append)
    del e.step
    assert report.decode_batches == (4, 1) and 96 in report.prefill_lengths
    assert report.variants == ("sampled", "penalties", "logprobs", "grammar")
    assert report.requests == 1 + 4 + 1 + 3 * 4 + 2 + 4 + 4 * 3 and max(running) == 4 and 1 in running
    # the ramp: four streams admitted one a step, each prompt beside the streams before it decoding
    assert report.ramp == 4 and ramp == [1, 2, 3]
    # the short prompts beside two decodes, then the chunk less 7 beside two and beside one
    assert {13, 29, 61, 89} <= set(report.prefill_lengths) and mixed == [(13, 2), (29, 2), (61, 2), (89, 2), (89, 1)]
    assert len(lines) == 5 and report.line().startswith("warm-up done in ")
    assert not e.has_work and len(e.prefix_cache) == 0
    # its steps are no user's: the slow-step watch was paused through them, and judges the next ones afresh
    assert paused and all(paused) and not e.slow_steps.paused and sum(e.slow_steps.count.values()) == 0
    assert e.pools.kv.num_used_pages == 0 and e.pools.mamba.num_used == 0
    assert all(v == 0 for v in e.counters.values()) and e.prefix_cache.query_tokens == 0
    stats = e.stats()
    assert stats.prompt_tokens == stats.generation_tokens == stats.hits == stats.misses == 0


def test_warm_up_changes_no_answer(checkpoint):
    cold, warm = make(checkpoint).engine, make(checkpoint).engine
    warm_up(warm)
    assert answers(warm) == answers(cold)


def test_warm_up_needs_an_idle_engine(checkpoint):
    e = make(checkpoint).engine
    e.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        warm_up(e)


def test_ft_serve_warms_up_before_ready_when_asked_and_not_on_the_cpu_by_default(checkpoint):
    base = ("--model", str(checkpoint), "--device", "cpu", "--log-level", "info", "--max-running-requests", "2",
            "--num-tokens", "2048")
    asked = ServerProcess(*base, "--warmup")
    try:
        out = asked.output()
        assert "warm-up done in " in out and out.index("warm-up done in ") < out.index("ready on ")
        r = asked.post("/v1/completions", json={"model": SERVE_MODEL, "prompt": [5, 6, 7], "max_tokens": 2,
                                                "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        asked.stop()
    default = ServerProcess(*base)
    try:
        assert "warm-up" not in default.output()
    finally:
        default.stop()


def test_a_prompt_over_a_long_prefix_is_warmed_on_a_gpu_only(checkpoint, monkeypatch):
    """`long_prefix_length`: on CUDA a prompt of the library prefill's granule plus a tail when the KV
    room holds it, never on the CPU; where it runs (here made to run on the CPU at 200 tokens: chunks
    of 96, the last over a cached prefix) it then decodes beside a short prompt (its rows over the long context in
    a mixed step), and the warm-up still leaves nothing behind."""
    from ft.engine.core import warmup
    from ft.kernels.attention import LIBRARY_GRANULE_KEYS

    n = LIBRARY_GRANULE_KEYS + warmup.LONG_PREFIX_TAIL
    assert warmup.long_prefix_length("cuda", n) == n and warmup.long_prefix_length("cuda", n - 1) == 0
    assert warmup.long_prefix_length("cpu", 10 * n) == 0
    e = make(checkpoint).engine
    monkeypatch.setattr(warmup, "long_prefix_length", lambda device_type, limit: 200 if limit >= 200 else 0)
    step, beside = e.step, []

    def recording():  # a step that prefilled the 13-token prompt while the 200-token one decoded
        before = {id(q): (q.num_computed, bool(q.output_ids)) for q in e.scheduler.running}
        out = step()
        grew = [q for q in e.scheduler.running if q.num_computed > before.get(id(q), (0, False))[0]]
        if any(len(q.prompt_ids) == 13 for q in grew):
            beside.append(any(len(q.prompt_ids) == 200 and before.get(id(q), (0, False))[1] for q in grew))
        return out

    e.step = recording
    report = warm_up(e)
    del e.step
    assert 200 in report.prefill_lengths and report.requests == 3 + 4 + 1 + 3 * 4 + 2 + 4 + 4 * 3
    assert beside == [True, False]  # the long stream decoding beside it; then the mixed steps' 4-token streams
    assert not e.has_work and len(e.prefix_cache) == 0 and e.pools.kv.num_used_pages == 0


def test_one_eager_prompt_per_moe_pass_class():
    """`moe_pass_lengths`: the short grouped tile (up to 2,048 tokens) and the long one (the chunk, when
    longer) each get a prompt; chunks within the per-pair kernels' range (128) none."""
    from ft.engine.core.warmup import moe_pass_lengths

    assert moe_pass_lengths(4096) == (2048, 4096)
    assert moe_pass_lengths(2048) == (2048,) and moe_pass_lengths(1024) == (1024,)
    assert moe_pass_lengths(96) == () and moe_pass_lengths(128) == ()


def test_the_largest_batch_is_warmed_when_it_runs_past_the_graphs(checkpoint):
    """With decode graphs that stop below the running limit (--cuda-graph-max-bs or --cuda-graph-bs, here
    buckets 1 and 2 of 4), the warm-up also runs the largest batch, which decodes eagerly. (The graphs are a
    stand-in that runs each bucket's step eagerly: the CPU captures nothing.)"""
    from ft.engine.worker.decode_graphs import DecodeGraphs

    class EagerGraphs(DecodeGraphs):
        def run(self, n, key, forward):
            return forward()

    e = make(checkpoint).engine
    e.runner.graphs = EagerGraphs(2)
    assert e.runner.graphs.buckets == [1, 2]
    report = warm_up(e, lambda line: None)
    assert report.decode_batches == (4, 2, 1)


def test_the_ramp_admits_as_many_streams_as_the_kv_room_holds():
    """`ramp_streams`: every running request up to the KV room, each stream's pages for its prompt and tokens."""
    from ft.engine.core.warmup import ramp_streams

    assert ramp_streams(64, 16, 10**6) == 64  # 64 streams of 4 + 65 tokens: 5 pages of 16 each
    assert ramp_streams(64, 16, 64 * 5 * 16) == 64 and ramp_streams(64, 16, 64 * 5 * 16 - 1) < 64
    assert ramp_streams(8, 16, 10**6) == 8 and ramp_streams(8, 16, 16) == 0 and ramp_streams(1, 16, 10**6) == 0
    assert ramp_streams(1024, 16, 10**9) == 256  # RAMP_MAX_STREAMS


def test_the_mixed_steps_are_those_that_fit():
    """`mixed_steps`: the short prompts beside two streams, then the chunk less 7 beside two and beside one; the
    short ones where the long one has no room (a small KV), none past the chunk."""
    from ft.engine.core.warmup import mixed_steps

    assert mixed_steps(96, 10_000) == ((2, 13), (2, 29), (2, 61), (2, 89), (1, 89))
    assert mixed_steps(2048, 2060) == ((2, 13), (2, 29), (2, 61), (2, 125))  # 2,041 + 32 does not fit
    assert mixed_steps(20, 10_000) == ((2, 13),)  # the long one is 13 tokens: under 17, none
    assert mixed_steps(2048, 40) == ()


def test_a_refused_grammar_engine_skips_the_grammar_variant_and_nothing_else(checkpoint):
    """Where structured output cannot be served (the grammar engine refuses the tokenizer: a RequestError at each
    grammar request), the warm-up says so and goes on: `ft serve --warmup` starts (session 60: it failed to)."""
    from ft.errors import RequestError

    e = make(checkpoint).engine

    def refused():
        raise RequestError("structured output is not available on this server: (a test)")

    e.requests_in.grammar_compiler = refused
    lines = []
    report = warm_up(e, lines.append)
    assert report.variants == ("sampled", "penalties", "logprobs")
    assert lines[-1] == "warm-up: grammar skipped: structured output is not available on this server: (a test)"
    assert not e.has_work and len(e.prefix_cache) == 0 and e.pools.kv.num_used_pages == 0
