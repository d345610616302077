"""--kv-cache-dtype: the KV pool's dtype and bytes follow it (so do the ladder's and the ranges'
sums), and an fp8 cache (e4m3, per-layer scales) decodes close to an unquantized one (CPU, reference path)."""

from __future__ import annotations

import pytest
import torch

from ft.engine import LLM
from ft.errors import ConfigError
from tests.test_oracle import prompt_of, rel_err


def _llm(path, **kw):
    return LLM(model=str(path), device="cpu", dtype="float32", page_size=16, num_tokens=1024, **kw)


def test_pool_dtype_and_bytes_follow_the_flag(tiny_one):
    _, _, path = tiny_one
    pools = {d: _llm(path, kv_cache_dtype=d).engine for d in ("auto", "bf16", "fp8")}
    kv = {d: e.pools.kv for d, e in pools.items()}
    assert kv["auto"].kv.dtype == torch.float32 and kv["bf16"].kv.dtype == torch.bfloat16
    assert kv["fp8"].kv.dtype == torch.float8_e4m3fn and kv["fp8"].scales.shape == (kv["fp8"].kv.shape[1], 2)
    assert kv["auto"].scales is None and kv["bf16"].scales is None
    assert kv["auto"].bytes_per_page == 2 * kv["bf16"].bytes_per_page == 4 * kv["fp8"].bytes_per_page
    costs = {d: e.cache.layout.unit_costs().kv_page for d, e in pools.items()}
    assert costs["auto"] == 4 * costs["fp8"]  # the manager's byte sums (ranges, ladder) see the real page
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        _llm(path, kv_cache_dtype="nvfp4")


def test_fp8_kv_decodes_close_to_full_precision(tiny_one):
    """Greedy tokens mostly agree and the first step's logits are close (the tiny random model's
    logits are nearly flat, so a flip of the argmax now and then is expected; the bench has the table)."""
    _, model, path = tiny_one
    full, fp8 = _llm(path), _llm(path, kv_cache_dtype="fp8")
    prompts = [prompt_of(40, seed=s) for s in (1, 2, 3)]
    agree = total = 0
    for p in prompts:
        a = full.generate(prompt_token_ids=[p], max_new_tokens=12, temperature=0.0, ignore_eos=True)[0].token_ids
        la = full.engine.last_logits[0].clone()
        b = fp8.generate(prompt_token_ids=[p], max_new_tokens=12, temperature=0.0, ignore_eos=True)[0].token_ids
        lb = fp8.engine.last_logits[0].clone()
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        agree += first
        total += len(a)
        if first == len(a):  # same tokens throughout: the last logits are comparable
            assert rel_err(lb, la) < 0.05
    assert agree / total > 0.5, (agree, total)


def _with_kv_scales(tiny_one, tmp_path, scales=(0.02, 0.01), drop=None):
    """The tiny checkpoint with ModelOpt's FP8 KV scales on every full-attention layer."""
    import torch as _t

    from tests.test_bad_input import clone

    cfg = tiny_one[1].config
    layers = [i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention"]

    def edit(state):
        for i in layers:
            state[f"model.layers.{i}.self_attn.k_proj.k_scale"] = _t.tensor(scales[0])
            state[f"model.layers.{i}.self_attn.v_proj.v_scale"] = _t.tensor(scales[1] * (i + 1))
        if drop is not None:
            state.pop(f"model.layers.{layers[drop]}.self_attn.k_proj.k_scale")

    quant = {"quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}}
    return clone(tiny_one[2], tmp_path / "ck", edit=edit, extra_files={"hf_quant_config.json": quant}), layers


def test_checkpoint_fp8_kv_scales(tiny_one, tmp_path):
    """A checkpoint with ModelOpt's kv_cache_quant_algo FP8 and its per-layer k_scale / v_scale: auto
    gives an fp8 pool holding those scales; bf16 leaves them; a layer without its scale is an error."""
    from ft.errors import CheckpointError

    path, layers = _with_kv_scales(tiny_one, tmp_path)
    e = _llm(path).engine
    kv = e.pools.kv
    assert kv.kv.dtype == torch.float8_e4m3fn
    want = torch.tensor([[0.02, 0.01 * (i + 1)] for i in layers])
    assert torch.allclose(kv.scales, want)
    out = _llm(path).generate(prompt_token_ids=[prompt_of(20, seed=5)], max_new_tokens=4, temperature=0.0,
                              ignore_eos=True)[0].token_ids
    assert len(out) == 4
    assert _llm(path, kv_cache_dtype="bf16").engine.pools.kv.scales is None
    bad, _ = _with_kv_scales(tiny_one, tmp_path / "bad", drop=0)
    with pytest.raises(CheckpointError, match="k_scale"):
        _llm(bad)


def test_unsupported_kv_quantization_is_named(tiny_one, tmp_path):
    from ft.errors import UnsupportedModelError
    from tests.test_bad_input import clone

    quant = {"quantization": {"quant_algo": None, "kv_cache_quant_algo": "INT8"}}
    path = clone(tiny_one[2], tmp_path / "ck", extra_files={"hf_quant_config.json": quant})
    with pytest.raises(UnsupportedModelError, match="KV cache quantization 'INT8'"):
        _llm(path)
