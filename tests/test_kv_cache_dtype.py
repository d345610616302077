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
