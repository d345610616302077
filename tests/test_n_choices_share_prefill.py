"""n > 1 choices of one prompt share one prompt prefill (`Engine.add_request_group`): the siblings fork
from the parent's prefill (state copied, full pages shared, the partial page copied) and sample their
first token from its logits. Their tokens are those of independent requests; the prompt is computed
once; nothing leaks; the fallbacks (no resources, echo) are independent prefills (CPU, tiny model)."""

from __future__ import annotations

import pytest

from ft.engine import LLM, SamplingParams
from tests.test_oracle import prompt_of

PROMPT = prompt_of(20, seed=7)  # 20 tokens, pages of 16: one shared full page, one copied partial page
NEW = 8


def make_engine(path, **opts):
    base = {"device": "cpu", "dtype": "float32", "page_size": 16, "num_tokens": 1024, "max_running_requests": 4,
            "enable_prefix_cache": False}
    return LLM(model=str(path), **{**base, **opts}).engine


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True, **kw)


def sampled(seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True,
                          logprobs=3, **kw)


def assert_all_free(e) -> None:
    e.prefix_cache.clear()
    kv, mamba = e.pools.kv, e.pools.mamba
    assert kv.num_free_pages == kv.num_pages, "KV pages leaked"
    assert all(kv.refcount(p) == 0 for p in range(kv.num_pages))
    assert mamba.num_free == mamba.num_slots, "mamba slots leaked"
    assert not e.scheduler.running and not e.scheduler.waiting and not e.has_work


@pytest.fixture(scope="module")
def path(tiny_one):
    return tiny_one[2]


@pytest.fixture(scope="module")
def reference(path):
    """The tokens of one greedy request alone, and of independent sampled requests (seeds 100..102)."""
    e = make_engine(path)
    alone = e.add_request(PROMPT, greedy())
    e.run_until_done([alone])
    indep = [e.add_request(PROMPT, sampled(100 + i)) for i in range(3)]
    e.run_until_done(indep)
    return list(alone.output_ids), [(list(s.output_ids), list(s.logprobs)) for s in indep]


def test_greedy_choices_equal_one_request_and_prefill_once(path, reference):
    e = make_engine(path)
    before = e.counters["prompt_tokens"]
    seqs = e.add_request_group(PROMPT, [greedy()] * 3, ["g-0", "g-1", "g-2"])
    assert [s.request_id for s in seqs] == ["g-0", "g-1", "g-2"]
    assert len(e.scheduler.waiting) == 1  # the siblings wait outside the scheduler, holding nothing
    assert e.waiting_requests() == seqs  # ... and are counted as waiting (metrics, admin, stats line)
    assert all(s.pages == [] and s.mamba_slot is None for s in seqs[1:])
    out = e.step()  # the whole prompt in one chunk: the fork point
    assert sorted(map(id, out)) == sorted(map(id, seqs)) and all(len(s.output_ids) == 1 for s in seqs)
    assert len(e.scheduler.running) == 3 and e.waiting_requests() == []
    full = seqs[0].pages[0]
    assert e.pools.kv.refcount(full) == 3  # the full prompt page is shared
    assert len({s.pages[1] for s in seqs}) == 3  # the partial page is each one's own
    assert len({s.mamba_slot for s in seqs}) == 3
    e.run_until_done(seqs)
    want, _ = reference
    for s in seqs:
        assert s.finish_reason == "length" and list(s.output_ids) == want
    assert e.counters["prompt_tokens"] - before == len(PROMPT)  # prefilled once, not three times
    assert_all_free(e)


def test_seeded_choices_equal_independent_requests(path, reference):
    e = make_engine(path)
    seqs = e.add_request_group(PROMPT, [sampled(100 + i) for i in range(3)])
    e.run_until_done(seqs)
    assert e.counters["prompt_tokens"] == len(PROMPT)
    _, indep = reference
    assert len({tuple(s.output_ids) for s in seqs}) > 1  # the seeds differ: so do the choices
    for s, (tokens, lps) in zip(seqs, indep):
        assert list(s.output_ids) == tokens
        assert len(s.logprobs) == len(lps) == NEW
        for got, exp in zip(s.logprobs, lps):
            assert got.token_id == exp.token_id
            assert got.logprob == pytest.approx(exp.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in exp.top]
            assert [v for _, v in got.top] == pytest.approx([v for _, v in exp.top], abs=1e-4)
    assert_all_free(e)


def test_aborting_the_parent_after_the_fork_leaves_the_siblings(path, reference):
    e = make_engine(path)
    seqs = e.add_request_group(PROMPT, [greedy()] * 3)
    e.step()
    e.step()
    assert all(len(s.output_ids) == 2 for s in seqs)
    assert e.abort(seqs[0].request_id)
    e.run_until_done(seqs[1:])
    assert seqs[0].finish_reason == "abort"
    want, _ = reference
    for s in seqs[1:]:
        assert s.finish_reason == "length" and list(s.output_ids) == want
    assert_all_free(e)


@pytest.mark.parametrize("order", ["parent first", "siblings first"])
@pytest.mark.parametrize("steps", [0, 1])
def test_aborting_the_group_before_the_fork(path, order, steps):
    e = make_engine(path, max_prefill_length=8)  # 20 prompt tokens: three prefill chunks
    seqs = e.add_request_group(PROMPT, [greedy()] * 3)
    for _ in range(steps):
        assert e.step() == []  # a chunk: no token yet, no fork
    assert all(s.fork_parent is seqs[0] for s in seqs[1:])
    ids = [s.request_id for s in seqs]
    for rid in ids if order == "parent first" else ids[::-1]:
        assert e.abort(rid)
    assert all(s.finish_reason == "abort" for s in seqs)
    assert e.step() == []
    assert_all_free(e)


def test_the_parent_preempted_before_its_prefill_completes(path, reference):
    e = make_engine(path, max_prefill_length=8)
    seqs = e.add_request_group(PROMPT, [greedy()] * 3)
    e.step()
    e.scheduler._preempt(seqs[0])  # its chunk is lost; the siblings keep waiting for its prefill
    assert seqs[0].num_computed == 0 and all(s.fork_parent is seqs[0] for s in seqs[1:])
    e.run_until_done(seqs)
    want, _ = reference
    assert all(list(s.output_ids) == want for s in seqs)
    assert e.counters["prompt_tokens"] == 8 + len(PROMPT)  # the lost chunk, then the prompt once
    assert_all_free(e)


def test_no_free_mamba_slot_falls_back_to_own_prefills(path, reference):
    e = make_engine(path, mamba_cache_size=1)  # the parent holds the only slot at the fork point
    seqs = e.add_request_group(PROMPT, [greedy()] * 3)
    e.step()
    assert len(seqs[0].output_ids) == 1 and not seqs[1].output_ids
    assert [s.request_id for s in e.scheduler.waiting] == [s.request_id for s in seqs[1:]]
    e.run_until_done(seqs)
    want, _ = reference
    assert all(list(s.output_ids) == want for s in seqs)
    assert e.counters["prompt_tokens"] == 3 * len(PROMPT)
    assert_all_free(e)


def test_prompt_logprobs_are_independent_requests(path):
    e = make_engine(path)
    seqs = e.add_request_group(PROMPT, [greedy(prompt_logprobs=1)] * 2)
    assert len(e.scheduler.waiting) == 2 and seqs[1].fork_parent is None
    e.run_until_done(seqs)
    assert e.counters["prompt_tokens"] == 2 * len(PROMPT)
    a, b = seqs[0].prompt_logprobs, seqs[1].prompt_logprobs
    assert a[0] is None and b[0] is None and len(a) == len(b) == len(PROMPT)
    assert [x.token_id for x in a[1:]] == [x.token_id for x in b[1:]] == PROMPT[1:]
    assert [x.logprob for x in a[1:]] == pytest.approx([x.logprob for x in b[1:]], abs=1e-4)
    assert_all_free(e)


def test_a_one_token_answer_forks_and_finishes(path, reference):
    """max_tokens 1: every choice ends at the fork point; the parent's and siblings' state goes."""
    e = make_engine(path, enable_prefix_cache=True)
    seqs = e.add_request_group(PROMPT, [SamplingParams(max_new_tokens=1, temperature=0.0)] * 3)
    out = e.step()
    assert sorted(map(id, out)) == sorted(map(id, seqs)) and all(s.is_finished for s in seqs)
    want, _ = reference
    assert all(list(s.output_ids) == want[:1] for s in seqs)
    assert_all_free(e)


def test_server_n2_completion_counts_the_prompt_once(serve_checkpoint):
    from fastapi.testclient import TestClient
    from server_proc import SERVE_MODEL, WAIT_S

    from ft.engine.core.engine import Engine
    from ft.engine.base.engine_config import EngineConfig
    from ft.server.app import ServerState, create_app
    from ft.server.engine_loop import EngineLoop

    loop = EngineLoop(lambda: Engine(EngineConfig(model=str(serve_checkpoint), device="cpu", dtype="float32",
                                                  enable_prefix_cache=False)))
    state = ServerState(loop, SERVE_MODEL, drain_s=0.0)
    prompt = [72, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101]
    with TestClient(create_app(state)) as client:
        assert loop.ready.wait(WAIT_S) and loop.state == "serving", loop.error
        one = client.post("/v1/completions", json={"model": SERVE_MODEL, "prompt": prompt, "max_tokens": 5,
                                                   "temperature": 0, "ignore_eos": True})
        assert one.status_code == 200, one.text
        before = loop.call_sync(lambda e: e.counters["prompt_tokens"])
        r = client.post("/v1/completions", json={"model": SERVE_MODEL, "prompt": prompt, "n": 2, "max_tokens": 5,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        after = loop.call_sync(lambda e: e.counters["prompt_tokens"])
        assert sorted(c["index"] for c in body["choices"]) == [0, 1]
        assert all(c["text"] == one.json()["choices"][0]["text"] for c in body["choices"])
        assert body["usage"]["prompt_tokens"] == len(prompt)  # counted once, as vLLM does
        assert body["usage"]["completion_tokens"] == 10
        assert after - before == len(prompt)  # and prefilled once


def test_aborting_only_the_parent_before_the_fork_serves_the_siblings(path, reference):
    """The parent ends before its prefill completes: its waiting siblings each prefill themselves."""
    e = make_engine(path, max_prefill_length=8)
    seqs = e.add_request_group(PROMPT, [greedy()] * 3)
    e.step()
    assert e.abort(seqs[0].request_id)
    assert [s.request_id for s in e.scheduler.waiting] == [s.request_id for s in seqs[1:]]
    for _ in range(40):
        if all(s.is_finished for s in seqs[1:]):
            break
        e.step()
    want, _ = reference
    assert all(s.finish_reason == "length" and list(s.output_ids) == want for s in seqs[1:])
    assert_all_free(e)
