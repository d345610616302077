"""Streamed expert prefill (`ft.memory.prefill_stream`, `ft.kernels.moe.moe_over_pools`) on the CPU:
a chunk's experts split between the cache's slots and staging pages give the bits of one pool that
holds every expert (reference and Triton interpreter), the plan stages exactly what the cache lacks
through a ring smaller than the layer, and nothing lands in the cache (the admission rule)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import numpy as np
import pytest
import torch

from ft.kernels.moe import SlotWeights, moe_over_pools, moe_over_pools_ref, moe_over_slots_ref
from ft.memory.expert_cache import ExpertCache
from ft.memory.prefill_stream import PrefillStream, _runs
from ft.tools.nvfp4_quantize import quantize_nvfp4


def _pool(layers: int, experts: int, h: int, i: int, gen: torch.Generator) -> SlotWeights:
    """An NVFP4 host store [L, E, ...] of random experts."""
    parts = [[], [], [], [], []]
    for _ in range(layers * experts):
        gate, up = (quantize_nvfp4(torch.randn(i, h, generator=gen) * 0.2) for _ in range(2))
        down = quantize_nvfp4(torch.randn(h, i, generator=gen) * 0.2)
        for acc, t in zip(parts, (torch.cat([gate[0], up[0]]), down[0], torch.cat([gate[1], up[1]]), down[1],
                                  torch.stack([gate[2], up[2], down[2]]))):
            acc.append(t)
    return SlotWeights(*(torch.stack(p).reshape(layers, experts, *p[0].shape) for p in parts))


def _layer(host: SlotWeights, layer: int) -> SlotWeights:
    return SlotWeights(*(t[layer] for t in host))


def _routing(t: int, k: int, e: int, gen: torch.Generator):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    return ids, torch.softmax(torch.randn(t, k, generator=gen), dim=-1)


def test_runs_are_the_consecutive_stretches():
    assert list(_runs(np.array([0, 1, 2, 5, 7, 8]))) == [(0, 3, 0), (5, 6, 3), (7, 9, 4)]
    assert list(_runs(np.array([], dtype=np.int64))) == []


def test_reference_over_two_pools_equals_one_pool_bitwise():
    gen = torch.Generator().manual_seed(1)
    host = _pool(1, 8, 32, 16, gen)
    whole = _layer(host, 0)
    ids, weights = _routing(11, 3, 8, gen)
    x = torch.randn(11, 32, generator=gen)
    ref = moe_over_slots_ref(x, ids, weights, whole)
    low = torch.where(ids < 3, ids, -1)  # experts 0..2 in pool A (as themselves)
    high = torch.where(ids >= 3, ids - 3, -1)  # 3..7 in pool B at 0..4
    pool_b = SlotWeights(*(t[3:] for t in whole))
    out = moe_over_pools_ref(x, weights, [(low, whole), (high, pool_b)])
    assert torch.equal(out, ref)
    assert torch.equal(moe_over_pools(x, weights, iter([(low, whole), (high, pool_b)])), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_over_pools_equals_one_grouped_pool_bitwise(dtype, monkeypatch):
    pytest.importorskip("triton")
    from ft.kernels.moe.kernel import moe_over_pools_triton, moe_over_slots_triton

    gen = torch.Generator().manual_seed(2)
    host = _pool(1, 6, 32, 16, gen)
    whole = _layer(host, 0)
    ids, weights = _routing(9, 2, 6, gen)
    x = torch.randn(9, 32, generator=gen).to(dtype)
    weights = weights.to(dtype)
    one = moe_over_slots_triton(x, ids, weights, whole, grouped=True)
    a = torch.where(ids % 2 == 0, ids, -1)
    b = torch.where(ids % 2 == 1, ids // 2, -1)
    odd = SlotWeights(*(t[1::2].contiguous() for t in whole))
    two = moe_over_pools_triton(x, weights, iter([(a, whole), (b, odd)]))
    assert torch.equal(two, one)
    assert (moe_over_slots_ref(x, ids, weights, whole).float() - one.float()).abs().max() < 5e-2


def _cache_with(host: SlotWeights, slots: int, resident: dict[int, list[int]]) -> ExpertCache:
    cache = ExpertCache(host, slots, torch.device("cpu"))
    for layer, experts in resident.items():
        cache.ensure(layer, experts, count=False)
    return cache


@pytest.mark.parametrize("loader", ["auto", "gather", "copy"])
def test_stream_stages_what_the_cache_lacks_and_lands_nothing(loader):
    gen = torch.Generator().manual_seed(3)
    host = _pool(2, 10, 32, 16, gen)
    cache = _cache_with(host, 6, {0: [1, 2, 7], 1: [0, 9, 4]})
    cache.enable_prefill_stream(page_experts=2, pages=2, loader=loader)  # 7 missing experts, a ring of 4 slots
    stream = cache.prefill_stream
    before = (list(cache.residents_oldest_first()), cache.table_np.copy(), cache.slot_table.clone(),
              cache.stats.hits, cache.stats.misses)
    for layer in (0, 1):
        ids, weights = _routing(13, 4, 10, gen)
        x = torch.randn(13, 32, generator=gen)
        out = moe_over_pools(x, weights, stream.passes(layer, ids), experts=10)
        assert torch.equal(out, moe_over_slots_ref(x, ids, weights, _layer(host, layer)))
    assert stream.stats.experts == 14 and stream.stats.chunks == 2
    # gather: a launch per page and tensor (4 pages a layer); copy: a call per run inside a page and
    # tensor (pages [0, 3] [4, 5] [6, 8] [9]: 6 runs; [1, 2] [3, 5] [6, 7] [8]: 5)
    # auto: these experts are tiny (a page's bus time is nothing against a copy call's host time)
    assert stream.stats.copies == (11 if loader == "copy" else 8) * 5
    per_expert = sum(t[0, 0].numel() * t.element_size() for t in host)
    assert stream.stats.bytes == 14 * per_expert
    after = (list(cache.residents_oldest_first()), cache.table_np, cache.slot_table, cache.stats.hits,
             cache.stats.misses)
    assert after[0] == before[0] and np.array_equal(after[1], before[1]) and torch.equal(after[2], before[2])
    assert after[3:] == before[3:]


def test_the_gather_loader_fills_pages_through_the_triton_kernel(monkeypatch):
    """Under the interpreter the gather loader runs `copy_rows_triton`: each page holds its experts'
    rows bit for bit, and the passes over them give one pool's bits."""
    pytest.importorskip("triton")
    from ft.kernels.host_gather import kernel as details

    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    launched = []
    real = details.copy_rows_triton
    monkeypatch.setattr(details, "copy_rows_triton", lambda *a, **k: launched.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(5)
    host = _pool(1, 7, 32, 16, gen)
    cache = _cache_with(host, 3, {0: [2, 3]})
    cache.enable_prefill_stream(page_experts=3, pages=2, loader="gather")  # 5 missing: pages of 3 and 2
    stream = cache.prefill_stream
    ids, weights = _routing(9, 3, 7, gen)
    x = torch.randn(9, 32, generator=gen)
    with torch.no_grad():
        out = moe_over_pools_ref(x, weights, list(stream.passes(0, ids)))
    assert torch.equal(out, moe_over_slots_ref(x, ids, weights, _layer(host, 0)))
    assert len(launched) == 2 * 5
    # the second page (slots 3..4) holds experts 5 and 6 in every tensor
    for dst, src in zip(stream.staging, host):
        assert torch.equal(dst[3:5], src[0, 5:7])


def test_auto_copies_a_page_of_few_runs_and_gathers_a_scattered_one():
    """The `auto` loader's rule on the 80B's expert (1.77 MB, 5 tensors): a page of 64 experts is
    copied in up to 15 runs (75 calls of 15 us within half its 2.3 ms on a 50 GB/s bus), gathered
    from 16 runs on; a page of one expert in one run is gathered (a call's 75 us against 18 us)."""
    gen = torch.Generator().manual_seed(6)
    host = _pool(1, 4, 32, 16, gen)
    cache = _cache_with(host, 2, {})
    cache.enable_prefill_stream(page_experts=2)
    stream = cache.prefill_stream
    stream.expert_bytes = 1_770_000  # as the 80B's NVFP4 expert
    assert stream.copy_keeps_up(15, 64) and not stream.copy_keeps_up(16, 64)
    assert stream.copy_keeps_up(1, 64) and not stream.copy_keeps_up(1, 1)


def test_stream_with_an_empty_cache_and_a_full_one():
    gen = torch.Generator().manual_seed(4)
    host = _pool(1, 5, 32, 16, gen)
    for resident in ([], [0, 1, 2, 3, 4]):
        cache = _cache_with(host, 5, {0: resident} if resident else {})
        cache.enable_prefill_stream(page_experts=3)
        ids, weights = _routing(7, 2, 5, gen)
        x = torch.randn(7, 32, generator=gen)
        out = moe_over_pools(x, weights, cache.prefill_stream.passes(0, ids), experts=5)
        assert torch.equal(out, moe_over_slots_ref(x, ids, weights, _layer(host, 0)))
        assert cache.prefill_stream.stats.experts == 5 - len(resident)


def test_staging_bytes_match_the_allocation():
    gen = torch.Generator().manual_seed(5)
    host = _pool(1, 4, 32, 16, gen)
    cache = ExpertCache(host, 2, torch.device("cpu"))
    cache.enable_prefill_stream(page_experts=3, pages=2)
    assert cache.prefill_stream.nbytes == PrefillStream.bytes_for(host, 3, 2)
    with pytest.raises(ValueError):
        PrefillStream(cache, 0)


# ------------------------------------------------------------------ the engine (offloaded prefill)
GREEDY = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


def _llm(path, **opts):
    from ft.engine import LLM

    base = dict(device="cpu", dtype="float32", page_size=16, max_running_requests=4)
    return LLM(model=str(path), **{**base, **opts})


def test_offloaded_prefill_streams_and_matches_transformers(tiny):
    name, model, path = tiny
    cfg = model.config
    prompts = [_prompt(150, 11), _prompt(140, 12)]  # chunks of > 128 tokens stream
    offload = _llm(path, moe_backend="offload", moe_cache_size=max(1, 2 * cfg.num_experts_per_tok - 1),
                   prefill_stream_experts=6)
    stream = offload.engine.pools.experts.prefill_stream
    assert stream is not None and stream.min_tokens == 129
    got = offload.generate(prompt_token_ids=prompts, **GREEDY)
    assert stream.stats.chunks > 0 and stream.stats.experts > 0
    resident = _llm(path, moe_backend="resident").generate(prompt_token_ids=prompts, **GREEDY)
    for p, o, r in zip(prompts, got, resident):
        ids = torch.tensor([p])
        hf = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                            attention_mask=torch.ones_like(ids))[0, len(p):].tolist()
        assert o.token_ids == r.token_ids == hf, name


def test_a_streamed_prefill_evicts_nothing_decode_uses(tiny_one):
    """The admission rule: after a short request fills the cache, a long prompt's prefill leaves the
    residents as they were (streamed); loaded into the cache (--prefill-stream-experts 0, the CPU's
    default) it evicts."""
    _, model, path = tiny_one
    slots = 2 * model.config.num_experts_per_tok
    residents = {}
    for n in (6, 0):
        llm = _llm(path, moe_backend="offload", moe_cache_size=slots, prefill_stream_experts=n)
        cache = llm.engine.pools.experts
        assert (cache.prefill_stream is None) == (n == 0)
        llm.generate(prompt_token_ids=[_prompt(20, 13)], **GREEDY)  # short: decodes, fills the cache
        cache.collect()  # what the last decode step landed (read-through)
        before = sorted(cache.residents_oldest_first())
        llm.generate(prompt_token_ids=[_prompt(200, 14)], max_new_tokens=1, temperature=0.0, ignore_eos=True)
        residents[n] = (before, sorted(cache.residents_oldest_first()))
    assert residents[6][0] == residents[6][1]
    assert residents[0][0] != residents[0][1]


def test_streaming_is_on_by_default_on_cuda_only(tiny_one):
    _, _, path = tiny_one
    assert _llm(path, moe_backend="offload").engine.pools.experts.prefill_stream is None  # the CPU
    assert _llm(path, moe_backend="offload", prefill_stream_experts=7).engine.pools.experts.prefill_stream.nbytes > 0


def test_running_streams_decode_while_a_long_prompt_streams(tiny_one):
    """Item 4: a 420-token prompt prefilled in streamed chunks of 140 (mixed steps) holds the device
    for one chunk at a time: the two requests already decoding gain a token in each of its steps,
    and every request's tokens are the resident engine's."""
    from ft.engine import SamplingParams

    _, model, path = tiny_one
    greedy = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [_prompt(9, 21), _prompt(23, 22), _prompt(420, 23)]
    want = _llm(path, moe_backend="resident").generate(prompt_token_ids=prompts, **greedy)
    llm = _llm(path, moe_backend="offload", moe_cache_size=2 * model.config.num_experts_per_tok,
               prefill_stream_experts=6, max_prefill_length=140)
    e = llm.engine
    stream = e.pools.experts.prefill_stream
    early = [e.add_request(p, SamplingParams(**greedy)) for p in prompts[:2]]
    while any(len(s.output_ids) < 2 for s in early):
        e.step()
    late = e.add_request(prompts[2], SamplingParams(**greedy))
    before = [len(s.output_ids) for s in early]
    steps = 0
    while not late.output_ids:
        e.step()
        steps += 1
    assert steps >= 3 and stream.stats.chunks >= 3 * len(e.model_config.moe_layers)
    assert all(len(s.output_ids) - b >= 3 for s, b in zip(early, before))
    e.run_until_done(early + [late])
    assert [s.output_ids for s in early + [late]] == [w.token_ids for w in want]


def test_without_overlap_one_staging_page_streams_the_same_tokens(tiny_one):
    """--disable-moe-prefill-overlap (the seeds' flag): the stream's slots make one page, whose copies
    wait for the pass before; what a chunk computes is the ring's, and the banner says so."""
    from ft.serve_cmd import describe

    _, model, path = tiny_one
    prompts = [_prompt(200, 41), _prompt(150, 42)]
    opts = dict(moe_backend="offload", moe_cache_size=2 * model.config.num_experts_per_tok, prefill_stream_experts=6)
    ring, one = _llm(path, **opts), _llm(path, disable_moe_prefill_overlap=True, **opts)
    rs, os_ = ring.engine.pools.experts.prefill_stream, one.engine.pools.experts.prefill_stream
    assert (rs.pages, rs.page_experts, os_.pages, os_.page_experts) == (3, 2, 1, 6)
    assert os_.nbytes == rs.nbytes and one.engine.prefill_stream_reserve >= os_.nbytes
    got = one.generate(prompt_token_ids=prompts, **GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in ring.generate(prompt_token_ids=prompts, **GREEDY)]
    assert os_.stats.experts == rs.stats.experts > 0 and os_.ring == 0
    banner = describe(one.engine, "http://x")
    assert "one page, no overlap: --disable-moe-prefill-overlap" in banner


def test_the_startup_banner_says_how_a_prefill_gets_its_experts(tiny_one):
    from ft.serve_cmd import describe

    _, _, path = tiny_one
    lines = {n: next(line for line in describe(_llm(path, **opts).engine, "http://x").splitlines()
                     if line.startswith("  prefill:"))
             for n, opts in (("stream", dict(moe_backend="offload", prefill_stream_experts=6, max_prefill_length=512)),
                             ("load", dict(moe_backend="offload")), ("resident", dict(moe_backend="resident")))}
    assert lines["stream"].startswith("  prefill: chunks of 512 tokens (--max-prefill-length); a chunk of more than "
                                      "128 tokens streams the experts the cache lacks through 6 staging slots (")
    assert lines["load"].endswith("a chunk's experts load into the cache (--prefill-stream-experts 0)")
    assert lines["resident"] == "  prefill: chunks of 4096 tokens (--max-prefill-length)"


def test_streamed_bytes_reach_the_published_figures_and_metrics(tiny_one):
    from ft.server.metrics import Metrics

    _, model, path = tiny_one
    llm = _llm(path, moe_backend="offload", moe_cache_size=2 * model.config.num_experts_per_tok,
               prefill_stream_experts=6)
    llm.generate(prompt_token_ids=[_prompt(200, 31)], max_new_tokens=2, temperature=0.0, ignore_eos=True)
    stream, stats = llm.engine.pools.experts.prefill_stream, llm.engine.stats()
    assert stats.streamed_bytes == stream.stats.bytes > 0 and stats.streamed_experts == stream.stats.experts > 0
    text = Metrics("m").render(stats).decode()
    assert f'ft_expert_prefill_streamed_bytes_total{{model_name="m"}} {float(stream.stats.bytes)}' in text
    assert f'ft_expert_prefill_streamed_total{{model_name="m"}} {float(stream.stats.experts)}' in text
