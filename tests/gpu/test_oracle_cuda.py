"""The engine on CUDA against transformers (float32 on the CPU) on the tiny random checkpoints of
tests/conftest.py: last prefill logits within 1e-4 relative and 32 identical greedy tokens, with
the experts offloaded (fewer slots than two tokens need) and resident, with a live resize in
the middle of the generation."""

from __future__ import annotations

import pytest

from ft.engine import LLM, SamplingParams
from test_oracle import GREEDY_32, first_step_logits, hf_greedy, hf_last_logits, prompt_of, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["offload", "resident"])
def test_cuda_engine_matches_transformers(tiny, backend):
    _, model, path = tiny
    # offload: one slot more than one token's experts, fewer than two tokens need
    opts = dict(moe_cache_size=model.config.num_experts_per_tok + 1) if backend == "offload" else {}
    llm = LLM(model=str(path), device="cuda", dtype="float32", page_size=16, moe_backend=backend, **opts)
    prompt = prompt_of(70, seed=11)
    assert rel_err(first_step_logits(llm, prompt).cpu(), hf_last_logits(model, prompt)) < 1e-4
    assert llm.generate(prompt_token_ids=[prompt], **GREEDY_32)[0].token_ids == hf_greedy(model, prompt)


def test_cuda_engine_tokens_survive_live_resizes(tiny):
    _, model, path = tiny
    llm = LLM(model=str(path), device="cuda", dtype="float32", page_size=16, num_tokens=1024, moe_cache_size=4)
    e = llm.engine
    assert e.cache.layout.backend == "vmm"
    prompt = prompt_of(50, seed=12)
    seq = e.add_request(prompt, SamplingParams(**GREEDY_32))
    for target in (dict(kv=256, moe=8), dict(mamba=3), dict(kv=2048, moe=e.cache.expert_floor, mamba=9)):
        for _ in range(6):
            e.step()
        e.cache.rebuild(**target)
    e.run_until_done([seq])
    assert seq.output_ids == hf_greedy(model, prompt)


def test_cuda_nvfp4_engine_long_prefill_matches_transformers(tiny_one, tmp_path_factory, monkeypatch):
    """An NVFP4 checkpoint on CUDA with a prompt past DEQUANT_MM_MIN_M tokens, so that the prefill's
    dense projections run as one weight decode plus cuBLAS: the last prefill logits against
    transformers on the dequantized weights (float32). The threshold is lowered to 256 rows (the
    library's 1,024 is past the tiny model's 512-token context); the dispatcher reads it per call."""
    import ft.kernels.nvfp4 as nvfp4
    import ft.kernels.nvfp4.dequant_kernel as details
    from nvfp4_pair import quantized_pair

    monkeypatch.setattr(nvfp4, "DEQUANT_MM_MIN_M", 256)
    DEQUANT_MM_MIN_M = nvfp4.DEQUANT_MM_MIN_M
    calls = []
    real = details.nvfp4_linear_dequant_mm
    monkeypatch.setattr(details, "nvfp4_linear_dequant_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ref, path = quantized_pair(tiny_one[2], tmp_path_factory)
    llm = LLM(model=str(path), device="cuda", dtype="float32", page_size=16)
    prompt = prompt_of(DEQUANT_MM_MIN_M + 44, seed=13)
    assert rel_err(first_step_logits(llm, prompt).cpu(), hf_last_logits(ref, prompt)) < 1e-4
    assert calls


@pytest.mark.parametrize("backend", ["offload", "resident"])
def test_cuda_mixed_prefill_and_decode_match_transformers(tiny, backend):
    """Mixed steps on CUDA (`mix_prefill_decode`): two requests decoding while a 150-token prompt is
    prefilled in chunks of 32 carrying their rows, so the prefill kernels take one-token chunks
    beside a long one: every request's 32 greedy tokens are transformers'."""
    _, model, path = tiny
    opts = dict(moe_cache_size=model.config.num_experts_per_tok + 1) if backend == "offload" else {}
    llm = LLM(model=str(path), device="cuda", dtype="float32", page_size=16, moe_backend=backend,
              max_prefill_length=32, prefill_graph_max_tokens=0, **opts)
    e = llm.engine
    early = [e.add_request(prompt_of(n, seed=20 + n), SamplingParams(**GREEDY_32)) for n in (9, 23)]
    while any(len(s.output_ids) < 2 for s in early):
        e.step()
    late = e.add_request(prompt_of(150, seed=30), SamplingParams(**GREEDY_32))
    before = [len(s.output_ids) for s in early]
    while not late.output_ids:
        e.step()
    assert all(len(s.output_ids) - b >= 4 for s, b in zip(early, before))  # they decoded meanwhile
    e.run_until_done(early + [late])
    for s, n, seed in ((early[0], 9, 29), (early[1], 23, 43), (late, 150, 30)):
        assert s.output_ids == hf_greedy(model, prompt_of(n, seed=seed)), n


@pytest.mark.parametrize("stream_experts", [3, None])
@pytest.mark.parametrize("loader", ["auto", "gather", "copy"])
def test_cuda_streamed_prefill_gives_the_resident_bits(tiny_one, tmp_path_factory, stream_experts, loader):
    """Offloaded prefill on CUDA streams the experts the cache lacks through staging pages on the copy
    stream (`ft.memory.prefill_stream`): on an NVFP4 checkpoint (the Triton grouped MoE), a 300-token
    prompt's last logits equal the resident engine's bit for bit and so do 32 greedy tokens, with a
    ring of one expert a page (every page refilled many times a layer: the events order it) and with
    the default pages, pages filled by either loader; nothing lands in the cache during the prefill."""
    from nvfp4_pair import quantized_pair

    _, path = quantized_pair(tiny_one[2], tmp_path_factory)
    common = dict(device="cuda", dtype="float32", page_size=16, prefill_graph_max_tokens=0)
    resident = LLM(model=str(path), moe_backend="resident", **common)
    k = resident.engine.model_config.num_experts_per_tok
    offload = LLM(model=str(path), moe_backend="offload", moe_cache_size=k + 1, prefill_stream_experts=stream_experts,
                  **common)
    cache = offload.engine.pools.experts
    assert cache.prefill_stream is not None and cache.prefill_stream.loader == "auto"
    cache.prefill_stream.loader = loader
    prompt = prompt_of(300, seed=17)
    before = sorted(cache.residents_oldest_first())
    got = first_step_logits(offload, prompt)
    assert sorted(cache.residents_oldest_first()) == before and cache.prefill_stream.stats.experts > 0
    assert (got == first_step_logits(resident, prompt)).all()
    prompt = prompt_of(260, seed=18)
    assert offload.generate(prompt_token_ids=[prompt], **GREEDY_32)[0].token_ids == \
        resident.generate(prompt_token_ids=[prompt], **GREEDY_32)[0].token_ids


@pytest.mark.parametrize("backend", ["offload", "resident"])
def test_cuda_engine_with_a_scaled_rope_matches_transformers(backend, tmp_path_factory):
    """Qwen3-Next with YaRN (the model card's way to 1M tokens) on CUDA: the decode kernels take the scaled
    frequencies and the q / k scale (`Rope.scale`), against transformers on the CPU."""
    from conftest import TINY_CONFIGS, make_hf_model, save_checkpoint
    from test_rope_scaling import ROPES

    model = make_hf_model({**TINY_CONFIGS["interval2-gqa2-top2"], "rope_parameters": ROPES["yarn-mscale"]})
    path = save_checkpoint(model, tmp_path_factory.mktemp("rope-yarn-cuda"))
    opts = dict(moe_cache_size=model.config.num_experts_per_tok + 1) if backend == "offload" else {}
    llm = LLM(model=str(path), device="cuda", dtype="float32", page_size=16, moe_backend=backend,
              max_prefill_length=40, **opts)
    prompt = prompt_of(90, seed=4)
    assert rel_err(first_step_logits(llm, prompt).cpu(), hf_last_logits(model, prompt)) < 1e-4
    assert llm.generate(prompt_token_ids=[prompt], **GREEDY_32)[0].token_ids == hf_greedy(model, prompt)
