"""An NVFP4 checkpoint (written by `ft quantize`) gives the same greedy tokens as transformers run
on the dequantized weights, with the experts offloaded and resident."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the Triton test below runs on CPU

import pytest
import torch
from safetensors import safe_open

from ft.engine import LLM
from ft.tools.quantize_checkpoint import quantize_checkpoint
from ft.kernels.nvfp4 import dequantize_nvfp4
from test_oracle import GREEDY_32, hf_greedy, prompt_of, rel_err, hf_last_logits, first_step_logits


@pytest.fixture(scope="module")
def nvfp4_pair(tiny_one, tmp_path_factory):
    return _quantized_pair(tiny_one[2], tmp_path_factory)


@pytest.fixture(scope="module")
def nvfp4_pair_shared_fused(tmp_path_factory):
    """The first tiny config with the shared expert in the routed experts' shapes (as the flagship):
    the decode MoE then runs the shared expert as one more pair (`moe_decode_triton`)."""
    from conftest import TINY_CONFIGS, make_hf_model, save_checkpoint

    overrides = {**next(iter(TINY_CONFIGS.values())), "shared_expert_intermediate_size": 32}
    src = save_checkpoint(make_hf_model(overrides), tmp_path_factory.mktemp("shared-fused"))
    return _quantized_pair(src, tmp_path_factory)


def _quantized_pair(src, tmp_path_factory):
    dst = tmp_path_factory.mktemp("nvfp4") / "ck"
    quantize_checkpoint(src, dst, progress=False)
    # transformers on the dequantized weights: the oracle for the quantized checkpoint
    from transformers import Qwen3NextForCausalLM

    ref = Qwen3NextForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    params = dict(ref.named_parameters())
    n_quantized = 0
    with safe_open(str(dst / "model.safetensors"), "pt") as f, torch.no_grad():
        names = set(f.keys())
        for name in names:
            if not name.endswith(".weight_scale"):
                continue
            module = name.removesuffix(".weight_scale")
            w = dequantize_nvfp4(f.get_tensor(module + ".weight"), f.get_tensor(name), f.get_tensor(module + ".weight_scale_2"))
            _assign(ref, params, module, w)
            n_quantized += 1
    assert n_quantized > 20
    return ref, dst


def _assign(model, params, module: str, w: torch.Tensor) -> None:
    """Write a dequantized projection into the transformers model (experts are fused there)."""
    if ".mlp.experts." in module:
        prefix, rest = module.split(".mlp.experts.")
        e, proj = rest.split(".")
        experts = model.get_submodule(prefix + ".mlp.experts")
        i = experts.gate_up_proj.shape[1] // 2
        if proj == "gate_proj":
            experts.gate_up_proj[int(e), :i] = w
        elif proj == "up_proj":
            experts.gate_up_proj[int(e), i:] = w
        else:
            experts.down_proj[int(e)] = w
        return
    params[module + ".weight"].copy_(w)


@pytest.mark.parametrize("backend", ["offload", "resident"])
def test_nvfp4_checkpoint_matches_transformers_on_dequantized_weights(nvfp4_pair, backend):
    ref, path = nvfp4_pair
    opts = dict(moe_cache_size=3) if backend == "offload" else {}
    llm = LLM(model=str(path), device="cpu", dtype="float32", page_size=16, moe_backend=backend, **opts)
    prompt = prompt_of(60, seed=9)
    assert rel_err(first_step_logits(llm, prompt), hf_last_logits(ref, prompt)) < 1e-4
    assert llm.generate(prompt_token_ids=[prompt], **GREEDY_32)[0].token_ids == hf_greedy(ref, prompt)


@pytest.mark.parametrize("pair", ["nvfp4_pair", "nvfp4_pair_shared_fused"])
def test_engine_on_the_triton_kernels_matches_transformers(pair, request, monkeypatch):
    """The engine's CUDA path (the Triton NVFP4 linear and MoE kernels behind the dispatchers), run
    here under the Triton interpreter in float32: prefill through the tl.dot tiles and the MoE's
    grouped path (its threshold lowered to 8 tokens), decode through the whole-K GEMV and the MoE's
    per-pair path, offloaded experts (3 slots) read from the host store and landed; with the shared expert in the routed
    experts' shapes, the decode MoE with the shared expert as one more pair (`moe_decode_triton`)."""
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
    ref, path = request.getfixturevalue(pair)
    llm = LLM(model=str(path), device="cpu", dtype="float32", page_size=16, moe_cache_size=3)
    prompt = prompt_of(24, seed=10)
    assert rel_err(first_step_logits(llm, prompt), hf_last_logits(ref, prompt)) < 1e-4
    got = llm.generate(prompt_token_ids=[prompt], max_new_tokens=3, temperature=0.0, ignore_eos=True)[0].token_ids
    assert got == hf_greedy(ref, prompt, 3)
    assert calls["linear"] > 0 and calls["moe"] >= calls["grouped"] > 0
    # decode reads misses from the host store (read-through), fused with the shared expert where shapes allow
    assert calls["decode"] > 0 and (calls["fused"] > 0) == (pair == "nvfp4_pair_shared_fused")
    assert llm.engine.pools.experts.read_through.landed_total > 0
