"""Bad checkpoints and bad requests raise clear errors that name the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ft.engine import LLM, SamplingParams
from ft.errors import CheckpointError, ConfigError, RequestError, UnsupportedModelError


def clone(src, dst, edit=None, config_edit=None, extra_files=None):
    shutil.copytree(src, dst)
    if edit:
        state = load_file(dst / "model.safetensors")
        edit(state)
        save_file(state, dst / "model.safetensors")
    if config_edit:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    for name, content in (extra_files or {}).items():
        (dst / name).write_text(json.dumps(content))
    return dst


def load(path, **opts):
    return LLM(model=str(path), device="cpu", dtype="float32", **opts)


def test_missing_tensor_is_named(tiny_one, tmp_path):
    name = "model.layers.1.self_attn.k_norm.weight"
    path = clone(tiny_one[2], tmp_path / "ck", edit=lambda s: s.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load(path)


def test_unexpected_tensor_is_named(tiny_one, tmp_path):
    path = clone(tiny_one[2], tmp_path / "ck", edit=lambda s: s.__setitem__("model.layers.0.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.extra.weight'"):
        load(path)


def test_wrong_shape_says_expected_and_found(tiny_one, tmp_path):
    name = "model.layers.0.linear_attn.out_proj.weight"
    path = clone(tiny_one[2], tmp_path / "ck", edit=lambda s: s.__setitem__(name, s[name][:, :-1].contiguous()))
    with pytest.raises(CheckpointError, match=rf"'{name}': expected shape \[64, 64\], found \[64, 63\]"):
        load(path)


def test_a_tied_embedding_stays_on_the_device(tiny_one, tmp_path):
    """A checkpoint whose output head is its embedding (tie_word_embeddings): --embedding-on-host is refused
    in one line (the head reads the whole table every step); by default the embedding stays put."""
    path = clone(tiny_one[2], tmp_path / "ck", edit=lambda s: s.pop("lm_head.weight"),
                 config_edit=lambda c: c.update(tie_word_embeddings=True))
    with pytest.raises(ConfigError, match="--embedding-on-host: this checkpoint ties its embedding"):
        load(path, embedding_on_host=True)
    with load(path, moe_backend="offload") as llm:
        assert not llm.engine.model.embed_on_host and llm.engine.model.lm_head is not None
        assert len(llm.generate(prompt_token_ids=[[5, 6, 7]], max_new_tokens=2)[0].token_ids) == 2


def test_unsupported_architecture(tiny_one, tmp_path):
    path = clone(tiny_one[2], tmp_path / "ck", config_edit=lambda c: c.update(architectures=["LlamaForCausalLM"]))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture.*LlamaForCausalLM"):
        load(path)


def test_unsupported_quantization(tiny_one, tmp_path):
    quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}}
    path = clone(tiny_one[2], tmp_path / "ck", extra_files={"hf_quant_config.json": quant})
    with pytest.raises(UnsupportedModelError, match="unsupported quantization 'FP8'"):
        load(path)


def test_missing_directory_and_weights(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tmp_path / "empty")


def test_no_safetensors(tiny_one, tmp_path):
    path = clone(tiny_one[2], tmp_path / "ck")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load(path)


def test_prompt_longer_than_context_is_refused(tiny_one):
    llm = load(tiny_one[2], max_seq_len_override=100)
    with pytest.raises(RequestError, match="the prompt is 150 tokens; the context limit is 100 tokens"):
        llm.generate(prompt_token_ids=[[5] * 150], max_new_tokens=4)
    with pytest.raises(RequestError, match="the prompt is 100 tokens; the context limit is 100"):
        llm.generate(prompt_token_ids=[[5] * 100], max_new_tokens=4)
    # 99 tokens leaves room for one: served, and stopped by the context limit
    out = llm.generate(prompt_token_ids=[[5] * 99], max_new_tokens=4, temperature=0.0, ignore_eos=True)[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_bad_token_ids_and_parameters(tiny_one):
    llm = load(tiny_one[2])
    with pytest.raises(RequestError, match="token id 999 is outside the vocabulary"):
        llm.generate(prompt_token_ids=[[1, 999]])
    with pytest.raises(RequestError, match="the prompt is empty"):
        llm.generate(prompt_token_ids=[[]])
    for bad in (dict(top_p=0.0), dict(temperature=-1.0), dict(max_new_tokens=0), dict(top_k=-2)):
        with pytest.raises(RequestError):
            SamplingParams(**bad)


def test_bad_engine_options(tiny_one):
    with pytest.raises(ConfigError, match="unknown engine option"):
        load(tiny_one[2], moe_cache=3)
    with pytest.raises(ConfigError, match="exclude each other"):
        load(tiny_one[2], moe_cache_size=4, moe_cache_auto=True)
    with pytest.raises(ConfigError, match="below the expert floor"):
        load(tiny_one[2], moe_cache_size=1)
    with pytest.raises(ConfigError, match="gpu-memory-limit"):
        load(tiny_one[2], gpu_memory_limit="lots")
    with pytest.raises(ConfigError, match="no memory left for the cache pools: card 1.0 MiB"):
        load(tiny_one[2], gpu_memory_limit="1MiB")
    with pytest.raises(ConfigError, match=r"cache pools need .* \(moe 4 slots .*kv 500032 tokens.*but the budget is"):
        load(tiny_one[2], num_tokens=500_000, moe_cache_size=4)
    with pytest.raises(ConfigError, match=r"the expert cache gets 0 slots after KV \(500032 tokens, [0-9.]+ [KMG]iB\)"):
        load(tiny_one[2], num_tokens=500_000)
    # the mamba slots (one per running request) can be what leaves no room: the message names their flags
    with pytest.raises(ConfigError, match=r"mamba \(512 slots, [0-9.]+ [KMG]iB\).*--max-running-requests / --mamba-cache-size"):
        load(tiny_one[2], num_tokens=64, mamba_cache_size=512, cache_budget="2MiB")


def test_bad_sampling_extras_are_named(tiny_one):
    for bad, needle in ((dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
                        (dict(presence_penalty=float("inf")), "presence_penalty"),
                        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                        (dict(logit_bias={3: 101.0}), "logit_bias"), (dict(logprobs=21), "logprobs"),
                        (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(stop=("a", "")), "stop: an empty")):
        with pytest.raises(RequestError, match=needle):
            SamplingParams(**bad)
    llm = load(tiny_one[2])
    with pytest.raises(RequestError, match=r"logit_bias: token id 320 is outside the vocabulary \(0..319\)"):
        llm.generate(prompt_token_ids=[[1, 2]], logit_bias={320: 1.0})
    with pytest.raises(RequestError, match="stop_token_ids: token id -1 is outside the vocabulary"):
        llm.generate(prompt_token_ids=[[1, 2]], stop_token_ids=[-1])
    assert not llm.engine.has_work  # nothing was queued
