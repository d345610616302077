"""An NVFP4 checkpoint (written by `ft quantize`) gives the same greedy tokens as transformers run
on the dequantized weights, with the experts offloaded and resident."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the Triton test below runs on CPU

import pytest

from ft.engine import LLM, SamplingParams
from nvfp4_pair import quantized_pair as _quantized_pair
from test_oracle import GREEDY_32, hf_greedy, prompt_of, rel_err, hf_last_logits, first_step_logits


@pytest.fixture(scope="module")
def nvfp4_pair(tiny_one, tmp_path_factory):
    return _quantized_pair(tiny_one[2], tmp_path_factory)


def _two_layer_pair(tmp_path_factory, name: str, **extra):
    """The first tiny config cut to two layers (a Gated DeltaNet layer, then an attention layer,
    each with its MoE), quantized: every kernel kind of the step, half the launches (the Triton
    interpreter's time is per launched program)."""
    from conftest import TINY_CONFIGS, make_hf_model, save_checkpoint

    overrides = {**next(iter(TINY_CONFIGS.values())), "num_hidden_layers": 2, **extra}
    src = save_checkpoint(make_hf_model(overrides), tmp_path_factory.mktemp(name))
    return _quantized_pair(src, tmp_path_factory)


@pytest.fixture(scope="module")
def nvfp4_pair_2l(tmp_path_factory):
    return _two_layer_pair(tmp_path_factory, "two-layers")


@pytest.fixture(scope="module")
def nvfp4_pair_shared_fused(tmp_path_factory):
    """With the shared expert in the routed experts' shapes (as the flagship): the decode MoE then
    runs the shared expert as one more pair (`moe_decode_triton`)."""
    return _two_layer_pair(tmp_path_factory, "shared-fused", shared_expert_intermediate_size=32)


@pytest.mark.parametrize("backend", ["offload", "resident"])
def test_nvfp4_checkpoint_matches_transformers_on_dequantized_weights(nvfp4_pair, backend):
    ref, path = nvfp4_pair
    opts = dict(moe_cache_size=3) if backend == "offload" else {}
    llm = LLM(model=str(path), device="cpu", dtype="float32", page_size=16, moe_backend=backend, **opts)
    prompt = prompt_of(60, seed=9)
    assert rel_err(first_step_logits(llm, prompt), hf_last_logits(ref, prompt)) < 1e-4
    assert llm.generate(prompt_token_ids=[prompt], **GREEDY_32)[0].token_ids == hf_greedy(ref, prompt)


@pytest.mark.parametrize(("pair", "kernel_variant"), [("nvfp4_pair_2l", None), ("nvfp4_pair_shared_fused", None),
                                                      ("nvfp4_pair_shared_fused", "route-lookup-apart")])
def test_engine_on_the_triton_kernels_matches_transformers(pair, kernel_variant, request, monkeypatch):
    """The engine's CUDA path (the Triton NVFP4 linear and MoE kernels behind the dispatchers), run
    here under the Triton interpreter in float32: prefill through the tl.dot tiles and the MoE's
    grouped path (its threshold lowered to 8 tokens), decode through the whole-K GEMV and the MoE's
    per-pair path, offloaded experts (3 slots) read from the host store and landed; with the shared expert in the routed
    experts' shapes, the decode MoE with the shared expert as one more pair (`moe_decode_triton`); each decode
    step's routing and expert lookup in one launch, or in two under the variant "route-lookup-apart"."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 set before triton was imported")
    import ft.kernels.moe.kernel as moe_triton
    import ft.kernels.nvfp4.kernel as nvfp4_triton

    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    monkeypatch.setattr(moe_triton, "GROUPED_MIN_TOKENS", 8)
    calls = {"linear": 0, "moe": 0, "grouped": 0, "decode": 0, "fused": 0}
    real_linear, real_moe = nvfp4_triton.nvfp4_linear_triton, moe_triton.moe_over_slots_triton

    def count(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(nvfp4_triton, "nvfp4_linear_triton", count("linear", real_linear))
    monkeypatch.setattr(moe_triton, "moe_over_slots_triton", count("moe", real_moe))
    monkeypatch.setattr(moe_triton, "grouped_moe", count("grouped", moe_triton.grouped_moe))
    import ft.kernels.moe.decode_kernel as moe_decode

    real_decode = moe_decode.moe_decode_triton

    def decode(x, slots, weights, w, shared=None, **kw):
        calls["decode"] += 1
        calls["fused"] += shared is not None
        assert kw.get("host") is not None and kw.get("topk_dst") is not None  # read-through decode
        return real_decode(x, slots, weights, w, shared, **kw)

    monkeypatch.setattr(moe_decode, "moe_decode_triton", decode)
    import ft.kernels.expert_lookup.kernel as lookup_triton
    import ft.kernels.options as kernel_options

    monkeypatch.setattr(lookup_triton, "route_lookup_owned_triton",
                        count("route_lookup", lookup_triton.route_lookup_owned_triton))
    calls["route_lookup"] = 0
    ref, path = request.getfixturevalue(pair)
    before = kernel_options.kernel_options()  # the variant in force for the whole test, then the options back
    request.addfinalizer(lambda: kernel_options.set_kernel_options(before))
    kernel_options.set_kernel_options(kernel_options.variant(*[v for v in [kernel_variant] if v]))
    llm = LLM(model=str(path), device="cpu", dtype="float32", page_size=16, moe_cache_size=3)
    prompt = prompt_of(24, seed=10)
    # one request (the interpreter makes every prefill cost seconds): the prefill step's logits, then
    # its three greedy tokens
    eng = llm.engine
    seq = eng.add_request(prompt, SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
    while not seq.output_ids:
        eng.step()
    assert rel_err(eng.last_logits[0], hf_last_logits(ref, prompt)) < 1e-4
    eng.run_until_done([seq])
    assert seq.output_ids == hf_greedy(ref, prompt, 3)
    assert calls["linear"] > 0 and calls["moe"] >= calls["grouped"] > 0
    # decode reads misses from the host store (read-through), fused with the shared expert where shapes allow
    assert calls["decode"] > 0 and (calls["fused"] > 0) == (pair == "nvfp4_pair_shared_fused")
    assert llm.engine.pools.experts.read_through.landed_total > 0
    assert (calls["route_lookup"] > 0) == (kernel_variant is None)
