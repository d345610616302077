"""--kv-cache-dtype: the KV pool's dtype and bytes follow it (so do the ladder's and the ranges'
sums), and an fp8 cache (e4m3, per-layer scales) and an nvfp4 cache (E2M1, e4m3 scale per 16 values,
per-layer scales) decode close to an unquantized one (CPU, reference path); a checkpoint's
kv_cache_quant_algo picks auto's format."""

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
    pools = {d: _llm(path, kv_cache_dtype=d).engine for d in ("auto", "bf16", "fp8", "nvfp4")}
    kv = {d: e.pools.kv for d, e in pools.items()}
    assert kv["auto"].kv.dtype == torch.float32 and kv["bf16"].kv.dtype == torch.bfloat16
    assert kv["fp8"].kv.dtype == torch.float8_e4m3fn and kv["fp8"].scales.shape == (kv["fp8"].kv.shape[1], 2)
    assert kv["nvfp4"].kv.dtype == torch.uint8 and kv["nvfp4"].scales.shape == (kv["nvfp4"].kv.shape[1], 2)
    assert kv["auto"].scales is None and kv["bf16"].scales is None
    assert [kv[d].dtype_name for d in kv] == ["float32", "bfloat16", "float8_e4m3fn", "nvfp4"]
    assert kv["auto"].bytes_per_page == 2 * kv["bf16"].bytes_per_page == 4 * kv["fp8"].bytes_per_page
    cfg = pools["nvfp4"].model_config
    layers, heads, d = len(cfg.full_attention_layers), cfg.num_key_value_heads, cfg.head_dim
    assert kv["nvfp4"].kv.shape[1:] == (layers, 2, 16, heads, d // 2 + d // 16)
    assert kv["nvfp4"].bytes_per_page == layers * 2 * 16 * heads * (d // 2 + d // 16)  # 9/32 of bf16's bytes
    assert 32 * kv["nvfp4"].bytes_per_page == 9 * kv["bf16"].bytes_per_page
    costs = {d: e.cache.layout.unit_costs().kv_page for d, e in pools.items()}
    assert costs["auto"] == 4 * costs["fp8"]  # the manager's byte sums (ranges, ladder) see the real page
    assert costs["nvfp4"] == kv["nvfp4"].bytes_per_page and 64 * costs["nvfp4"] == 9 * costs["auto"]
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        _llm(path, kv_cache_dtype="int4")


def test_nvfp4_page_bytes_at_the_flagship_shape():
    """12 full-attention layers, 2 kv heads, D 256, pages of 64: per token and layer K + V =
    2 x 2 x (128 + 16) = 576 bytes against bf16's 2,048; 6,912 bytes per token against 24,576
    (issue 16's target: <= 7,000), as the pool and the cache manager's measured layout count them."""
    from ft.engine.cache.manager import PoolShapes, measure_layout
    from ft.memory.kv_pool import NVFP4_KV, KVPool
    from ft.memory.storage import PoolStorage

    cpu = torch.device("cpu")
    per_page = {}
    for name, dtype in (("bf16", torch.bfloat16), ("nvfp4", NVFP4_KV)):
        pool = KVPool(3, 64, 12, 2, 256, dtype, cpu)
        assert pool.nbytes == 3 * pool.bytes_per_page
        shapes = PoolShapes(64, 12, 2, 256, 1, 64, 4, 2, 16, 16, torch.bfloat16, cpu, None, dtype)
        layout = measure_layout(shapes, PoolStorage(cpu, backend="realloc"))
        assert layout.unit_costs().kv_page == pool.bytes_per_page
        per_page[name] = pool.bytes_per_page
    assert per_page["nvfp4"] == 64 * 6912 and per_page["bf16"] == 64 * 24576
    assert per_page["nvfp4"] * 24576 == per_page["bf16"] * 6912
    with pytest.raises(ValueError, match="multiple of 16"):
        KVPool(1, 64, 1, 2, 72, NVFP4_KV, cpu)


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


def _teacher_forced(engine, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The logits after the prompt's prefill and after each of `tokens` but the last fed back (each
    step a new request over the whole context: the prefix cache makes it one token of work, read
    from the cached, quantized, pages)."""
    from ft.engine import SamplingParams

    out, ctx = [], list(prompt)
    for t in tokens:
        seq = engine.add_request(ctx, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
        engine.run_until_done([seq])
        out.append(engine.last_logits[0].clone())
        ctx.append(t)
    return out


def test_nvfp4_kv_decodes_close_to_bf16(tiny_one):
    """NVFP4 KV against bf16 KV, teacher-forced on the bf16 cache's greedy tokens (3 prompts x 12
    steps: both see the same context, so errors do not compound through different tokens).

    Criterion: median logits relative RMS < 0.06, max < 0.15, top-1 agreement >= 30 of 36. Why: an
    NVFP4 value has one mantissa bit relative to its block's maximum, about 10% relative RMS per
    element on Gaussian data; attention averages it down and the residual stream carries the
    unquantized parts, so the logits move by a few percent (measured here: median 0.034, max
    0.088, 34 of 36; the demo's bench/kv_accuracy.py table: median 0.036, max 0.076). The bounds
    leave about 1.7x room; a packing or scale bug moves the logits by order 1 (fails them all).
    The tiny random model's logits are nearly flat, so a near-tie flips its argmax now and then."""
    _, _, path = tiny_one
    bf16, nvfp4 = _llm(path, kv_cache_dtype="bf16"), _llm(path, kv_cache_dtype="nvfp4")
    errs, top1 = [], 0
    for s in (1, 2, 3):
        p = prompt_of(40, seed=s)
        want = bf16.generate(prompt_token_ids=[p], max_new_tokens=12, temperature=0.0, ignore_eos=True)[0].token_ids
        ref = _teacher_forced(bf16.engine, p, want)
        got = _teacher_forced(nvfp4.engine, p, want)
        assert [int(x.argmax()) for x in ref] == want  # the teacher's logits are the greedy run's
        errs += [rel_err(g, r) for g, r in zip(got, ref)]
        top1 += sum(int(g.argmax() == r.argmax()) for g, r in zip(got, ref))
    errs.sort()
    assert errs[len(errs) // 2] < 0.06 and errs[-1] < 0.15, errs
    assert top1 >= 30, top1
    assert errs[0] > 1e-4  # the cache really is quantized (bf16 against itself would be ~0)


def _with_kv_scales(tiny_one, tmp_path, scales=(0.02, 0.01), drop=None, algo="FP8"):
    """The tiny checkpoint with ModelOpt's KV scales (kv_cache_quant_algo `algo`) on every full-attention layer."""
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

    quant = {"quantization": {"quant_algo": None, "kv_cache_quant_algo": algo}}
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


def test_checkpoint_nvfp4_kv_scales(tiny_one, tmp_path):
    """kv_cache_quant_algo NVFP4 (ModelOpt; k_scale / v_scale are the per-layer second-level scales):
    auto gives an nvfp4 pool holding them and decodes; fp8 and bf16 leave them (fp8's scales stay 1.0)."""
    path, layers = _with_kv_scales(tiny_one, tmp_path, scales=(0.004, 0.002), algo="NVFP4")
    llm = _llm(path)
    kv = llm.engine.pools.kv
    assert kv.kv.dtype == torch.uint8 and kv.dtype_name == "nvfp4"
    assert torch.allclose(kv.scales, torch.tensor([[0.004, 0.002 * (i + 1)] for i in layers]))
    out = llm.generate(prompt_token_ids=[prompt_of(20, seed=5)], max_new_tokens=4, temperature=0.0,
                       ignore_eos=True)[0].token_ids
    assert len(out) == 4
    fp8 = _llm(path, kv_cache_dtype="fp8").engine.pools.kv
    assert fp8.kv.dtype == torch.float8_e4m3fn and torch.equal(fp8.scales, torch.ones_like(fp8.scales))
    assert _llm(path, kv_cache_dtype="bf16").engine.pools.kv.scales is None
    fp8_ckpt, _ = _with_kv_scales(tiny_one, tmp_path / "fp8")  # and FP8 scales do not reach an nvfp4 pool
    nv = _llm(fp8_ckpt, kv_cache_dtype="nvfp4").engine.pools.kv
    assert nv.kv.dtype == torch.uint8 and torch.equal(nv.scales, torch.ones_like(nv.scales))


def test_unsupported_kv_quantization_is_named(tiny_one, tmp_path):
    from ft.errors import UnsupportedModelError
    from tests.test_bad_input import clone

    quant = {"quantization": {"quant_algo": None, "kv_cache_quant_algo": "INT8"}}
    path = clone(tiny_one[2], tmp_path / "ck", extra_files={"hf_quant_config.json": quant})
    with pytest.raises(UnsupportedModelError, match="KV cache quantization 'INT8'"):
        _llm(path)


@pytest.mark.parametrize(("cache_dtype", "qmax"), [(torch.float8_e4m3fn, 448.0), (torch.uint8, 6 * 448.0)])
def test_calibrated_scale_puts_the_largest_value_at_half_the_range(cache_dtype, qmax):
    from ft.kernels.attention import KV_SCALE_HEADROOM, calibrate_kv_scale

    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(7, 2, 32, generator=g) * 30).clamp(-100, 100), torch.randn(7, 2, 32, generator=g) * 0.01
    k[3, 1, 5] = -123.0  # the largest |K|, negative (the rest clamped below it: unseeded, a draw past 4 sigma
    # beat it about one run in fifty)
    scale = torch.ones(2)
    calibrate_kv_scale(k, v, torch.empty(1, dtype=cache_dtype), scale)
    assert KV_SCALE_HEADROOM == 2.0
    assert scale[0].item() == pytest.approx(123.0 * 2 / qmax, rel=1e-6)
    assert scale[1].item() == pytest.approx(v.abs().max().item() * 2 / qmax, rel=1e-6)
    calibrate_kv_scale(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.empty(1, dtype=cache_dtype), scale)
    assert (scale > 0).all() and (scale < 1e-20).all()  # an all-zero layer keeps a positive scale


@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_first_prefill_sets_the_scales_once(tiny_one, kind):
    """--kv-scale-calibration without checkpoint scales: the first prefill sets every layer's K and
    V scales from its own K and V (through the attention layers), later prefills leave them; by
    default they stay 1.0. Teacher-forced logits with calibrated scales stay close to bf16's on the
    calibrating prompt (on later prompts larger values may clamp: bench/RESULTS.md)."""
    _, _, path = tiny_one
    p = prompt_of(40, seed=1)
    default = _llm(path, kv_cache_dtype=kind)
    assert not default.engine.pools.kv.calibrate_next_prefill
    default.generate(prompt_token_ids=[p], max_new_tokens=2, temperature=0.0, ignore_eos=True)
    assert torch.equal(default.engine.pools.kv.scales, torch.ones_like(default.engine.pools.kv.scales))
    llm = _llm(path, kv_cache_dtype=kind, kv_scale_calibration=True)
    kv = llm.engine.pools.kv
    assert kv.calibrate_next_prefill and torch.equal(kv.scales, torch.ones_like(kv.scales))
    llm.generate(prompt_token_ids=[p], max_new_tokens=2, temperature=0.0, ignore_eos=True)
    first = kv.scales.clone()
    assert not kv.calibrate_next_prefill and (first > 0).all() and not torch.equal(first, torch.ones_like(first))
    assert len(set(first.flatten().tolist())) > 2  # per layer, K and V apart
    llm.generate(prompt_token_ids=[prompt_of(50, seed=2)], max_new_tokens=2, temperature=0.0, ignore_eos=True)
    assert torch.equal(kv.scales, first)
    bf16 = _llm(path, kv_cache_dtype="bf16")
    want = bf16.generate(prompt_token_ids=[p], max_new_tokens=8, temperature=0.0, ignore_eos=True)[0].token_ids
    errs = [rel_err(g, r) for g, r in zip(_teacher_forced(llm.engine, p, want), _teacher_forced(bf16.engine, p, want))]
    assert max(errs) < (0.05 if kind == "fp8" else 0.15), errs


def test_checkpoint_scales_are_not_recalibrated(tiny_one, tmp_path):
    path, layers = _with_kv_scales(tiny_one, tmp_path)
    llm = _llm(path, kv_scale_calibration=True)
    kv = llm.engine.pools.kv
    assert not kv.calibrate_next_prefill
    before = kv.scales.clone()
    llm.generate(prompt_token_ids=[prompt_of(20, seed=5)], max_new_tokens=2, temperature=0.0, ignore_eos=True)
    assert torch.equal(kv.scales, before)
