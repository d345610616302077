"""Logprobs on the device: the batched log_softmax + top-k against a plain reference; the engine's
generated-token and prompt logprobs against transformers' forward; prompt logprobs through chunked
prefill, beside requests that ask for nothing (unchanged), past the prefix cache; one host copy
per step."""

from __future__ import annotations

import torch

from ft.engine import SamplingParams
from ft.engine.sampling.sampler import logprobs_of, logprobs_ref
from test_oracle import make_llm, prompt_of


def test_logprobs_of_matches_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g) * 4
    logits[2, :100] = float("-inf")
    tokens = torch.tensor([0, 17, 150, 299, 5])
    own, top_v, top_i = logprobs_of(logits, tokens, 7)
    for r in range(5):
        ref_own, ref_top = logprobs_ref(logits[r], int(tokens[r]), 7)
        assert abs(float(own[r]) - ref_own) < 1e-4
        assert top_i[r].tolist() == [t for t, _ in ref_top]
        torch.testing.assert_close(top_v[r].double(), torch.tensor([v for _, v in ref_top], dtype=torch.float64),
                                   rtol=0, atol=1e-4)
    own0, v0, i0 = logprobs_of(logits, tokens, 0)
    assert torch.equal(own0, own) and v0.shape == (5, 0) and i0.shape == (5, 0)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float64 log_softmax of transformers' logits at every position."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().log_softmax(-1)


def check_against(ref: torch.Tensor, entry, token: int, k: int) -> None:
    assert entry.token_id == token and abs(entry.logprob - float(ref[token])) < 1e-4
    assert len(entry.top) == k
    best = ref.topk(k)
    assert [t for t, _ in entry.top] == best.indices.tolist()
    assert all(abs(v - float(b)) < 1e-4 for (_, v), b in zip(entry.top, best.values))


def test_engine_logprobs_match_transformers(tiny_one):
    """Chunked prefill (16-token chunks of a 40-token prompt) beside a request that asks for nothing
    (its tokens are those it gets alone) and one that asks for fewer logprobs: both askers' prompt
    and generated logprobs are transformers'."""
    _, model, path = tiny_one
    llm = make_llm(path, max_prefill_length=16)
    eng = llm.engine
    prompt, other, third = prompt_of(40, seed=3), prompt_of(23, seed=4), prompt_of(11, seed=8)
    greedy = dict(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[other], **greedy)[0]
    plain = eng.add_request(other, SamplingParams(**greedy))  # first: its rows come before the asker's
    asked = eng.add_request(prompt, SamplingParams(logprobs=3, prompt_logprobs=2, **greedy))
    fewer = eng.add_request(third, SamplingParams(logprobs=0, **greedy))
    eng.run_until_done([asked, plain, fewer])
    assert plain.output_ids == alone.token_ids and plain.logprobs is None and plain.prompt_logprobs is None
    ref = hf_logprobs(model, prompt + asked.output_ids)
    assert asked.prompt_logprobs[0] is None and len(asked.prompt_logprobs) == 40
    for i in range(1, 40):
        check_against(ref[i - 1], asked.prompt_logprobs[i], prompt[i], 2)
    assert len(asked.logprobs) == 6
    for j, token in enumerate(asked.output_ids):
        check_against(ref[39 + j], asked.logprobs[j], token, 3)
        assert asked.logprobs[j].logprob == asked.logprobs[j].top[0][1]  # greedy: the best one
    ref = hf_logprobs(model, third + fewer.output_ids)
    assert fewer.prompt_logprobs is None and len(fewer.logprobs) == 6
    for j, token in enumerate(fewer.output_ids):
        check_against(ref[10 + j], fewer.logprobs[j], token, 0)


def test_logprobs_are_raw_whatever_the_sampling(tiny_one):
    """Temperature, penalties and bias change what is drawn, not the logprobs reported (vLLM's
    default): the logprob of each drawn token is transformers' raw log_softmax."""
    _, model, path = tiny_one
    llm = make_llm(path)
    prompt = prompt_of(12, seed=5)
    out = llm.generate(prompt_token_ids=[prompt], max_new_tokens=5, temperature=1.7, seed=9, repetition_penalty=1.5,
                       presence_penalty=1.0, logit_bias={7: 3.0}, ignore_eos=True, logprobs=1)[0]
    ref = hf_logprobs(model, prompt + out.token_ids)
    for j, token in enumerate(out.token_ids):
        check_against(ref[11 + j], out.logprobs[j], token, 1)


def test_prompt_logprobs_bypass_the_prefix_cache(tiny_one):
    """A request whose prompt starts with a cached prefix still gets every prompt logprob (it
    computes the whole prompt); the same request without prompt logprobs reuses the cache."""
    _, model, path = tiny_one
    llm = make_llm(path)
    base = prompt_of(33, seed=6)
    first = llm.generate(prompt_token_ids=[base], max_new_tokens=2, temperature=0.0, ignore_eos=True)[0]
    longer = base + first.token_ids[:1] + prompt_of(9, seed=7)  # the cache holds base + its first token
    cached = llm.generate(prompt_token_ids=[longer], max_new_tokens=1, temperature=0.0, ignore_eos=True)[0]
    assert cached.num_cached_tokens > 0  # the cache would have served it
    out = llm.generate(prompt_token_ids=[longer], max_new_tokens=1, temperature=0.0, ignore_eos=True,
                       prompt_logprobs=0)[0]
    assert out.num_cached_tokens == 0
    ref = hf_logprobs(model, longer)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(longer)):
        check_against(ref[i - 1], out.prompt_logprobs[i], longer[i], 0)


def test_one_host_copy_per_step(tiny_one):
    """Tokens, their logprobs and the prompt's come back in one copy per step."""
    llm = make_llm(tiny_one[2], max_prefill_length=16)
    runner = llm.engine.runner
    calls = {"run": 0, "copy": 0}
    real_run, real_copy = runner.run, runner._to_host

    def run(work):
        calls["run"] += 1
        return real_run(work)

    def copy(*args):
        calls["copy"] += 1
        return real_copy(*args)

    runner.run, runner._to_host = run, copy
    llm.generate(prompt_token_ids=[prompt_of(40), prompt_of(7, seed=2)], max_new_tokens=4, temperature=0.0,
                 ignore_eos=True, logprobs=5, prompt_logprobs=5)
    assert calls["run"] >= 5 and calls["copy"] == calls["run"]


def test_prompt_logprob_chunks_stay_under_their_cap(tiny_one):
    """A request with prompt logprobs gets chunks (and a step's sum of them) of at most the
    scheduler's prompt-logit cap (each such position returns a vocabulary-wide row), while a plain
    request beside it keeps the full prefill budget; the logprobs are still transformers'."""
    _, model, path = tiny_one
    llm = make_llm(path, max_prefill_length=32)
    eng = llm.engine
    from ft.engine.core.engine import PROMPT_LOGIT_BYTES, PROMPT_LOGITS_MIN_TOKENS

    held = eng.reserve // (eng.model_config.vocab_size * PROMPT_LOGIT_BYTES)  # the activation reserve
    assert eng.scheduler.max_prompt_logits == min(32, max(PROMPT_LOGITS_MIN_TOKENS, held))
    eng.scheduler.max_prompt_logits = 8
    prompt, other = prompt_of(40, seed=3), prompt_of(30, seed=4)
    greedy = dict(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    asked = eng.add_request(prompt, SamplingParams(logprobs=1, prompt_logprobs=1, **greedy))
    plain = eng.add_request(other, SamplingParams(**greedy))
    sizes, schedule = [], eng.scheduler.schedule

    def recorded():
        work = schedule()
        if work is not None and work.is_prefill:
            sizes.append({s.request_id: n for s, n in zip(work.seqs, work.num_tokens)})
        return work

    eng.scheduler.schedule = recorded
    eng.run_until_done([asked, plain])
    asked_sizes = [d[asked.request_id] for d in sizes if asked.request_id in d]
    assert max(asked_sizes) <= 8 and sum(asked_sizes) == 40
    assert max(d.get(plain.request_id, 0) for d in sizes) > 8  # the plain request is not capped
    ref = hf_logprobs(model, prompt + asked.output_ids)
    for i in range(1, 40):
        check_against(ref[i - 1], asked.prompt_logprobs[i], prompt[i], 1)
