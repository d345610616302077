"""One request cannot fail or change another: any sampling parameters that pass validation, batched
with a greedy request, leave that request's tokens what they are alone (property test, CPU)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft.engine import LLM, SamplingParams
from ft.errors import RequestError
from tests.test_oracle import prompt_of

PROMPT = prompt_of(12, seed=41)
NEW = 6


@pytest.fixture(scope="module")
def engine(tiny_one):
    _, _, path = tiny_one
    llm = LLM(model=str(path), device="cpu", dtype="float32", page_size=16, num_tokens=1024, max_running_requests=2)
    e = llm.engine
    alone = e.add_request(PROMPT, SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))
    e.run_until_done([alone])
    return e, list(alone.output_ids)


floats = st.one_of(st.sampled_from([0.0, 5e-324, 1e-300, 1e-45, 1e-39, 1e-30, 1e-6, 1.0, 3e38, 1e300, float("inf")]),
                   st.floats(min_value=0.0, allow_nan=False))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(temperature=floats, top_p=floats, top_k=st.integers(0, 2**40), seed=st.integers(0, 2**64 - 1),
       other=st.integers(1, 40))
def test_any_valid_sampling_params_leave_a_neighbour_alone(engine, temperature, top_p, top_k, seed, other):
    e, want = engine
    try:
        params = SamplingParams(max_new_tokens=NEW, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                ignore_eos=True)
    except RequestError:
        return  # refused at the door (400), so it never meets the other request
    fuzzed = e.add_request(prompt_of(other, seed=other), params)
    greedy = e.add_request(PROMPT, SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))
    e.run_until_done([fuzzed, greedy])
    assert greedy.error is None and fuzzed.error is None
    assert list(greedy.output_ids) == want
    assert all(0 <= t < e.model_config.vocab_size for t in fuzzed.output_ids) and len(fuzzed.output_ids) == NEW


def test_a_failing_step_fails_its_own_requests_only(tiny_one):
    """An engine step that raises fails the requests it was running; a request waiting outside it
    is served afterwards as if nothing happened, and the server keeps serving."""
    import asyncio

    from ft.engine.core.engine import Engine
    from ft.engine.base.engine_config import EngineConfig
    from ft.server.engine_loop import EngineLoop

    _, _, path = tiny_one
    loop = EngineLoop(lambda: Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", page_size=16,
                                                  num_tokens=1024, max_running_requests=2)))
    loop.start()
    loop.ready.wait()
    e = loop.engine
    real_run = e.runner.run
    failed = []

    def run(work):
        if any(s.request_id == "bad" for s in work.seqs) and not failed:
            failed.append([s.request_id for s in work.seqs])
            raise FloatingPointError("injected")
        return real_run(work)

    e.runner.run = run
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)

    async def drain(stream):
        out = []
        while True:
            ev = await stream.queue.get()
            if isinstance(ev, BaseException):
                return ev
            out.append(ev.token_id)
            if ev.finish_reason:
                return out

    async def main():
        streams = [await loop.submit(PROMPT, params, rid) for rid in ("bad", "neighbour", "waiting")]
        return await asyncio.gather(*(drain(s) for s in streams))

    try:
        bad, neighbour, waiting = asyncio.run(main())
    finally:
        loop.stop()
    assert len(failed) == 1 and "bad" in failed[0] and "waiting" not in failed[0]
    assert isinstance(bad, RuntimeError) and "FloatingPointError" in str(bad) and "injected" not in str(bad)
    alone = LLM(model=str(path), device="cpu", dtype="float32", page_size=16, num_tokens=1024).generate(
        prompt_token_ids=[PROMPT], max_new_tokens=NEW, temperature=0.0, ignore_eos=True)[0].token_ids
    for rid, got in (("neighbour", neighbour), ("waiting", waiting)):
        if rid in failed[0]:
            assert isinstance(got, RuntimeError)
        else:  # outside the failed step: served as if nothing happened
            assert got == alone, rid
