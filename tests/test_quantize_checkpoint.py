"""`ft quantize`: Hugging Face checkpoint -> ModelOpt NVFP4 checkpoint (ft.tools.quantize)."""

from __future__ import annotations

import argparse
import fnmatch
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ft.tools.quantize import DEFAULT_EXCLUDE, QuantizeError, quantize_state_dict, write_quant_config
from ft.tools.quantize_checkpoint import quantize_checkpoint
from ft.tools.quantize_cli import add_parser, main
from ft.kernels.nvfp4 import dequantize_nvfp4
from ft.tools.nvfp4_quantize import quantize_nvfp4

N_LAYERS = 4  # linear, linear, linear, full attention
N_EXPERTS = 8
EXTRA_FILES = {
    "tokenizer.json": '{"version": "1.0"}',
    "tokenizer_config.json": '{"model_max_length": 128}',
    "chat_template.jinja": "{{ messages }}",
}


def _tiny_model(dtype: torch.dtype = torch.float32, layers: int = N_LAYERS, experts: int = N_EXPERTS):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        layer_types=["linear_attention"] * (layers - 1) + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    cfg.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(cfg).to(dtype)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Qwen3-Next saved as one file and as 50 KB shards (float32), with extra files."""
    root = tmp_path_factory.mktemp("src")
    model = _tiny_model()
    out = {"single": root / "single", "sharded": root / "sharded"}
    model.save_pretrained(out["single"])
    model.save_pretrained(out["sharded"], max_shard_size="50KB")
    for d in out.values():
        for name, text in EXTRA_FILES.items():
            (d / name).write_text(text)
    return out


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dst")
    out = {}
    for kind, src in sources.items():
        out[kind] = root / kind
        quantize_checkpoint(src, out[kind], progress=False)
    return out


def _load_dir(d: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                assert k not in tensors
                tensors[k] = h.get_tensor(k)
    return tensors


def _expected_split(names) -> tuple[set[str], set[str]]:
    """(modules to quantize, modules in exclude_modules), from the rules stated independently."""
    quantized, excluded = set(), set()
    for n, shape in names.items():
        if not n.endswith(".weight") or len(shape) < 2:
            continue
        m = n[: -len(".weight")]
        if m == "model.embed_tokens" or len(shape) != 2 or any(fnmatch.fnmatch(m, p) for p in DEFAULT_EXCLUDE):
            excluded.add(m)
        else:
            quantized.add(m)
    return quantized, excluded


INV_2688 = torch.tensor(1.0) / torch.tensor(2688.0)  # float32, as ModelOpt's division on CUDA


def _scale_2(amax: torch.Tensor) -> float:
    """The default weight_scale_2 of an amax: amax * fl32(1/2688) (ModelOpt on a GPU)."""
    return (amax.float() * INV_2688).item()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_tensors_dtypes_shapes(sources, converted):
    src = _load_dir(sources["single"])
    dst = _load_dir(converted["single"])
    quantized, excluded = _expected_split({k: v.shape for k, v in src.items()})
    # the tiny model has: 3x(in_proj_qkvz, out_proj), 1x(q, k, v, o), 4x(8 experts x 3 + shared x 3)
    assert len(quantized) == 3 * 2 + 4 + N_LAYERS * (N_EXPERTS * 3 + 3)
    assert "model.layers.0.mlp.experts.7.down_proj" in quantized
    expected_names = set(src)
    for m in quantized:
        expected_names |= {f"{m}.weight_scale", f"{m}.weight_scale_2", f"{m}.input_scale"}
    assert set(dst) == expected_names
    for m in quantized:
        w = src[f"{m}.weight"]
        n, k = w.shape
        assert dst[f"{m}.weight"].dtype == torch.uint8 and dst[f"{m}.weight"].shape == (n, k // 2)
        assert dst[f"{m}.weight_scale"].dtype == torch.float8_e4m3fn
        assert dst[f"{m}.weight_scale"].shape == (n, k // 16)
        for s in ("weight_scale_2", "input_scale"):
            assert dst[f"{m}.{s}"].dtype == torch.float32 and dst[f"{m}.{s}"].shape == ()
        assert dst[f"{m}.input_scale"].item() == 1.0
    # everything not quantized is unchanged, bit for bit and dtype for dtype
    for name, t in src.items():
        if name.endswith(".weight") and name[: -len(".weight")] in quantized:
            continue
        assert dst[name].dtype == t.dtype and torch.equal(dst[name], t), name
    for m in excluded:
        assert torch.equal(dst[f"{m}.weight"], src[f"{m}.weight"])


def test_values_match_quantize_nvfp4_with_shared_global_scale(sources, converted):
    src = _load_dir(sources["single"])
    dst = _load_dir(converted["single"])
    quantized, _ = _expected_split({k: v.shape for k, v in src.items()})

    def amax(m):
        return src[f"{m}.weight"].abs().max()

    def group(m):
        parent, _, leaf = m.rpartition(".")
        for sib in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            if leaf in sib:
                return [f"{parent}.{s}" for s in sib]
        return [m]  # in_proj_qkvz's sibling in_proj_ba is excluded, so it has its own scale

    for m in quantized:
        g = group(m)
        ga = torch.stack([amax(x) for x in g]).max()
        packed, scale, s2 = quantize_nvfp4(src[f"{m}.weight"], ga)
        assert torch.equal(dst[f"{m}.weight"], packed), m
        assert torch.equal(_bits(dst[f"{m}.weight_scale"]), _bits(scale)), m
        assert dst[f"{m}.weight_scale_2"].item() == _scale_2(ga), m
        # dequantized weights are close to the originals
        w = src[f"{m}.weight"]
        d = dequantize_nvfp4(dst[f"{m}.weight"], dst[f"{m}.weight_scale"], dst[f"{m}.weight_scale_2"])
        assert ((d - w).norm() / w.norm()).item() < 0.2, m
    # fused siblings share weight_scale_2, others have their own
    s2 = {m: dst[f"{m}.weight_scale_2"].item() for m in quantized}
    a = "model.layers.3.self_attn"
    assert s2[f"{a}.q_proj"] == s2[f"{a}.k_proj"] == s2[f"{a}.v_proj"]
    e = "model.layers.1.mlp.experts.5"
    assert s2[f"{e}.gate_proj"] == s2[f"{e}.up_proj"] != s2[f"{e}.down_proj"]
    assert s2[f"{e}.down_proj"] == _scale_2(amax(f"{e}.down_proj"))


def test_quant_configs(sources, converted):
    dst = converted["single"]
    _, excluded = _expected_split({k: v.shape for k, v in _load_dir(sources["single"]).items()})
    hf = json.loads((dst / "hf_quant_config.json").read_text())
    assert hf["producer"]["name"] == "modelopt"
    assert isinstance(hf["producer"]["version"], str)
    assert hf["quantization"] == {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": sorted(excluded),
    }
    assert "lm_head" in excluded and "model.embed_tokens" in excluded
    assert "model.layers.2.linear_attn.conv1d" in excluded and "model.layers.0.linear_attn.in_proj_ba" in excluded
    cfg = json.loads((dst / "config.json").read_text())
    src_cfg = json.loads((sources["single"] / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    assert cfg == src_cfg
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    assert qc["ignore"] == sorted(excluded)
    assert qc["producer"] == hf["producer"]
    grp = qc["config_groups"]["group_0"]
    assert grp["weights"] == {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    assert grp["input_activations"] == {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    assert grp["targets"] == ["Linear"]
    # other files are copied
    for name, text in EXTRA_FILES.items():
        assert (dst / name).read_text() == text
    assert (dst / "generation_config.json").read_bytes() == (sources["single"] / "generation_config.json").read_bytes()


def test_write_quant_config_updates_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "x"}')
    entry = write_quant_config(tmp_path, ["b", "a"], "9.9")
    hf = json.loads((tmp_path / "hf_quant_config.json").read_text())
    assert hf == {
        "producer": {"name": "modelopt", "version": "9.9"},
        "quantization": {
            "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ["a", "b"],
        },
    }
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "x" and cfg["quantization_config"] == entry
    assert entry["ignore"] == ["a", "b"] and entry["quant_method"] == "modelopt"


def test_sharded_round_trip(sources, converted):
    src_dir, dst_dir = sources["sharded"], converted["sharded"]
    src_index = json.loads((src_dir / "model.safetensors.index.json").read_text())
    dst_index = json.loads((dst_dir / "model.safetensors.index.json").read_text())
    assert len(set(src_index["weight_map"].values())) > 5
    # same shard file names
    assert sorted(p.name for p in dst_dir.glob("*.safetensors")) == sorted(set(src_index["weight_map"].values()))
    # the index names every tensor, in the shard that holds it, and the new total size
    total = 0
    seen = {}
    for f in dst_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                seen[k] = f.name
                t = h.get_tensor(k)
                total += t.numel() * t.element_size()
    assert dst_index["weight_map"] == seen
    assert dst_index["metadata"]["total_size"] == total
    # each tensor stays in its source shard (new scale tensors beside their weight)
    for name, shard in seen.items():
        base = name
        for suffix in ("_scale_2", "_scale"):
            base = base.replace(f".weight{suffix}", ".weight")
        base = base.replace(".input_scale", ".weight")
        assert src_index["weight_map"][base] == shard
    # and the contents equal the single-file conversion
    single = _load_dir(converted["single"])
    sharded = _load_dir(dst_dir)
    assert set(single) == set(sharded)
    for k in single:
        assert torch.equal(_bits(single[k]), _bits(sharded[k])), k


def test_state_dict_bf16_and_odd_k():
    g = torch.Generator().manual_seed(0)
    state = {
        "model.embed_tokens.weight": torch.randn(32, 64, generator=g).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 24, generator=g).bfloat16(),  # K=24
        "model.layers.0.mlp.up_proj.weight": torch.randn(24, 64, generator=g).bfloat16(),
        "model.layers.0.mlp.gate_proj.weight": (3 * torch.randn(24, 64, generator=g)).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.bfloat16),
        "model.layers.0.mlp.up_proj.bias": torch.zeros(24, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(32, 64, generator=g).bfloat16(),
        "model.layers.0.other.weight": torch.ones(16, 32, dtype=torch.int8),  # not a float
    }
    out, excluded = quantize_state_dict(state)
    assert excluded == ["lm_head", "model.embed_tokens", "model.layers.0.mlp.down_proj", "model.layers.0.other"]
    assert torch.equal(out["model.layers.0.other.weight"], state["model.layers.0.other.weight"])
    for k in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight",
              "model.layers.0.input_layernorm.weight", "model.layers.0.mlp.up_proj.bias", "lm_head.weight"):
        assert out[k].dtype == torch.bfloat16 and torch.equal(out[k], state[k])
    assert out["model.layers.0.mlp.up_proj.weight"].dtype == torch.uint8
    # gate/up share the global scale of the larger amax
    ga = torch.maximum(state["model.layers.0.mlp.up_proj.weight"].abs().max(),
                       state["model.layers.0.mlp.gate_proj.weight"].abs().max()).float()
    assert out["model.layers.0.mlp.up_proj.weight_scale_2"].item() == _scale_2(ga)
    assert out["model.layers.0.mlp.gate_proj.weight_scale_2"].item() == _scale_2(ga)
    out3, _ = quantize_state_dict(state, scale_2_division="exact")
    assert out3["model.layers.0.mlp.up_proj.weight_scale_2"].item() == (ga / torch.tensor(2688.0)).item()
    # embeddings are never quantized, even with no exclude pattern at all
    out2, excluded2 = quantize_state_dict(state, exclude=())
    assert out2["lm_head.weight"].dtype == torch.uint8
    assert excluded2 == ["model.embed_tokens", "model.layers.0.mlp.down_proj", "model.layers.0.other"]
    # a quantized state dict is refused
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_state_dict(out)


def test_errors(sources, tmp_path, converted):
    with pytest.raises(QuantizeError, match=str(tmp_path / "nope")):
        quantize_checkpoint(tmp_path / "nope", tmp_path / "out", progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(QuantizeError, match="no safetensors") as e:
        quantize_checkpoint(empty, tmp_path / "out", progress=False)
    assert str(empty) in str(e.value)
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_checkpoint(converted["single"], tmp_path / "out", progress=False)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(QuantizeError, match="not empty"):
        quantize_checkpoint(sources["single"], busy, progress=False)
    # a shard missing from the index
    broken = tmp_path / "broken"
    shutil.copytree(sources["sharded"], broken)
    next(iter(sorted(broken.glob("model-*.safetensors")))).unlink()
    with pytest.raises(QuantizeError, match="not in"):
        quantize_checkpoint(broken, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_failed_run_leaves_nothing(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "x"}')
    w = torch.randn(16, 32)
    w[3, 3] = float("nan")
    save_file({"a.weight": torch.randn(16, 32), "b.weight": w}, str(src / "model.safetensors"))
    with pytest.raises(QuantizeError, match="b.weight"):
        quantize_checkpoint(src, tmp_path / "dst", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_cli(sources, tmp_path, capsys):
    dst = tmp_path / "q"
    assert main([str(sources["sharded"]), str(dst), "--quiet", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "quantized" in out and str(dst) in out
    assert (dst / "hf_quant_config.json").is_file()
    # errors: non-zero with a message naming the path
    assert main([str(tmp_path / "missing"), str(tmp_path / "x"), "--quiet"]) == 1
    assert str(tmp_path / "missing") in capsys.readouterr().err
    assert main([str(dst), str(tmp_path / "x"), "--quiet"]) == 1
    assert "already quantized" in capsys.readouterr().err
    assert main([]) == 2
    capsys.readouterr()
    # --exclude adds to the defaults; --no-default-exclude drops them
    dst2 = tmp_path / "q2"
    assert main([str(sources["single"]), str(dst2), "--quiet", "--exclude", "*.experts.*",
                 "--no-default-exclude", "--device", "cpu"]) == 0
    hf = json.loads((dst2 / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert "model.layers.0.mlp.experts.3.up_proj" in hf
    assert "lm_head" not in hf and "model.layers.0.mlp.gate" not in hf
    assert "model.layers.0.linear_attn.conv1d" in hf  # 3-D: never quantized, always listed
    with safe_open(str(dst2 / "model.safetensors"), framework="pt") as h:
        assert h.get_slice("lm_head.weight").get_dtype() == "U8"
        assert h.get_slice("model.layers.0.mlp.experts.3.up_proj.weight").get_dtype() == "F32"


def test_add_parser(sources, tmp_path):
    parser = argparse.ArgumentParser(prog="ft")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["quantize", str(sources["single"]), str(tmp_path / "o"), "--device", "cpu"])
    assert args.func(args) == 0  # with the progress bar
    assert (tmp_path / "o" / "model.safetensors").is_file()


def test_same_as_modelopt_export(tmp_path):
    """A real ModelOpt NVFP4 export (nvidia-modelopt runs on CPU) of a bf16 model: every tensor
    but input_scale (calibrated there, 1.0 here) is bit-identical, and so is exclude_modules.

    ModelOpt on a CPU rounds weight_scale_2 = amax / 2688 as an exact division, hence
    scale_2_division="exact" here (the default, "reciprocal", is ModelOpt on a GPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
    import copy

    model = _tiny_model(torch.bfloat16, layers=2, experts=4)
    src = tmp_path / "src"
    model.save_pretrained(src)
    quantize_checkpoint(src, tmp_path / "ours", progress=False, scale_2_division="exact")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = mtq.quantize(model, copy.deepcopy(mtq.NVFP4_DEFAULT_CFG),
                             lambda m: m(torch.randint(0, 128, (1, 8))))
        export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=tmp_path / "modelopt")
    ours, theirs = _load_dir(tmp_path / "ours"), _load_dir(tmp_path / "modelopt")
    assert set(ours) == set(theirs)
    for k in ours:
        if k.endswith(".input_scale"):
            continue
        assert ours[k].dtype == theirs[k].dtype and torch.equal(_bits(ours[k]), _bits(theirs[k])), k
    a = json.loads((tmp_path / "ours" / "hf_quant_config.json").read_text())
    b = json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())
    assert a["quantization"] == b["quantization"]
    qa = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]
    qb = json.loads((tmp_path / "modelopt" / "config.json").read_text())["quantization_config"]
    qa.pop("producer"), qb.pop("producer")
    assert qa == qb
