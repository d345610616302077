"""Triton paged prefill attention against `paged_attention_ref` under the interpreter: chunks at
several offsets into a cached prefix, GQA ratios, head dims, page sizes, fp8 and NVFP4 caches. The pool is NaN
wherever no token of the sequence is (a read outside shows)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.attention import paged_attention, paged_attention_ref
from ft.kernels.attention.prefill_kernel import paged_prefill_attention_triton
from ft.kernels.attention.reference import dequantize_kv, quantize_kv

TOL = {torch.float32: 1e-5, torch.float16: 5e-3}

# (start, T, Hq, Hkv, D, page): a first chunk, chunks after a prefix (page-aligned or not), GQA 1/2/8
CASES = [(0, 13, 4, 4, 32, 8), (16, 9, 4, 2, 64, 16), (21, 30, 16, 2, 64, 8), (5, 1, 8, 1, 48, 4),
         (40, 24, 16, 2, 256, 16)]


def _pool(n_ctx, hkv, d, page, dtype, seed=0):
    """A NaN pool [P, page, Hkv, D] x 2 with random K/V at positions 0 .. n_ctx-1 on shuffled pages."""
    gen = torch.Generator().manual_seed(seed)
    need = -(-n_ctx // page)
    total = need + 3
    pages = torch.randperm(total, generator=gen)[:need]
    k = torch.full((total, page, hkv, d), float("nan"))
    v = torch.full((total, page, hkv, d), float("nan"))
    pos = torch.arange(n_ctx)
    k[pages[pos // page], pos % page] = torch.randn(n_ctx, hkv, d, generator=gen)
    v[pages[pos // page], pos % page] = torch.randn(n_ctx, hkv, d, generator=gen)
    return k.to(dtype), v.to(dtype), pages


def rel_rms(out, ref):
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("split", [False, True, "lazy"], ids=["one-loop", "causal-split", "lazy-rescale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("start", "t", "hq", "hkv", "d", "page"), CASES,
                         ids=[f"s{s}-T{t}-Hq{hq}-Hkv{hkv}-D{d}-p{p}" for s, t, hq, hkv, d, p in CASES])
def test_prefill_matches_reference(start, t, hq, hkv, d, page, dtype, split):
    """Both key-loop forms (CAUSAL_SPLIT: unmasked blocks, then the diagonal's; with 16 keys a block
    and prefixes of 16-40 tokens the unmasked loop runs for every case with a prefix), and the
    split form's lazy maxima (LAZY_RESCALE)."""
    k, v, pages = _pool(start + t, hkv, d, page, dtype)
    q = torch.randn(t, hq, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    cfg = {"BLOCK_N": 16, "CAUSAL_SPLIT": bool(split), "LAZY_RESCALE": split == "lazy"}
    got = paged_prefill_attention_triton(q, k, v, pages, start, d ** -0.5, config=cfg)
    ref = paged_attention_ref(q, k, v, pages, start, d ** -0.5)
    assert rel_rms(got, ref) < TOL[dtype]


def test_lazy_rescale_when_a_later_block_raises_the_maxima():
    """Keys of the third 16-key block scaled by 400: their scores pass the first blocks' maxima by
    hundreds (log2 units), past fp32's range, so the lazy form must rescale mid-way (without it,
    exp2 overflows); against the reference."""
    start, t, hq, hkv, d, page = 56, 6, 4, 2, 32, 8
    k, v, pages = _pool(start + t, hkv, d, page, torch.float32, seed=3)
    pos = torch.arange(32, 48)
    k[pages[pos // page], pos % page] *= 400.0
    q = torch.randn(t, hq, d, generator=torch.Generator().manual_seed(4)) * 2.0
    ref = paged_attention_ref(q, k, v, pages, start, d ** -0.5)
    for cfg in ({"CAUSAL_SPLIT": True, "LAZY_RESCALE": True}, {"CAUSAL_SPLIT": True, "LAZY_RESCALE": False, "NVFP4_F16": False}, {"CAUSAL_SPLIT": False, "LAZY_RESCALE": False, "NVFP4_F16": False}, {}):
        got = paged_prefill_attention_triton(q, k, v, pages, start, d ** -0.5, config={"BLOCK_N": 16, **cfg})
        assert rel_rms(got, ref) < TOL[torch.float32], cfg


def test_prefill_fp8_cache_and_strided_q():
    start, t, hq, hkv, d, page = 12, 10, 8, 2, 64, 8
    k32, v32, pages = _pool(start + t, hkv, d, page, torch.float32)
    scale = torch.tensor([0.02, 0.01])
    k8, v8 = quantize_kv(k32, scale[0], torch.float8_e4m3fn), quantize_kv(v32, scale[1], torch.float8_e4m3fn)
    qg = torch.randn(t, hq, 2 * d, generator=torch.Generator().manual_seed(2))  # q is a strided view, as the model's
    q = qg[..., :d]
    got = paged_prefill_attention_triton(q, k8, v8, pages, start, d ** -0.5, scale, config={"BLOCK_N": 16})
    ref = paged_attention_ref(q, k8, v8, pages, start, d ** -0.5, scale)
    assert rel_rms(got, ref) < 1e-5
    with pytest.raises(ValueError, match="kv_scale"):
        paged_prefill_attention_triton(q, k8, v8, pages, start, d ** -0.5)
    with pytest.raises(ValueError, match="cover"):
        paged_prefill_attention_triton(q, k8, v8, pages[:1], start, d ** -0.5, scale)


@pytest.mark.parametrize(("start", "t", "hq", "hkv", "d", "page"), CASES,
                         ids=[f"s{s}-T{t}-Hq{hq}-Hkv{hkv}-D{d}-p{p}" for s, t, hq, hkv, d, p in CASES])
def test_prefill_nvfp4_cache(start, t, hq, hkv, d, page):
    """NVFP4 caches (uint8 rows: D/2 code bytes, D/16 e4m3 block scales; layer scales 0.02 and 0.01):
    the kernel (fp32 and fp16 queries, q a strided view) against the reference, which dequantizes.
    Rows of no token quantize NaN to NaN block scales: a read outside the sequence shows."""
    k32, v32, pages = _pool(start + t, hkv, d, page, torch.float32)
    scale = torch.tensor([0.02, 0.01])
    k4, v4 = quantize_kv(k32 * 0.1, scale[0], torch.uint8), quantize_kv(v32 * 0.1, scale[1], torch.uint8)
    assert k4.shape[-1] == d // 2 + d // 16
    assert dequantize_kv(k4, scale[0], torch.float32)[k32.isnan()].isnan().all()  # the poison survives
    qg = torch.randn(t, hq, 2 * d, generator=torch.Generator().manual_seed(2))
    for dtype in (torch.float32, torch.float16):
        q = qg.to(dtype)[..., d:]
        ref = paged_attention_ref(q, k4, v4, pages, start, d ** -0.5, scale)
        for cfg in ({}, {"CAUSAL_SPLIT": False, "LAZY_RESCALE": False, "NVFP4_F16": False}, {"CAUSAL_SPLIT": True, "LAZY_RESCALE": False, "NVFP4_F16": False}, {"CAUSAL_SPLIT": True, "NVFP4_F16": True},
                    {"CAUSAL_SPLIT": True, "NVFP4_F16": True, "LAZY_RESCALE": True}):
            got = paged_prefill_attention_triton(q, k4, v4, pages, start, d ** -0.5, scale, config={"BLOCK_N": 16, **cfg})
            # fp16 dots: q rounded to fp16 once (exact for fp16 queries; fp32 ones within fp16's tolerance)
            f16 = cfg.get("NVFP4_F16", dtype != torch.float32 and cfg.get("CAUSAL_SPLIT", True))  # the default's
            tol = TOL[torch.float16] if f16 else TOL[dtype]
            assert rel_rms(got, ref) < tol, (dtype, cfg)
    with pytest.raises(ValueError, match="kv_scale"):
        paged_prefill_attention_triton(q, k4, v4, pages, start, d ** -0.5)
    with pytest.raises(ValueError, match="does not fit"):
        paged_prefill_attention_triton(q[..., :16], k4, v4, pages, start, d ** -0.5, scale)


def test_dispatcher_runs_the_kernel_in_interpreter_tests(monkeypatch):
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    import ft.kernels.attention.prefill_kernel as details

    calls = []
    real = details.paged_prefill_attention_triton
    monkeypatch.setattr(details, "paged_prefill_attention_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    k, v, pages = _pool(9, 2, 32, 4, torch.float32)
    q = torch.randn(9, 4, 32)
    out = paged_attention(q, k, v, pages, 0, 32 ** -0.5)
    assert calls and rel_rms(out, paged_attention_ref(q, k, v, pages, 0, 32 ** -0.5)) < 1e-5


@pytest.mark.parametrize("kind", ["plain", "nvfp4"])
@pytest.mark.parametrize("split", [False, True, "lazy"], ids=["one-loop", "causal-split", "lazy-rescale"])
@pytest.mark.parametrize("start, t, hq, hkv, d, page", [(0, 13, 4, 4, 32, 8), (21, 30, 16, 2, 64, 8)])
def test_log_sum_exp_output_matches_reference(start, t, hq, hkv, d, page, split, kind):
    """The kernel's log-sum-exp output (HAS_LSE: what the library path merges with) against
    `paged_attention_lse_ref`, in every loop form; the output itself is unchanged by it."""
    from ft.kernels.attention.reference import paged_attention_lse_ref

    k, v, pages = _pool(start + t, hkv, d, page, torch.float32)
    scale = None
    if kind == "nvfp4":
        scale = torch.tensor([0.01, 0.005])
        k, v = quantize_kv(torch.nan_to_num(k), scale[0], torch.uint8), quantize_kv(torch.nan_to_num(v), scale[1], torch.uint8)
    q = torch.randn(t, hq, d)
    cfg = {"CAUSAL_SPLIT": bool(split), "LAZY_RESCALE": split == "lazy", "NVFP4_F16": False}
    lse = torch.full((hq, t), float("nan"))
    out = paged_prefill_attention_triton(q, k, v, pages, start, d ** -0.5, scale, config=cfg, lse=lse)
    torch.testing.assert_close(lse, paged_attention_lse_ref(q, k, v, pages, start, d ** -0.5, scale), rtol=0, atol=1e-4)
    torch.testing.assert_close(out, paged_prefill_attention_triton(q, k, v, pages, start, d ** -0.5, scale, config=cfg),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="lse"):
        paged_prefill_attention_triton(q, k, v, pages, start, d ** -0.5, scale, config=cfg, lse=lse.t())
