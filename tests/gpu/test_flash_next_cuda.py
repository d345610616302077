"""Qwen3.8-Flash-Next through the engine on CUDA (Triton kernels: the sigmoid-gated norm, the GDN
kernels on its split projections, attention with YaRN's factor, the MoE over the expert cache) against
the whole-sequence reference forward on the CPU in fp32 (issue 38).

- fp32: the greedy tokens of two prompts (one with EOS ids, which reset the n-gram hash), batched,
  identical to the reference's; and again with prefill in chunks of 32 and offloaded experts with
  fewer slots than a token needs; and past QSA's dense span (prompts longer than budget + ratio - 1).
  (These checkpoints are not NVFP4: their MoE is the dense-slot one, which decodes eagerly.)
- NVFP4 synthetic models, bf16: CUDA-graph decode gives the eager engine's tokens and last logits
  bit for bit, inside QSA's dense span and past it.
- bf16: the logits of the step that finishes the prompt within TOL_BF16 (relative RMS) of the fp32
  reference's.

Configurations: the CPU test's two tiny ones, and one at the seeds' model's head shapes (GDN 16 key over
48 value heads of 128, attention 24 heads over 2 KV heads of 256, 4 streams, the PLE's 16 heads of 160).
"""

from __future__ import annotations

import pytest
import torch

from ft.engine import LLM, SamplingParams
from gpu.small_model import small_flash_next as synthetic_model
from test_flash_next_engine import (CASES, GREEDY, GREEDY_OPTS, TEXT, mixed_step_case, prompt_of, reference_greedy,
                                   run_mixed_step, write_checkpoint)

pytestmark = pytest.mark.gpu

FLAGSHIP_HEADS = dict(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=24, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
    num_experts=64, num_experts_per_tok=10, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    hc_count=4, hc_lowrank=32, indexer_n_heads=4, indexer_head_dim=128, ple_layer_ids=[2], ple_embed_dim=2560,
    heads_per_ngram=8, rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)
CONFIGS = {**CASES, "flagship-heads": FLAGSHIP_HEADS}
TOL_BF16 = 0.1


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, write_checkpoint(path, {**TEXT, **CONFIGS[request.param]})


def engine(path, dtype: str, **opts) -> LLM:
    return LLM(model=str(path), **{**dict(device="cuda", dtype=dtype, page_size=16, max_running_requests=4,
                                          num_tokens=512), **opts})


def test_fp32_tokens_equal_the_reference(checkpoint):
    name, path, weights = checkpoint
    prompts = [prompt_of(50, 1, eos_at=(17, 30)), prompt_of(41, 2)]
    want = [reference_greedy(weights, path, p) for p in prompts]
    opts = dict(max_new_tokens=GREEDY, temperature=0.0, ignore_eos=True)
    with engine(path, "float32") as llm:
        assert [r.token_ids for r in llm.generate(prompt_token_ids=prompts, **opts)] == want, name
    with engine(path, "float32", max_prefill_length=32, moe_backend="offload", moe_cache_size=12) as llm:
        assert [r.token_ids for r in llm.generate(prompt_token_ids=prompts, **opts)] == want, name
        assert llm.engine.pools.experts.stats.misses > 12, name  # experts were evicted and read again


def test_bf16_logits_near_the_reference(checkpoint):
    from ft.model.config import ModelConfig
    from ft.model.qwen3_8_flash_next import hashing_of
    from ft.model.qwen3_8_flash_next_reference import forward_logits

    name, path, weights = checkpoint
    prompt = prompt_of(50, 1, eos_at=(17, 30))
    cfg = ModelConfig.from_file(path)
    with torch.no_grad():
        want = forward_logits(torch.tensor(prompt), weights, cfg.flash_next,
                              hashing_of(cfg) if cfg.flash_next.ple_layers else None)[-1]
    with engine(path, "bfloat16") as llm:
        eng = llm.engine
        seq = eng.add_request(prompt, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
        while not seq.output_ids:
            eng.step()
        got = eng.last_logits[0].float().cpu()
    err = float((got - want).norm() / want.norm())
    assert err < TOL_BF16, f"{name}: relative RMS {err:.3g}"


@pytest.mark.parametrize("prefill_select", ["torch", "kernel"])
def test_qsa_past_its_span_equals_the_reference(tmp_path, prefill_select):
    """Prompts of 150 and 90 tokens past the span of a 32-token budget (35), batched with one inside
    it: prefill in chunks of 64 selects by the decode path's Triton top-k (`QsaOptions.prefill_select_kernel`,
    the default) or in torch (variant qsa-prefill-select-torch), decode selects on the device (`block_scores`)."""
    from ft.kernels.options import use_kernel_options, variant

    path = tmp_path / "m"
    weights = write_checkpoint(path, {**TEXT, "indexer_budget": 32})
    prompts = [prompt_of(150, 4, eos_at=(70,)), prompt_of(90, 5), prompt_of(20, 6)]
    want = [reference_greedy(weights, path, p) for p in prompts]
    options = variant(*(["qsa-prefill-select-torch"] if prefill_select == "torch" else []))
    with use_kernel_options(options), engine(path, "float32", max_prefill_length=64, num_tokens=1024) as llm:
        assert [r.token_ids for r in llm.generate(prompt_token_ids=prompts, **GREEDY_OPTS)] == want


def test_a_mixed_steps_decoding_rows_past_the_span_equal_the_reference(tmp_path, monkeypatch):
    """The CPU test's mixed step on CUDA (`tests/test_flash_next_engine.py`, `mixed_step_case`): a prompt
    prefilled beside two streams decoding past QSA's dense span; the streams' rows run as one decode batch
    (`ForwardBatch.decode_rows`: the decode kernels' block scores, top-k and sparse attention), and every
    request's greedy tokens are the fp32 reference's."""
    path, prompts, want, rows = mixed_step_case(tmp_path, monkeypatch)
    with engine(path, "float32", max_prefill_length=64, num_tokens=1024) as llm:
        lengths, mixed, got = run_mixed_step(llm, prompts, rows)
    assert mixed and all(r == (True, lengths) for r in mixed)  # ungated: a mixed step's decode batch
    assert got == want


@pytest.mark.parametrize("budget,pdl", [(2048, None), (32, None), (32, True), (32, False)],
                         ids=["2048", "32", "32-pdl", "32-no-pdl"])
def test_graph_decode_equals_eager_bitwise(tmp_path, monkeypatch, budget, pdl):
    """bf16 NVFP4 at the seeds' head shapes and expert width (640): the same requests through decode
    graphs and eagerly give the same tokens, and the last step's logits bit for bit; with a budget of
    32 two of the prompts are past QSA's dense span, so the graphs hold the selection. Three requests in
    the 4-row graph (buckets 1, 2, 4) with exactly three mamba slots: the padding row (slot -1) must
    write no live state (before `write_slots` it wrote the third request's n-gram context and PLE
    history). By default (pdl None) the graphs capture with PDL (the model's `decode_graph_pdl`: every
    kernel of the step, the HyperConnection's and QSA's included, waits for the one before it) and the eager
    run launches plainly; with variant "pdl" both runs launch with it, with "no-pdl" neither."""
    if pdl is not None:
        from ft.kernels import options

        # (put back after the test)
        monkeypatch.setattr(options, "_current", options.variant("pdl" if pdl else "no-pdl"))
    model = synthetic_model(tmp_path, indexer_budget=budget)
    prompts = [prompt_of(50, 1, eos_at=(17, 30)), prompt_of(141, 2), prompt_of(9, 3)]
    runs = []
    for opts in ({}, {"disable_cuda_graph": True}):
        with LLM(model=model, device="cuda", dtype="bfloat16", moe_backend="resident", page_size=16,
                 max_running_requests=4, mamba_cache_size=3, num_tokens=1024, max_prefill_length=64, **opts) as llm:
            tokens = [r.token_ids for r in llm.generate(prompt_token_ids=prompts, max_new_tokens=24,
                                                        temperature=0.0, ignore_eos=True)]
            graphs = llm.engine.runner.graphs
            runs.append((tokens, llm.engine.last_logits.clone(), graphs.replays if graphs else 0))
    (got, got_logits, replays), (want, want_logits, _) = runs
    assert replays > 0 and got == want
    assert torch.equal(got_logits, want_logits)


@pytest.mark.parametrize("backend", ["resident", "offload"])
def test_an_ngram_table_on_disk_gives_the_same_bits_in_graphs(tmp_path, backend):
    """--ngram-table disk (the table mapped from a file, each step's rows read by the host into a pinned
    staging buffer, the step's stream waiting for them at the table's layer): the same tokens, and the last step's logits bit for bit,
    as the table in pinned host memory read by the device; both runs' decode steps replay CUDA graphs
    (overlapped: the disk run's replays are launched before their rows are read), offloaded experts
    read through as well."""
    model = synthetic_model(tmp_path)
    prompts = [prompt_of(50, 1, eos_at=(17, 30)), prompt_of(141, 2), prompt_of(9, 3)]
    runs = []
    for where in ("host", "disk"):
        with LLM(model=model, device="cuda", dtype="bfloat16", moe_backend=backend, page_size=16,
                 max_running_requests=4, num_tokens=1024, max_prefill_length=64, ngram_table=where) as llm:
            assert (llm.engine.model.paged_table is not None) == (where == "disk")
            tokens = [r.token_ids for r in llm.generate(prompt_token_ids=prompts, max_new_tokens=24,
                                                        temperature=0.0, ignore_eos=True)]
            runs.append((tokens, llm.engine.last_logits.clone(), llm.engine.runner.graphs.replays,
                         llm.engine.overlapped_steps, llm.engine.runner.launcher.rows_after_launch))
    (want, want_logits, replays_host, _, _), (got, got_logits, replays_disk, overlapped, after_launch) = runs
    assert replays_host > 0 and replays_disk > 0 and overlapped > 0 and got == want
    assert after_launch > 0  # steps launched before their rows were read (the gate, `RowsBuffer`)
    assert torch.equal(got_logits, want_logits)
