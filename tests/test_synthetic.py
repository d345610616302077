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
