"""FreeToken's Qwen3-Next against transformers' own implementation, on small random checkpoints.

Logits within 1e-4 relative and 32 identical greedy tokens, for: one prefill, chunked prefill,
a prefix-cache hit on a second turn, and offload with fewer expert slots than two tokens need.
"""

from __future__ import annotations

import pytest
import torch

from ft.engine import LLM, SamplingParams

GREEDY_32 = dict(max_new_tokens=32, temperature=0.0, ignore_eos=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def hf_greedy(model, prompt: list[int], n: int = 32) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
        attention_mask=torch.ones_like(ids),
    )
    return out[0, len(prompt):].tolist()


def hf_last_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1]


def prompt_of(n: int, seed: int = 1, vocab: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def make_llm(path, **opts) -> LLM:
    base = dict(device="cpu", dtype="float32", page_size=16, max_running_requests=4)
    return LLM(model=str(path), **{**base, **opts})


def first_step_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits of the step that finishes the prompt (runs the remaining prefill chunks)."""
    eng = llm.engine
    seq = eng.add_request(prompt, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    while not seq.output_ids:
        eng.step()
    return eng.last_logits[0]


def test_single_prefill_matches_transformers(tiny):
    name, model, path = tiny
    prompt = prompt_of(77)
    llm = make_llm(path)
    assert rel_err(first_step_logits(llm, prompt), hf_last_logits(model, prompt)) < 1e-4
    got = llm.generate(prompt_token_ids=[prompt], **GREEDY_32)[0]
    assert got.token_ids == hf_greedy(model, prompt), name


@pytest.mark.parametrize("chunk", [7, 40])
def test_chunked_prefill_matches_transformers(tiny, chunk):
    name, model, path = tiny
    prompt = prompt_of(150, seed=2)
    llm = make_llm(path, max_prefill_length=chunk)
    assert rel_err(first_step_logits(llm, prompt), hf_last_logits(model, prompt)) < 1e-4
    got = llm.generate(prompt_token_ids=[prompt], **GREEDY_32)[0]
    assert got.token_ids == hf_greedy(model, prompt), name


@pytest.mark.parametrize("on_host", [False, True], ids=["device-states", "host-states"])
def test_prefix_cache_second_turn(tiny, on_host):
    """The second turn starts from the first's cached KV and linear-attention state, kept in a
    device mamba slot or (`prefix_states_on_host`) in host memory, the device pool then holding the
    running requests' slots alone; tokens as Hugging Face's either way."""
    name, model, path = tiny
    llm = make_llm(path, prefix_states_on_host=on_host)
    if on_host:
        assert llm.engine.pools.mamba.num_slots == llm.engine.config.max_running_requests
    turn1 = prompt_of(45, seed=3)
    out1 = llm.generate(prompt_token_ids=[turn1], **GREEDY_32)[0]
    assert out1.num_cached_tokens == 0
    turn2 = turn1 + out1.token_ids + prompt_of(20, seed=4)
    out2 = llm.generate(prompt_token_ids=[turn2], **GREEDY_32)[0]
    # everything the first turn fed through the model (its last token was only sampled)
    assert out2.num_cached_tokens == len(turn1) + len(out1.token_ids) - 1
    assert out2.token_ids == hf_greedy(model, turn2), name
    if on_host:  # the entries hold no device slot: every slot is free between requests
        assert len(llm.engine.prefix_cache) == 2 and llm.engine.prefix_cache.num_slots == 0
        assert llm.engine.pools.mamba.num_used == 0


def test_offload_with_evictions_matches_resident(tiny):
    name, model, path = tiny
    cfg = model.config
    slots = max(1, 2 * cfg.num_experts_per_tok - 1)  # fewer than two tokens' worth of experts
    prompts = [prompt_of(60, seed=5), prompt_of(33, seed=6)]
    resident = make_llm(path, moe_backend="resident").generate(prompt_token_ids=prompts, **GREEDY_32)
    offload = make_llm(path, moe_backend="offload", moe_cache_size=slots)
    got = offload.generate(prompt_token_ids=prompts, **GREEDY_32)
    stats = offload.engine.pools.experts.stats
    assert stats.misses > offload.engine.pools.experts.num_slots  # evictions happened
    for r, o, p in zip(resident, got, prompts):
        assert o.token_ids == r.token_ids == hf_greedy(model, p), name


def test_batched_decode_matches_one_at_a_time(tiny_one):
    _, model, path = tiny_one
    prompts = [prompt_of(n, seed=10 + n) for n in (5, 31, 64, 17)]
    together = make_llm(path).generate(prompt_token_ids=prompts, **GREEDY_32)
    for p, t in zip(prompts, together):
        assert t.token_ids == hf_greedy(model, p)
