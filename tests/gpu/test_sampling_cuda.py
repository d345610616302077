"""The sampler's extras on CUDA under decode graphs: penalties, bias, min-p and logprobs with no
implicit host sync (torch's sync debug mode raises on one), the penalty counts equal to each
sequence's history at every step, each token what the reference picks from that step's logits, a
plain neighbour's tokens unchanged, and prompt logprobs agreeing with the sampling path's."""

from __future__ import annotations


import pytest
import torch

import ft.engine.worker.model_runner as model_runner
from ft.engine import LLM, SamplingParams
from ft.engine.sampling.sampler import processed_logits_ref

pytestmark = pytest.mark.gpu

NEW = 12



def make(model: str, **kw) -> LLM:
    opts = dict(device="cuda", dtype="bfloat16", moe_backend="resident", num_tokens=4096, max_running_requests=4,
                max_prefill_length=48)
    return LLM(model=model, **{**opts, **kw})


def no_sync(fn):
    """fn, raising if it synchronizes with the device implicitly."""

    def wrapped(*args, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return wrapped


def test_extras_under_graphs_match_the_reference_without_sync(model, monkeypatch):
    llm = make(model)
    eng, runner = llm.engine, llm.engine.runner
    monkeypatch.setattr(model_runner, "sample", no_sync(model_runner.sample))
    monkeypatch.setattr(model_runner, "logprobs_of", no_sync(model_runner.logprobs_of))
    runner.sampling = no_sync(runner.sampling)
    runner.penalties.record = no_sync(runner.penalties.record)
    records, real = [], runner.run

    def run(work):
        before = [list(s.output_ids) for s in work.seqs]
        tokens = real(work)
        records.append((list(work.seqs), before, runner.last_logits.float().cpu(), tokens, list(runner.last_logprobs)))
        state = runner.penalties
        for seq, out, token in zip(work.seqs, before, tokens):
            slot = state.slot_of(seq)
            if slot is not None and token is not None:
                want = torch.bincount(torch.tensor(out + [token]), minlength=state.counts.shape[1])
                assert torch.equal(state.counts[slot].long().cpu(), want)
        return tokens

    runner.run = run
    base = dict(max_new_tokens=NEW, ignore_eos=True)
    plain_prompt = list(range(300, 340))
    alone = make(model).generate(prompt_token_ids=[plain_prompt], temperature=0.0, **base)[0].token_ids
    specs = [
        (plain_prompt, SamplingParams(temperature=0.0, **base)),
        (list(range(100, 170)), SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
                                               logit_bias={7: 2.0}, logprobs=5, prompt_logprobs=3, **base)),
        (list(range(500, 530)), SamplingParams(temperature=0.9, top_k=4, min_p=0.05, presence_penalty=1.0, seed=5,
                                               logprobs=0, **base)),
    ]
    seqs = [eng.add_request(p, sp) for p, sp in specs]
    eng.run_until_done(seqs)
    assert runner.graphs is not None and runner.graphs.replays > 0  # the decode steps replayed graphs
    assert seqs[0].output_ids == alone and seqs[0].logprobs is None
    checked = 0
    for work, before, logits, tokens, lps in records:
        for i, (seq, out, token) in enumerate(zip(work, before, tokens)):
            if token is None:
                continue
            ref = processed_logits_ref(logits[i], seq.params, seq.prompt_ids, out)
            if seq.params.greedy:
                assert ref[token] >= ref.max() - 1e-3
            else:
                assert token in ref.topk(4).indices.tolist()
            if seq.params.logprobs is not None:
                raw = logits[i].double().log_softmax(-1)
                assert abs(lps[i].logprob - float(raw[token])) < 1e-3 and len(lps[i].top) == seq.params.logprobs
            checked += 1
    assert checked == 3 * NEW
    # prompt logprobs: the last prompt token's equals the sampling path's logprob of that token
    asked = seqs[1]
    assert asked.prompt_logprobs[0] is None and all(e is not None for e in asked.prompt_logprobs[1:])
    p = specs[1][0]
    forced = make(model).generate(prompt_token_ids=[p[:-1]], max_new_tokens=1, temperature=0.0, logprobs=0,
                                  logit_bias={p[-1]: 100.0})[0]
    assert forced.token_ids == [p[-1]]
    assert abs(forced.logprobs[0].logprob - asked.prompt_logprobs[-1].logprob) < 0.05
