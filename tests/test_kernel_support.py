"""The loader checks before it serves (issue 37): a shape no kernel path runs is refused with one line
naming the dimension and what is supported, a shape that takes a reference path is said in the startup
lines (`ft.model.kernel_support`); `ft serve` refuses before it binds its port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ft.errors import CheckpointError, ConfigError, UnsupportedModelError
from ft.kernels import limits
from ft.model.config import ModelConfig
from ft.model.kernel_support import check_kernel_shapes, check_weight_rows, nvfp4_formats, read_through_refusal
from conftest import BASE, TINY_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
FLAGSHIP = json.loads((ROOT / "bench/configs/qwen3-next-80b-a3b.json").read_text())
SEEDS = {**FLAGSHIP, "hidden_size": 2560, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_attention_heads": 24, "num_key_value_heads": 2,
         "head_dim": 256, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 640,
         "shared_expert_intermediate_size": 640}
"""The seeds' model: hidden 2560, 16 key / 48 value heads of 128, 24 q heads over 2 kv heads of 256, 512 experts
top-10 of width 640."""


def cfg_of(**overrides) -> ModelConfig:
    return ModelConfig.from_dict({**FLAGSHIP, **overrides})


def check(device_type="cuda", quantized=True, kv_nvfp4=False, read_through=False, **overrides) -> list[str]:
    return check_kernel_shapes(cfg_of(**overrides), device_type=device_type, quantized=quantized, kv_nvfp4=kv_nvfp4,
                               read_through=read_through)


def test_the_limits_are_the_kernels_own():
    """`ft.kernels.limits` mirrors the kernel modules' constants (kept torch-free for the preflight)."""
    from ft.kernels.attention.kernel import MAX_HEAD_DIM
    from ft.kernels.attention.prefill_kernel import prefill_config
    from ft.kernels.gated_delta import chunk_kernel, kernel
    from ft.kernels.norm.kernel import MAX_D
    from ft.kernels.nvfp4 import BLOCK_SIZE
    from ft.kernels.router.kernel import route_triton
    from ft.model.kernel_support import _pow2, _whole_k

    assert limits.GATED_DELTA_MAX_DK == chunk_kernel.MAX_DK == kernel.MAX_DK
    assert limits.ATTENTION_MAX_HEAD_DIM == MAX_HEAD_DIM and limits.NORM_MAX_D == MAX_D
    assert limits.NVFP4_BLOCK == BLOCK_SIZE
    with pytest.raises(ValueError, match=f"E <= {limits.ROUTER_MAX_EXPERTS}"):
        route_triton(torch.zeros(1, limits.ROUTER_MAX_EXPERTS + 1), 2, True)
    for k in range(16, 20000, 16):
        words = k // 8  # one power of two, or two distinct ones (the smaller at least 2), the larger <= 1024
        sums = {a for a in (1 << e for e in range(1, 11))} | {a + b for a in (1 << e for e in range(2, 11))
                                                            for b in (1 << e for e in range(1, 10)) if b < a}
        assert _whole_k(k) == (words in sums), k
    for group in range(1, 300):  # the prefill tile's rows: the rule's formula is the launcher's
        cfg = prefill_config(256, group, torch.bfloat16)
        assert cfg["BLOCK_M"] * cfg["BLOCK_G"] == max(128, _pow2(group)), group


@pytest.mark.parametrize("name,config", [("flagship", FLAGSHIP), ("seeds", SEEDS)])
def test_flagship_and_seed_shapes_are_accepted_without_lines(name, config):
    cfg = ModelConfig.from_dict(config)
    for device_type in ("cuda", "cpu"):
        for quantized in (True, False):
            assert check_kernel_shapes(cfg, device_type=device_type, quantized=quantized, kv_nvfp4=True) == []


def test_read_through_takes_the_seeds_widths_in_two_tiles():
    """`moe_decode_triton` reads the host store over whole-K tiles: K / 8 = 2^a or 2^a + 2^b. The
    seeds' 2,560 (256 + 64 words) and 640 (64 + 16) are; 112 (8 + 6) and 2^a above 1,024 are not."""
    cfg = ModelConfig.from_dict(SEEDS)
    assert check_kernel_shapes(cfg, device_type="cuda", quantized=True, read_through=True) == []
    assert read_through_refusal(ModelConfig.from_dict(FLAGSHIP), quantized=True) is None
    assert read_through_refusal(ModelConfig.from_dict({**FLAGSHIP, "hidden_size": 112}), quantized=True) == (
        "hidden_size 112: read-through decode takes K / 8 = 2^a or 2^a + 2^b (2 <= 2^b < 2^a <= 1024: 2,560 and 640 "
        "are)")
    assert read_through_refusal(ModelConfig.from_dict({**FLAGSHIP, "moe_intermediate_size": 16384}), quantized=True)
    assert check_kernel_shapes(ModelConfig.from_dict({**FLAGSHIP, "hidden_size": 112}), device_type="cuda",
                               quantized=False, read_through=True) == []  # the reference MoE


REFUSED = {
    "kv heads do not divide q heads": (dict(num_key_value_heads=5), CheckpointError,
        "config.json: num_key_value_heads 5 does not divide num_attention_heads 16: each key/value head serves a "
        "whole group of query heads"),
    "key heads do not divide value heads": (dict(linear_num_key_heads=5), CheckpointError,
        "config.json: linear_num_key_heads 5 does not divide linear_num_value_heads 32: each key head serves a whole "
        "group of value heads"),
    "zero kv heads": (dict(num_key_value_heads=0), CheckpointError,
        "config.json: num_key_value_heads 0 must be at least 1"),
    "zero linear value dim": (dict(linear_value_head_dim=0), CheckpointError,
        "config.json: linear_value_head_dim 0 must be at least 1"),
    "zero expert width": (dict(moe_intermediate_size=0), CheckpointError,
        "config.json: moe_intermediate_size 0 must be at least 1 (the model has MoE layers)"),
    "zero sparse step": (dict(decoder_sparse_step=0), CheckpointError,
        "config.json: decoder_sparse_step 0 must be at least 1"),
    "no heads": (dict(num_attention_heads=0, head_dim=None), CheckpointError,
        "config.json: num_attention_heads 0 must be at least 1"),
    "top-k above the experts": (dict(num_experts_per_tok=600), CheckpointError,
        "config.json: num_experts_per_tok 600 is more than num_experts 512"),
    "odd rotary dim": (dict(head_dim=36), UnsupportedModelError,
        "rotary dim 9 (head_dim 36 x partial_rotary_factor 0.25) is not supported: the rotary embedding takes an "
        "even number of dims in 2..36"),
    "rotary dim above the head dim": (dict(rope_parameters={"partial_rotary_factor": 1.5}), UnsupportedModelError,
        "rotary dim 384 (head_dim 256 x partial_rotary_factor 1.5) is not supported: the rotary embedding takes an "
        "even number of dims in 2..256"),
    "conv width 1": (dict(linear_conv_kernel_dim=1), UnsupportedModelError,
        "linear_conv_kernel_dim 1 is not supported: the causal conv1d takes widths from 2 (its state holds width - 1 "
        "inputs)"),
    "NVFP4 expert width": (dict(moe_intermediate_size=600), UnsupportedModelError,
        "moe_intermediate_size 600 is not supported with NVFP4 weights: a projection's input size must be a multiple "
        "of 16 (one E4M3 scale per 16 values)"),
    "NVFP4 o_proj input": (dict(num_attention_heads=3, num_key_value_heads=1, head_dim=40), UnsupportedModelError,
        "num_attention_heads x head_dim 120 is not supported with NVFP4 weights: a projection's input size must be a "
        "multiple of 16 (one E4M3 scale per 16 values)"),
    "head dim above the attention kernels'": (dict(head_dim=512), UnsupportedModelError,
        "head_dim 512 is not supported: the attention kernels take 1..256"),
    "prefill tile": (dict(num_attention_heads=256, num_key_value_heads=1), UnsupportedModelError,
        "256 query heads per key/value head (num_attention_heads 256 / num_key_value_heads 1) at head_dim 256 is not "
        "supported: the prefill attention kernel takes groups up to 128 at this head dim (shared memory)"),
    "fused decode norm": (dict(hidden_size=9216), UnsupportedModelError,
        "hidden_size 9216 is not supported with NVFP4 experts: the decode MoE block's fused RMSNorm takes 1..8192"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_refusal_is_one_line(case):
    overrides, error, message = REFUSED[case]
    with pytest.raises(error) as e:
        check(**overrides)
    assert str(e.value) == message and "\n" not in message


def test_nvfp4_kv_cache_needs_head_dims_in_blocks_of_16():
    with pytest.raises(UnsupportedModelError) as e:
        check(device_type="cpu", kv_nvfp4=True, head_dim=200)
    assert str(e.value) == ("head_dim 200 is not supported by an NVFP4 KV cache: it takes multiples of 16 (choose "
                            "--kv-cache-dtype bf16 or fp8)")
    assert check(device_type="cpu", kv_nvfp4=False, head_dim=200) == []


def test_the_references_take_what_the_kernels_refuse():
    """On the CPU every dispatcher runs its reference: only what no path computes is refused there."""
    for overrides in (dict(head_dim=512), dict(num_attention_heads=256, num_key_value_heads=1),
                      dict(rope_parameters={"partial_rotary_factor": 0.0}), dict(linear_key_head_dim=320)):
        assert check(device_type="cpu", **overrides) == []
    assert check(device_type="cpu", quantized=False, moe_intermediate_size=600) == []  # bf16 experts: any width
    with pytest.raises(UnsupportedModelError, match="in 2..256"):
        check(rope_parameters={"partial_rotary_factor": 0.0})
    with pytest.raises(UnsupportedModelError, match="in 0..36"):
        check(device_type="cpu", head_dim=36)
    assert check(num_attention_heads=256, num_key_value_heads=1, head_dim=128) == []  # 256 x 128 fits


REFERENCE = {
    "key head dim": (dict(linear_key_head_dim=320), True,
        ["linear_key_head_dim 320 > 256: Gated DeltaNet prefill and decode run the torch reference (slow; no CUDA "
         "graphs)"]),
    "value head dim": (dict(linear_value_head_dim=512), True,
        ["linear_value_head_dim 512 > 256: Gated DeltaNet prefill runs the torch reference (slow; no prefill CUDA "
         "graphs)"]),
    "hidden size, bf16": (dict(hidden_size=9216), False,
        ["hidden_size 9216 > 8192: the RMSNorms run the torch reference (slow)"]),
    "experts": (dict(num_experts=9000), True,
        ["num_experts 9000 > 8192: the MoE router runs the torch reference (slow)"]),
}


@pytest.mark.parametrize("case", list(REFERENCE))
def test_reference_paths_are_lines(case):
    overrides, quantized, lines = REFERENCE[case]
    assert check(quantized=quantized, **overrides) == lines
    assert check(device_type="cpu", quantized=quantized, **overrides) == []


def test_nvfp4_formats_of_the_quantization_settings():
    assert nvfp4_formats({"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}) == (True, False)
    assert nvfp4_formats({"quant_method": "nvfp4", "kv_cache_quant_algo": "NVFP4"}) == (True, True)
    assert nvfp4_formats({}) == (False, False)


def test_heads_that_do_not_match_the_weights_are_one_line(tmp_path):
    from safetensors.torch import save_file

    cfg = cfg_of()
    attn, lin = cfg.full_attention_layers[0], cfg.linear_attention_layers[0]
    attn_p, lin_p = f"model.layers.{attn}.self_attn.", f"model.layers.{lin}.linear_attn."
    names = {attn_p + "q_proj.weight": 2 * 16 * 256, attn_p + "k_proj.weight": 2 * 256,
             lin_p + "in_proj_qkvz.weight": 2 * 16 * 128 + 2 * 32 * 128, lin_p + "in_proj_ba.weight": 64}
    save_file({n: torch.zeros(rows, 1) for n, rows in names.items()}, str(tmp_path / "model.safetensors"))
    check_weight_rows(cfg, tmp_path)  # as the config says
    with pytest.raises(CheckpointError) as e:
        check_weight_rows(cfg_of(head_dim=128), tmp_path)
    assert str(e.value) == (f"config.json: num_attention_heads 16, num_key_value_heads 2, head_dim 128 do not match "
                            f"the weights: model.layers.{attn}.self_attn.q_proj.weight has 8192 rows, the config gives "
                            "2 x 16 x 128 = 4096")
    with pytest.raises(CheckpointError, match="in_proj_qkvz.weight has 12288 rows, the config gives 2 x 16 x 128 "
                                              r"\+ 2 x 48 x 128 = 16384"):
        check_weight_rows(cfg_of(linear_num_value_heads=48), tmp_path)


# ------------------------------------------------------------------------ the engine (CPU references)
def _synthetic(tmp_path: Path, **overrides) -> str:
    cfg = {**BASE, **TINY_CONFIGS["interval2-gqa2-top2"], "architectures": ["Qwen3NextForCausalLM"],
           "model_type": "qwen3_next", **overrides}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return f"synthetic:{path}"


def _as_on_cuda(monkeypatch):
    """The engine checks shapes as where Triton runs (`uses_triton` in rank_state only): the lines and
    choices of a CUDA engine, while the kernels here still run their CPU references."""
    import ft.engine.ranks.rank_state as rank_state

    monkeypatch.setattr(rank_state, "uses_triton", lambda device: True)


def test_an_engine_on_a_reference_path_says_so_and_runs(tmp_path, monkeypatch):
    from ft.engine import LLM

    _as_on_cuda(monkeypatch)
    llm = LLM(model=_synthetic(tmp_path, linear_key_head_dim=272), device="cpu", dtype="float32", moe_cache_size=3,
              page_size=16)
    assert llm.engine.kernel_fallbacks == ["linear_key_head_dim 272 > 256: Gated DeltaNet prefill and decode run the "
                                           "torch reference (slow; no CUDA graphs)"]
    assert llm.engine.pools.experts.read_through is not None  # 64 and 32 take read-through decode
    from ft.serve_cmd import describe  # ft serve's startup summary

    assert ("\n  kernels: linear_key_head_dim 272 > 256: Gated DeltaNet prefill and decode run the torch reference "
            "(slow; no CUDA graphs)\n") in describe(llm.engine, "http://127.0.0.1:1")
    out = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], max_new_tokens=3, temperature=0.0, ignore_eos=True)[0]
    assert len(out.token_ids) == 3 and torch.isfinite(llm.engine.last_logits).all()


def test_an_engine_whose_widths_read_through_cannot_take_loads_misses_before_each_step(tmp_path, monkeypatch):
    from ft.engine import LLM

    _as_on_cuda(monkeypatch)
    model = _synthetic(tmp_path, hidden_size=112)  # 112 / 8 = 14 words a row (8 + 6): no whole-K tiles
    llm = LLM(model=model, device="cpu", dtype="float32", moe_cache_size=3, page_size=16)
    assert llm.engine.kernel_fallbacks == [
        "hidden_size 112: read-through decode takes K / 8 = 2^a or 2^a + 2^b (2 <= 2^b < 2^a <= 1024: 2,560 and 640 "
        "are); offloaded decode loads missing experts before each step instead (--no-expert-read-through)"]
    assert llm.engine.pools.experts.read_through is None
    out = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], max_new_tokens=3, temperature=0.0, ignore_eos=True)[0]
    assert len(out.token_ids) == 3
    with pytest.raises(ConfigError, match="--expert-policy lfu needs read-through decode, which this model cannot "
                                          "take: hidden_size 112"):
        LLM(model=model, device="cpu", dtype="float32", moe_cache_size=3, page_size=16, expert_policy="lfu")


def test_an_engine_refuses_before_loading(tmp_path, monkeypatch):
    from ft.engine import LLM

    _as_on_cuda(monkeypatch)
    with pytest.raises(UnsupportedModelError, match="^head_dim 272 is not supported: the attention kernels take "
                                                    "1..256$"):
        LLM(model=_synthetic(tmp_path, head_dim=272), device="cpu", dtype="float32")


# ------------------------------------------------------------------------ ft serve
def _config_dir(tmp_path: Path, name: str, **overrides) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**FLAGSHIP, **overrides}))
    return d


def test_serve_refuses_a_checkpoint_before_binding_in_one_line(tmp_path):
    """A refused checkpoint: a non-zero exit, one line on stderr, no traceback; found before the port is
    bound (given a port in use, the error is still the model's), without torch for --device auto."""
    cases = [
        ([str(_config_dir(tmp_path, "conv", linear_conv_kernel_dim=1))],
         "linear_conv_kernel_dim 1 is not supported: the causal conv1d takes widths from 2"),
        ([str(_config_dir(tmp_path, "d512", head_dim=512)), "--device", "cuda"],
         "head_dim 512 is not supported: the attention kernels take 1..256"),
    ]
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, message in cases:
            p = subprocess.run([sys.executable, "-m", "ft.cli", "serve", *args, "--port", str(port)],
                               capture_output=True, text=True, env=env, timeout=120, check=False)
            lines = p.stderr.strip().splitlines()
            assert p.returncode != 0 and len(lines) == 1 and p.stdout == "", p.stderr
            assert lines[0].startswith("ft serve: error: ") and message in lines[0], lines[0]


def test_preflight_checks_shapes_without_torch(tmp_path):
    """`check_model` on a checkpoint folder imports no torch, the shape checks included (here it goes on
    to the tokenizer, which this folder lacks)."""
    d = _config_dir(tmp_path, "ok")
    code = ("import sys; from ft.engine.base.engine_config import EngineConfig; from ft.errors import ConfigError;"
            "from ft.preflight import check_model\n"
            f"try: check_model(EngineConfig(model={str(d)!r}))\n"
            "except ConfigError as e: print(e)\n"
            "print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    out = p.stdout.splitlines()
    assert out[-1] == "False" and out[0].startswith(f"tokenizer.json not found in {d}"), p.stdout + p.stderr
