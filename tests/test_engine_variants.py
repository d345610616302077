"""Dtypes other than float32 and sharded checkpoints."""

from __future__ import annotations

import pytest
import torch

from ft.engine import LLM
from test_oracle import GREEDY_32, first_step_logits, hf_greedy, hf_last_logits, prompt_of, rel_err


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 3e-2), ("float16", 5e-3)])
def test_half_precision_logits_close_to_float32(tiny_one, dtype, tol):
    """Half-precision logits against transformers in fp32, over five prompts: the median error is
    small. (One prompt alone is fragile: a last-bit change of a hidden state can flip a near-tied
    router choice, which moves that prompt's logits by several percent; seen at 0.07-0.17 in bf16.)"""
    _, model, path = tiny_one
    llm = LLM(model=str(path), device="cpu", dtype=dtype, page_size=16)
    errs = []
    for seed in range(11, 16):
        prompt = prompt_of(40, seed=seed)
        logits = first_step_logits(llm, prompt)
        assert torch.isfinite(logits).all()
        errs.append(rel_err(logits, hf_last_logits(model, prompt)))
    assert sorted(errs)[len(errs) // 2] < tol, errs
    out = llm.generate(prompt_token_ids=[prompt], max_new_tokens=8, temperature=0.0, ignore_eos=True)[0]
    assert len(out.token_ids) == 8


def test_sharded_checkpoint_loads(tiny_one, tmp_path):
    from ft.tools.demo import write_tokenizer_files

    _, model, _ = tiny_one
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    write_tokenizer_files(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 3
    prompt = prompt_of(30, seed=12)
    got = LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=True).generate(
        prompt_token_ids=[prompt], **GREEDY_32)[0]
    assert got.token_ids == hf_greedy(model, prompt)


def test_the_embedding_in_host_memory_gives_the_same_tokens(tiny_one):
    """Qwen3-Next with --embedding-on-host (the offload backend, the table moved to host memory after
    loading): transformers' greedy tokens, and the embedding's bytes leave the device weights for the
    host tables."""
    _, model, path = tiny_one
    prompt = prompt_of(30, seed=13)
    opts = dict(model=str(path), device="cpu", dtype="float32", page_size=16)
    with LLM(**opts) as on_device, LLM(**opts, embedding_on_host=True) as on_host:
        table = on_host.engine.model.embed
        assert on_host.engine.model.embed_on_host and not on_device.engine.model.embed_on_host
        assert on_host.engine.describe()["host_tables"] == {"embedding": table.numel() * 4}
        assert on_device.engine.model.resident_bytes - on_host.engine.model.resident_bytes == table.numel() * 4
        got = on_host.generate(prompt_token_ids=[prompt], **GREEDY_32)[0]
    assert got.token_ids == hf_greedy(model, prompt)


def test_the_embedding_goes_to_host_memory_when_experts_are_offloaded_on_a_gpu():
    from ft.engine.base.engine_config import EngineConfig
    from ft.errors import ConfigError

    assert EngineConfig().embedding_host("cuda")  # offload is the default backend
    assert not EngineConfig().embedding_host("cpu")
    assert not EngineConfig(moe_backend="resident").embedding_host("cuda")
    assert not EngineConfig(tensor_parallel_size=2).embedding_host("cuda")
    assert not EngineConfig(embedding_on_host=False).embedding_host("cuda")
    assert EngineConfig(moe_backend="resident", embedding_on_host=True).embedding_host("cpu")
    with pytest.raises(ConfigError, match="embedding-on-host runs on one GPU"):
        EngineConfig(embedding_on_host=True, tensor_parallel_size=2)
