"""Synthetic checkpoints from a config.json alone (used by the GPU benchmarks)."""

from __future__ import annotations

import json

import torch

from ft.engine import LLM
from conftest import BASE, TINY_CONFIGS


def test_synthetic_model_runs_from_config_alone(tmp_path):
    cfg = {**BASE, **TINY_CONFIGS["interval2-gqa2-top2"], "architectures": ["Qwen3NextForCausalLM"],
           "model_type": "qwen3_next"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    llm = LLM(model=f"synthetic:{path}", device="cpu", dtype="float32", moe_cache_size=3, page_size=16)
    e = llm.engine
    assert e.cache.total_experts == 4 * 8 and e.pools.experts.slots.is_nvfp4
    out = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], max_new_tokens=6, temperature=0.0, ignore_eos=True)[0]
    assert len(out.token_ids) == 6 and torch.isfinite(e.last_logits).all()
    again = LLM(model=f"synthetic:{path}", device="cpu", dtype="float32", moe_cache_size=3, page_size=16)
    assert again.generate(prompt_token_ids=[[5, 6, 7, 8]], max_new_tokens=6, temperature=0.0,
                          ignore_eos=True)[0].token_ids == out.token_ids  # seeded: the same weights


def _synthetic(tmp_path, **extra) -> str:
    cfg = {**BASE, **TINY_CONFIGS["interval2-gqa2-top2"], "architectures": ["Qwen3NextForCausalLM"],
           "model_type": "qwen3_next", "num_experts": 64, "num_experts_per_tok": 4, **extra}
    path = tmp_path / f"config-{len(extra)}.json"
    path.write_text(json.dumps(cfg))
    return f"synthetic:{path}"


def test_routing_trace_mode_skews_routing_like_a_trained_model(tmp_path):
    """"routing_trace" in a synthetic config: experts come from per-request traces (Zipf popularity,
    reuse), so an LRU cache of a quarter of the experts hits far more often than with the random
    router's near-uniform routing; the same seed gives the same tokens."""
    import pytest

    from ft.engine import LLM
    from ft.errors import ConfigError

    def run(model):  # one request at a time, a cache of a quarter of the 4 x 64 experts
        llm = LLM(model=model, device="cpu", dtype="float32", moe_cache_size=64, page_size=16, seed=3)
        out = [llm.generate(prompt_token_ids=[[10 + i, 20 + i, 30 + i, 40 + i]], max_new_tokens=40, temperature=0.0,
                            ignore_eos=True)[0].token_ids for i in range(3)]
        return llm.engine.pools.experts.stats.hit_rate, out

    uniform_hits, _ = run(_synthetic(tmp_path))
    traced = _synthetic(tmp_path, routing_trace=True)
    trace_hits, tokens = run(traced)
    assert trace_hits > uniform_hits + 0.15, (trace_hits, uniform_hits)
    assert run(traced)[1] == tokens
    with pytest.raises(ConfigError, match="routing_trace"):
        LLM(model=_synthetic(tmp_path, routing_trace={"zipf": 1}), device="cpu", dtype="float32")
    with pytest.raises(ConfigError, match="seed must be an integer"):
        LLM(model=_synthetic(tmp_path, routing_trace={"seed": "x"}), device="cpu", dtype="float32")


def test_requests_share_the_models_popular_experts():
    """The popularity order is the model's: two requests' traces rank the same experts first (their
    draws differ), so a cache warmed by one request serves the next; the trace's "seed" sets that
    order (default: the engine seed), and the per-request draws stay the engine seed's."""
    import torch

    from ft.engine.worker.routing_override import TraceRouting, trace_popularity_seed
    from ft.tools.routing_trace import CALIBRATED, RoutingTrace, model_popularity

    def counts(routing, rid, n=400):
        rows = torch.tensor([v for _ in range(n) for v in routing.draw([rid], [1])]).view(n, 3, 4)
        return torch.bincount(rows[:, 0].reshape(-1), minlength=64)

    r = TraceRouting(CALIBRATED, 3, 64, 4, seed=5, keep=4)
    a, b = counts(r, "a"), counts(r, "b")
    top_a, top_b = set(a.topk(8).indices.tolist()), set(b.topk(8).indices.tolist())
    assert len(top_a & top_b) >= 5, (top_a, top_b)  # one law; 8 of 64 at random would share ~1
    assert not torch.equal(a, b)  # two requests, two draws
    assert r._trace("a").popularity()[1] == r._trace("b").popularity()[1] == r.popularity
    assert r.popularity == model_popularity(3, 64, 5)
    other = TraceRouting(CALIBRATED, 3, 64, 4, seed=5, keep=4, popularity_seed=9)
    assert other.popularity == model_popularity(3, 64, 9) != r.popularity
    assert trace_popularity_seed({"seed": 9}, 5) == 9 and trace_popularity_seed(True, 5) == 5
    own = RoutingTrace(3, 64, 4, seed=7)  # a trace without a shared order draws its own from its seed
    assert own.popularity()[1] == RoutingTrace(3, 64, 4, seed=7).popularity()[1] != r.popularity


def test_forced_routing_weights_are_the_routers_softmax_at_the_given_experts():
    import torch

    from ft.kernels.router import route_forced_ref

    logits = torch.randn(3, 9)  # 8 experts and the shared gate's column
    ids = torch.tensor([[1, 5], [7, 0], [2, 3]])
    w, got_ids, slots = route_forced_ref(logits, ids, True, shared_gate=True, slot_table=torch.arange(8) * 2)
    probs = torch.softmax(logits[:, :8], dim=-1).gather(1, ids)
    assert torch.allclose(w[:, :2], probs / probs.sum(1, keepdim=True)) and torch.equal(got_ids, ids)
    assert torch.allclose(w[:, 2], torch.sigmoid(logits[:, 8])) and torch.equal(slots, (ids * 2).to(torch.int32))


def test_trace_prefetch_draws_the_same_tokens():
    """Drawing a request's next token ahead (while the device runs) changes no draw."""
    from ft.engine.worker.routing_override import TraceRouting
    from ft.tools.routing_trace import CALIBRATED

    plain, ahead = (TraceRouting(CALIBRATED, 3, 32, 4, seed=2, keep=4) for _ in range(2))
    want = [plain.draw(["a", "b"], [3, 1])] + [plain.draw(["a", "b"], [1, 1]) for _ in range(3)] + \
        [plain.draw(["a"], [2])]
    got = [ahead.draw(["a", "b"], [3, 1])]
    for _ in range(3):
        ahead.prefetch(["a", "b"])
        got.append(ahead.draw(["a", "b"], [1, 1]))
    ahead.prefetch(["a"])
    got.append(ahead.draw(["a"], [2]))
    assert got == want


def test_a_prefill_chunk_is_drawn_at_once_distinct_deterministic_and_as_popular():
    """Rows of a request from BULK_MIN_TOKENS on come drawn at once as a tensor (Gumbel top-k on the
    device): k distinct experts per token and layer, the same for a seed, the most popular expert's
    share within a few points of the per-token draw's; the next per-token draw continues from the
    chunk's last token, and a step mixing both keeps row order."""
    import torch

    from ft.engine.worker.routing_override import BULK_MIN_TOKENS, TraceRouting
    from ft.tools.routing_trace import CALIBRATED, RoutingParams

    n = 3000
    bulk = TraceRouting(CALIBRATED, 4, 128, 6, seed=3, keep=4).draw(["a"], [n])
    assert isinstance(bulk, torch.Tensor) and torch.equal(bulk, TraceRouting(CALIBRATED, 4, 128, 6, seed=3, keep=4)
                                                           .draw(["a"], [n]))
    rows = bulk.view(n, 4, 6)
    assert bool((rows.sort(-1).values.diff(dim=-1) > 0).all()) and int(rows.min()) >= 0 and int(rows.max()) < 128
    share = torch.bincount(rows[:, 0].reshape(-1), minlength=128).max().item() / n
    one = TraceRouting(CALIBRATED, 4, 128, 6, seed=3, keep=4)  # the same trace (its permutation), token by token
    per_rows = torch.tensor([v for _ in range(n) for v in one.draw(["a"], [1])]).view(n, 4, 6)
    per_share = torch.bincount(per_rows[:, 0].reshape(-1), minlength=128).max().item() / n
    assert abs(share - per_share) < 0.08 and share > 3 * 6 / 128
    r = TraceRouting(RoutingParams(0.0, 1.0), 2, 32, 3, seed=1, keep=4)  # reuse always
    chunk = r.draw(["a"], [BULK_MIN_TOKENS]).view(-1, 2, 3)
    nxt = r.draw(["a"], [1])
    assert isinstance(nxt, list) and sorted(nxt[:3]) == sorted(chunk[-1, 0].tolist())
    mixed = r.draw(["b", "c"], [2, BULK_MIN_TOKENS])
    assert isinstance(mixed, torch.Tensor) and mixed.numel() == (2 + BULK_MIN_TOKENS) * 6
