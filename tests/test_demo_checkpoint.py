"""The built-in demo checkpoint: deterministic, Hugging Face / ModelOpt NVFP4 layout, loadable."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from safetensors import safe_open

from ft.tools import demo
from ft.tools.demo import (
    DEMO_CONFIG,
    DEMO_DIRNAME,
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    ensure_demo_checkpoint,
    hf_tensor_specs,
)
from ft.engine.text.tokenizer import Tokenizer

FILES = (
    "config.json",
    "generation_config.json",
    "hf_quant_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tensors(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("cache_a"))


@pytest.fixture(scope="module")
def hf_names_and_shapes(tmp_path_factory):
    """Tensor names and shapes transformers itself writes for DEMO_CONFIG."""
    import transformers
    cfg = transformers.Qwen3NextConfig(**DEMO_CONFIG)
    with torch.device("meta"):  # no weight init: only names and shapes matter here
        model = transformers.Qwen3NextForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    out = tmp_path_factory.mktemp("hf_tiny")
    model.save_pretrained(str(out))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_layout_and_cache_folder(ckpt, tmp_path):
    assert ckpt.name == DEMO_DIRNAME == "demo-v1"
    for f in FILES:
        assert (ckpt / f).is_file(), f
    assert not [p for p in ckpt.parent.iterdir() if p.name != DEMO_DIRNAME]  # no temp leftovers
    # a second call reuses the files untouched
    before = {f: (ckpt / f).stat().st_mtime_ns for f in FILES}
    assert ensure_demo_checkpoint(ckpt.parent) == ckpt
    assert before == {f: (ckpt / f).stat().st_mtime_ns for f in FILES}


def test_generation_is_deterministic(ckpt, tmp_path):
    again = ensure_demo_checkpoint(tmp_path / "cache_b")
    assert again != ckpt
    for f in FILES:
        assert _sha(again / f) == _sha(ckpt / f), f


def test_cache_dir_from_environment(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "envcache"))
    calls = []
    monkeypatch.setattr(demo, "write_demo_checkpoint", lambda dst: calls.append(dst) or _copy_files(ckpt, dst))
    path = ensure_demo_checkpoint()
    assert path == tmp_path / "envcache" / DEMO_DIRNAME and len(calls) == 1
    assert ensure_demo_checkpoint() == path and len(calls) == 1


def _copy_files(src, dst):
    for f in FILES:
        shutil.copy(src / f, dst / f)
    return dst


def test_race_loser_discards_its_copy(ckpt, tmp_path, monkeypatch):
    base = tmp_path / "race"
    final = base / DEMO_DIRNAME

    def slow_writer(dst):  # another process finishes first, while we are still writing
        _copy_files(ckpt, dst)
        shutil.copytree(ckpt, final)
        (final / "winner").write_text("1")

    monkeypatch.setattr(demo, "write_demo_checkpoint", slow_writer)
    assert ensure_demo_checkpoint(base) == final
    assert (final / "winner").is_file()
    assert sorted(p.name for p in base.iterdir()) == [DEMO_DIRNAME]


def test_incomplete_leftover_is_replaced(ckpt, tmp_path, monkeypatch):
    base = tmp_path / "broken"
    final = base / DEMO_DIRNAME
    shutil.copytree(ckpt, final)
    (final / "model.safetensors").unlink()
    monkeypatch.setattr(demo, "write_demo_checkpoint", lambda dst: _copy_files(ckpt, dst))
    assert ensure_demo_checkpoint(base) == final
    assert _sha(final / "model.safetensors") == _sha(ckpt / "model.safetensors")
    assert sorted(p.name for p in base.iterdir()) == [DEMO_DIRNAME]


def test_config_accepted_by_transformers(ckpt):
    import transformers
    raw = json.loads((ckpt / "config.json").read_text())
    cfg = transformers.Qwen3NextConfig(**raw)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts) == (320, 256, 8, 64)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.25
    assert raw["full_attention_interval"] == 4
    assert raw["eos_token_id"] == IM_END_ID and raw["bos_token_id"] == raw["pad_token_id"] == ENDOFTEXT_ID
    q = raw["quantization_config"]
    assert "NVFP4" in json.dumps(q)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [IM_END_ID, ENDOFTEXT_ID]


def test_hf_quant_config(ckpt):
    hq = json.loads((ckpt / "hf_quant_config.json").read_text())
    quant = hq.get("quantization", hq)
    assert quant["quant_algo"] == "NVFP4"
    assert "lm_head" in quant["exclude_modules"]


def test_specs_match_transformers(hf_names_and_shapes):
    ours = {name: shape for name, shape, _ in hf_tensor_specs(DEMO_CONFIG)}
    assert ours == hf_names_and_shapes


def test_tensor_names_and_shapes(ckpt, hf_names_and_shapes):
    found = _tensors(ckpt)
    hq = json.loads((ckpt / "hf_quant_config.json").read_text())
    excluded = set(hq.get("quantization", hq)["exclude_modules"])
    expected: set[str] = set()
    n_quantized = 0
    for name, shape in hf_names_and_shapes.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        quantized = module is not None and f"{module}.weight_scale" in found
        if quantized:
            n_quantized += 1
            assert module not in excluded, module
            out_f, in_f = shape
            assert found[name] == ((out_f, in_f // 2), "U8"), name
            assert found[f"{module}.weight_scale"] == ((out_f, in_f // 16), "F8_E4M3"), module
            assert found[f"{module}.weight_scale_2"][0] in ((), (1,)), module
            assert found[f"{module}.weight_scale_2"][1] == "F32", module
            expected |= {name, f"{module}.weight_scale", f"{module}.weight_scale_2"}
            if f"{module}.input_scale" in found:
                expected.add(f"{module}.input_scale")
        else:
            assert found[name] == (shape, "BF16"), name
            expected.add(name)
    assert set(found) == expected
    # every routed expert projection is NVFP4; the embeddings, head and norms are not
    assert all(f"{n[:-len('.weight')]}.weight_scale" in found for n in found if ".experts." in n and n.endswith("_proj.weight"))
    assert n_quantized >= 8 * 64 * 3
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert found[name][1] == "BF16"


def test_weight_values(ckpt):
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        a_log = f.get_tensor("model.layers.0.linear_attn.A_log").float()
        assert torch.all((a_log >= 0) & (a_log <= torch.log(torch.tensor(16.0)) + 1e-2))
        assert torch.all(f.get_tensor("model.layers.0.linear_attn.dt_bias").float() == 1)
        assert torch.all(f.get_tensor("model.layers.0.linear_attn.norm.weight").float() == 1)
        emb = f.get_tensor("model.embed_tokens.weight").float()
        assert 0.04 < emb.std().item() < 0.06
        router = f.get_tensor("model.layers.0.mlp.gate.weight").float()
        assert 0.08 < router.std().item() < 0.12
        norm = f.get_tensor("model.layers.3.input_layernorm.weight").float()
        assert 0.03 < norm.std().item() < 0.07 and abs(norm.mean().item()) < 0.02


def test_tokenizer_loads(ckpt):
    tok = Tokenizer.from_dir(ckpt)
    assert tok.vocab_size == DEMO_CONFIG["vocab_size"]
    assert tok.eos_token_ids == frozenset({IM_END_ID, ENDOFTEXT_ID})
    assert tok.token_to_id("<|im_start|>") == IM_START_ID
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode("Grüße 👋")) == "Grüße 👋"
