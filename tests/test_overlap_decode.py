"""Overlapped decode (`EngineConfig.overlap_decode`) on the CPU: each decode step is queued before
the host reads the last one's tokens, the inputs gathered on the device. The tokens must be those
of plain steps, a sequence that a stop token ends while the next step is in flight must leave the
prefix cache the state after its last computed token (the queued step writes nothing for it),
and anything that is not a plain decode batch steps as before."""

from __future__ import annotations

import pytest

from ft.engine.core.engine import Engine
from ft.engine.base.engine_config import EngineConfig
from ft.engine.base.sampling_params import SamplingParams
from test_oracle import prompt_of


def _engine(path, overlap: bool | None, prefix: bool = True) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", page_size=16, max_running_requests=4, moe_backend="resident",
                               overlap_decode=overlap, enable_prefix_cache=prefix))


def _run(eng: Engine, reqs: list) -> list:
    seqs = [eng.add_request(p, sp) for p, sp in reqs]
    eng.run_until_done(seqs)
    return [(s.output_ids, s.finish_reason) for s in seqs]


def test_overlapped_decode_gives_plain_steps_tokens(tiny_one):
    """Greedy and seeded sampling, an end by a stop token mid-decode and ends by length: the same
    tokens and reasons; then a prompt that extends the stopped request's text hits its prefix-cache
    entry and decodes as an engine without a prefix cache does."""
    _, _, path = tiny_one
    prompts = [prompt_of(20 + 7 * i, seed=40 + i) for i in range(3)]
    ref = _run(_engine(path, False), [(prompts[0], SamplingParams(max_new_tokens=12, temperature=0.0,
                                                                  ignore_eos=True))])
    stop = ref[0][0][5]  # a token request 0 emits mid-decode: it ends there (or earlier, the same for both)

    def reqs():
        return [(prompts[0], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))),
                (prompts[1], SamplingParams(max_new_tokens=12, temperature=0.8, seed=7, ignore_eos=True)),
                (prompts[2], SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True))]

    plain, over = _engine(path, False), _engine(path, True)
    want, got = _run(plain, reqs()), _run(over, reqs())
    assert got == want
    assert want[0][1] == "stop" and len(want[0][0]) > 1 and [r for _, r in want[1:]] == ["length", "length"]
    assert over.overlapped_steps > 5 and plain.overlapped_steps == 0
    follow = prompts[0] + want[0][0] + prompt_of(5, seed=99)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    seq = over.add_request(follow, greedy)
    over.run_until_done([seq])
    assert seq.num_cached >= len(prompts[0]) + len(want[0][0]) - 1 - 16  # the stopped request's entry
    fresh = _engine(path, False, prefix=False)
    assert seq.output_ids == _run(fresh, [(follow, greedy)])[0][0]


def test_overlap_is_on_by_default_only_where_the_device_runs_asynchronously(tiny_one):
    """`overlap_decode` None (the default): on for CUDA, off on the CPU, where every op runs at once
    and nothing can overlap; the CLI's --overlap-decode / --no-overlap-decode decide either way."""
    import argparse

    from ft.engine_args import add_engine_args, engine_config_from_args

    _, _, path = tiny_one
    assert EngineConfig().overlap_decode is None
    auto = _engine(path, None)
    _run(auto, [(prompt_of(20, seed=3), SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))])
    assert auto.overlapped_steps == 0
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, want in (([], None), (["--overlap-decode"], True), (["--no-overlap-decode"], False)):
        assert engine_config_from_args(parser.parse_args(argv)).overlap_decode is want


def test_overlap_steps_as_before_for_what_needs_the_host(tiny_one):
    """Logprobs, stop strings and a request arriving mid-decode: plain steps for those (no step
    queued behind them), the same tokens as without the option."""
    _, _, path = tiny_one
    p0, p1 = prompt_of(24, seed=50), prompt_of(18, seed=51)
    lp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    over = _engine(path, True)
    assert _run(over, [(p0, lp)]) == _run(_engine(path, False), [(p0, lp)])
    assert over.overlapped_steps == 0
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    outs = []
    for eng in (over, _engine(path, False)):
        a = eng.add_request(p0, greedy)
        for _ in range(4):
            eng.step()
        b = eng.add_request(p1, greedy)  # waiting: the step in flight lands, then its prefill runs
        eng.run_until_done([a, b])
        outs.append((a.output_ids, b.output_ids))
    assert over.overlapped_steps > 0 and outs[0] == outs[1] and len(outs[0][0]) == len(outs[0][1]) == 10
    stopped = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, stop=("zzzz",))
    before = over.overlapped_steps
    assert _run(over, [(p1, stopped)]) == _run(_engine(path, False), [(p1, stopped)])
    assert over.overlapped_steps == before


def test_server_commands_take_the_step_in_flight_first(tiny_one):
    """The server's engine loop runs each command (here: many snapshots while two requests decode)
    after the step in flight has landed (`Engine.drain`), and streams the tokens that drain took:
    every request's stream gets its tokens once each, in order, as plain steps give them."""
    import asyncio

    from ft.server.engine_loop import EngineLoop

    _, _, path = tiny_one
    prompts = [prompt_of(22, seed=60), prompt_of(30, seed=61)]
    params = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    want = [out for out, _ in _run(_engine(path, False), [(p, params) for p in prompts])]
    loop = EngineLoop(lambda: _engine(path, True))
    loop.start()
    loop.ready.wait()

    async def tokens(stream):
        out = []
        while True:
            ev = await stream.queue.get()
            assert not isinstance(ev, BaseException), ev
            out.append(ev.token_id)
            assert ev.num_output == len(out)
            if ev.finish_reason:
                return out

    async def main():
        streams = [await loop.submit(p, params, f"r{i}") for i, p in enumerate(prompts)]
        reads = asyncio.gather(*(tokens(s) for s in streams))
        snapshots = 0
        while not reads.done():
            await loop.acall(lambda e: e.has_work)
            snapshots += 1
        return await reads, snapshots

    try:
        got, snapshots = asyncio.run(main())
        overlapped = loop.engine.overlapped_steps
    finally:
        loop.stop()
    assert got == want and snapshots > 3 and overlapped > 0


@pytest.mark.parametrize("mapped", [False, True], ids=["victims-unmapped", "victims-mapped"])
def test_read_through_offload_overlaps_with_the_plain_steps_tokens_and_traffic(tiny_one, mapped):
    """Offloaded experts in read-through mode (12 slots for 4 layers x 8 experts: misses every
    step): overlapped steps give the plain steps' tokens and the same hits, misses and landings
    (the policy's timing is unchanged: each step's end collects the step before it). Asked for
    explicitly: the default takes overlap on CUDA only. Also with victims kept mapped until claimed."""
    _, _, path = tiny_one

    def engine(overlap: bool | None) -> Engine:
        return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", page_size=16, max_running_requests=4,
                                   moe_backend="offload", moe_cache_size=12, overlap_decode=overlap,
                                   expert_mapped_victims=mapped))

    def reqs():
        return [(prompt_of(18 + 9 * i, seed=60 + i), SamplingParams(max_new_tokens=8 + 3 * i, temperature=0.0,
                                                                     ignore_eos=True)) for i in range(3)]

    plain, over = engine(False), engine(True)
    assert plain.pools.experts.read_through is not None and not plain.pools.experts.all_resident
    want, got = _run(plain, reqs()), _run(over, reqs())
    assert got == want and over.overlapped_steps > 5
    traffic = []
    for eng in (plain, over):
        cache = eng.pools.experts
        cache.collect()
        traffic.append((cache.stats.hits, cache.stats.misses, cache.read_through.landed_total))
    assert traffic[0] == traffic[1] and traffic[0][1] > 0 and traffic[0][2] > 0
    auto = engine(None)
    _run(auto, reqs()[:1])
    assert auto.overlapped_steps == 0  # the CPU: off by default
