"""The engine end to end on CUDA: the Triton dispatchers against the same engine forced onto the
torch references (every kernel: `backend.reference_kernels()`, CUDA graphs off on that side), on a
synthetic small Qwen3-Next in bf16 (greedy tokens and last logits)."""

from __future__ import annotations


import pytest
import torch

from ft.engine import LLM, SamplingParams
from ft.kernels.backend import reference_kernels

pytestmark = pytest.mark.gpu

PROMPT = list(range(100, 164))
NEW_TOKENS = 16
TOL_LOGITS = 0.25
"""Relative RMS of the last logits, Triton vs reference path. Measured 0.13 on the H200
(bench/RESULTS.md): bf16 rounding at different points over 4 random layers, not a kernel error
(bf16 against fp32 on the reference path alone is 0.47)."""


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def prefill_logits(llm, prompt: list[int]) -> torch.Tensor:
    """The last logits [V] after prefilling `prompt` in `llm`'s engine."""
    eng = llm.engine
    seq = eng.add_request(prompt, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    while not seq.output_ids:
        eng.step()
    return eng.last_logits[0].clone()


def run(model: str, **opts) -> tuple[torch.Tensor, list[int], LLM]:
    """(the last logits [V] after prefilling PROMPT, NEW_TOKENS greedy tokens, the engine) of a fresh engine."""
    llm = LLM(model=model, device="cuda", dtype="bfloat16", moe_cache_size=24, num_tokens=1024,
              enable_prefix_cache=False, **opts)
    logits = prefill_logits(llm, PROMPT)
    tokens = llm.generate(prompt_token_ids=[PROMPT], max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return logits, tokens[0].token_ids, llm


def assert_same_or_near_tie(llm_ref, tokens: list[int], ref_tokens: list[int]) -> None:
    """Greedy tokens of two numerically different bf16 paths are equal, or they part at a near-tie:
    at the first difference the reference path's logits (teacher-forced on its own tokens) rank the
    two candidates within TOL_LOGITS x the logits' RMS of each other, the noise the two paths'
    logits are allowed (a random model's flat logits make such ties common)."""
    if tokens == ref_tokens:
        return
    i = next(j for j, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b)
    logits = prefill_logits(llm_ref, PROMPT + ref_tokens[:i]).float()
    gap = (logits[ref_tokens[i]] - logits[tokens[i]]).item()
    rms = logits.pow(2).mean().sqrt().item()
    assert 0 <= gap <= TOL_LOGITS * rms, (i, gap, rms, tokens, ref_tokens)


def test_triton_path_matches_reference_path(model):
    logits, tokens, _ = run(model)
    with reference_kernels():  # NOTE: the references may read values on the host: no graphs there
        ref_logits, ref_tokens, llm_ref = run(model, disable_cuda_graph=True, overlap_decode=False)
        assert len(tokens) == NEW_TOKENS
        assert_same_or_near_tie(llm_ref, tokens, ref_tokens)
    assert rel_rms(logits, ref_logits) < TOL_LOGITS


def test_the_embedding_in_host_memory_changes_no_bit(model):
    """Offloaded (the default backend), the embedding moves to pinned host memory by default and each
    step's rows are gathered inside its graphs: the same last logits and greedy tokens, bit for bit, as
    with the embedding on the device, and its bytes leave the device weights."""
    logits, tokens, llm = run(model)
    assert llm.engine.model.embed_on_host and llm.engine.model.embed.is_pinned()
    on_device_logits, on_device_tokens, llm_dev = run(model, embedding_on_host=False)
    assert not llm_dev.engine.model.embed_on_host
    assert torch.equal(logits, on_device_logits) and tokens == on_device_tokens
    table = llm.engine.model.embed
    assert llm_dev.engine.model.resident_bytes - llm.engine.model.resident_bytes == table.numel() * table.element_size()


def test_resident_defaults_run_64_requests_and_fill_the_budget_with_kv(model):
    """Resident on a GPU without --max-running-requests or --num-tokens: 64 running requests, and the
    KV takes what the experts and mamba slots leave, past one context but never past 64 contexts
    (the running requests could hold no more), in whole pages; an explicit --num-tokens is kept."""
    llm = LLM(model=model, device="cuda", dtype="bfloat16", moe_backend="resident", enable_prefix_cache=False)
    e = llm.engine
    g, limit, page = e.cache.geometry, e.context_limit, e.config.page_size
    assert e.config.max_running_requests == 64 and e.scheduler.max_running == 64 and g.mamba_slots == 128
    assert limit < g.kv_tokens <= 64 * limit + page - 1 and g.kv_tokens % page == 0
    out = llm.generate(prompt_token_ids=[PROMPT], max_new_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(out[0].token_ids) == 4
    del llm, e
    fixed = LLM(model=model, device="cuda", dtype="bfloat16", moe_backend="resident", num_tokens=2048,
                max_running_requests=4)
    assert fixed.engine.cache.geometry.kv_tokens == 2048 and fixed.engine.scheduler.max_running == 4


def test_prefix_states_in_host_memory_restore_exactly(model):
    """Offloaded on one GPU the prefix cache keeps its linear-attention states in pinned host memory
    (the default): the saves and restores are queued on the stream without a sync, and a freed
    slot's next owner zeroes it after the save read it. The pool's round trip is bit-exact, and a
    second turn gives the tokens of the same engine with the states in device slots."""
    from ft.memory.mamba_pool import MambaPool

    pool = MambaPool(3, 2, 64, 4, 4, 32, 32, torch.bfloat16, torch.device("cuda"))
    slot = pool.allocate()
    for t in pool.tensors:
        t[slot].copy_(torch.randn(t[slot].shape, device="cuda").to(t.dtype))
    want = [t[slot].clone() for t in pool.tensors]
    saved = pool.save(slot)
    pool.free(slot)
    assert pool.allocate() == slot  # zeroes it: queued after the save's copy
    other = pool.allocate()
    pool.restore(saved, other)
    assert all(torch.equal(t[other], w) for t, w in zip(pool.tensors, want))
    assert all(torch.equal(t[slot], torch.zeros_like(w)) for t, w in zip(pool.tensors, want))

    def turns(**opts):
        llm = LLM(model=model, device="cuda", dtype="bfloat16", moe_cache_size=24, num_tokens=1024, **opts)
        first = llm.generate(prompt_token_ids=[PROMPT], max_new_tokens=8, temperature=0.0, ignore_eos=True)[0]
        second = PROMPT + first.token_ids + list(range(300, 340))
        out = llm.generate(prompt_token_ids=[second], max_new_tokens=NEW_TOKENS, temperature=0.0,
                           ignore_eos=True)[0]
        return out.num_cached_tokens, out.token_ids, llm

    cached, tokens, llm = turns()
    assert llm.engine.prefix_cache.host_entries > 0 and llm.engine.prefix_cache.num_slots == 0
    assert (cached, tokens) == turns(prefix_states_on_host=False)[:2] and cached > len(PROMPT)


def test_an_offloaded_cache_that_can_never_hold_every_expert_reserves_no_prefill_graphs(model):
    """Prefill graphs replay only while every expert is resident: an offloaded cache capped below the
    model's experts takes no prefill-graph reserve (its budget is larger by what the reserve would
    have been) and no solo prefill steps; one that holds them all keeps both."""
    capped = LLM(model=model, device="cuda", dtype="bfloat16", moe_cache_size=24, num_tokens=1024).engine
    assert capped.prefill_graph_tokens == 0 and capped.prefill_graph_reserve == 0
    assert capped.runner.prefill_graphs is None
    whole = LLM(model=model, device="cuda", dtype="bfloat16", num_tokens=1024).engine  # offload, every expert fits
    assert whole.prefill_graph_tokens > 0 and whole.prefill_graph_reserve > 0 and whole.runner.prefill_graphs is not None
    assert whole.cache.geometry.moe_slots == whole.cache.total_experts
    assert whole.cache.budget.reserve_bytes - capped.cache.budget.reserve_bytes == whole.prefill_graph_reserve


def test_the_prefill_reserves_loan_on_the_device(model, monkeypatch):
    """--lend-prefill-reserve on CUDA: the expert pool grows past the budget at startup (VMM, the same
    addresses), a prompt longer than the kept chunk recalls what of the loan it needs before its prefill, the
    decode graphs captured while it was out replay after it came back and went out again, and the tokens are the
    no-loan engine's (bitwise for a short prompt, whose experts fit the slots; within a near-tie for PROMPT, whose
    prefill may stream and group its experts differently)."""
    import ft.engine.ranks.rank_state as rank_state

    monkeypatch.setattr(rank_state, "LOAN_KEEP_TOKENS", 16)
    # 20 MiB: ~70 of the 128 experts' slots without the loan (at 64 MiB every expert fits and nothing is lent)
    opts = dict(device="cuda", dtype="bfloat16", cache_budget="20MiB", max_prefill_length=512,
                max_running_requests=2, enable_prefix_cache=False)
    plain = LLM(model=model, lend_prefill_reserve=False, **opts)  # (the loan is the default on CUDA now)
    lent = LLM(model=model, lend_prefill_reserve=True, **opts)
    e = lent.engine
    assert plain.engine.cache.geometry.moe_slots < plain.engine.cache.total_experts
    assert e.cache.lent == e.loan_bytes > 0 and e.cache.geometry.moe_slots > plain.engine.cache.geometry.moe_slots
    short = PROMPT[:8]

    def greedy(llm, prompt):
        return llm.generate(prompt_token_ids=[prompt], max_new_tokens=NEW_TOKENS, temperature=0.0,
                            ignore_eos=True)[0].token_ids

    assert greedy(lent, short) == greedy(plain, short) and e.cache.lent
    captures = e.runner.graphs.captures
    assert_same_or_near_tie(plain, greedy(lent, PROMPT), greedy(plain, PROMPT))
    assert e.cache.lent == e.loan_beside(len(PROMPT)) < e.loan_bytes and e.loan.recalls == 1  # what PROMPT needs
    e.loan.lend("test")
    assert e.cache.lent and greedy(lent, short) == greedy(plain, short)
    assert e.runner.graphs.captures == captures  # the pool grew and shrank at the same addresses


def test_mamba_slots_on_demand_on_the_device(model):
    """--mamba-on-demand on CUDA: the linear-attention pool starts at one slot (the expert slots take the
    rest), grows through VMM at the same addresses when two requests run at once, so the batch-1 decode graph
    captured before the grow replays after it and after the shrink, and the tokens are the fixed pool's.
    The sizes are chosen against the VMM storage's 2 MiB granules, to which each pool tensor rounds: at 20 MiB
    the slots saved by 2 or 16 running requests bought no expert slot (32 and 32 on the H100, sessions 51-52);
    at 32 MiB with 32 running requests the layout gives 96 expert slots against the fixed pool's 64."""
    opts = dict(device="cuda", dtype="bfloat16", cache_budget="32MiB", num_tokens=2048, max_prefill_length=512,
                max_running_requests=32, lend_prefill_reserve=False)  # (host prefix states: the CUDA default)
    fixed = LLM(model=model, **opts)
    llm = LLM(model=model, mamba_on_demand=True, **opts)
    e = llm.engine
    assert e.cache.geometry.mamba_slots == 1 < fixed.engine.cache.geometry.mamba_slots
    assert e.cache.geometry.moe_slots > fixed.engine.cache.geometry.moe_slots
    ptrs = [t.data_ptr() for t in e.pools.mamba.tensors]

    def greedy(engine_llm, prompts):
        outs = engine_llm.generate(prompt_token_ids=prompts, max_new_tokens=NEW_TOKENS, temperature=0.0,
                                   ignore_eos=True)
        return [o.token_ids for o in outs]

    one, two = [PROMPT[:8]], [PROMPT[:8], PROMPT[:12]]
    assert greedy(llm, one) == greedy(fixed, one)
    captures = e.runner.graphs.captures
    for got, want in zip(greedy(llm, two), greedy(fixed, two)):  # (a two-prompt prefill may group its experts
        assert_same_or_near_tie(fixed, got, want)  # otherwise with more slots)
    assert e.cache.geometry.mamba_slots == 2 and e.mamba_demand.grows == 1
    assert [t.data_ptr() for t in e.pools.mamba.tensors] == ptrs
    e.mamba_demand.shrink("test")
    assert e.cache.geometry.mamba_slots == 1 and greedy(llm, one) == greedy(fixed, one)
    assert e.runner.graphs.captures == captures + 1  # the batch-2 graph alone was new
