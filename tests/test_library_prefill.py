"""The long-prefix prefill path (`ft.kernels.attention.library_prefill`) on the CPU with the torch
stand-in for the library call (`attend_ref`): segments, the GQA-as-MHA layout of the queries, the
diagonal and the log-sum-exp merge against `paged_attention_ref`; the dispatcher's fallback when
the library refuses; the activation reserve that counts the path's transients."""

from __future__ import annotations

import pytest
import torch

from ft.kernels import attention
from ft.kernels.attention import library_prefill_reserve, paged_attention, paged_attention_ref
from ft.kernels.attention.library_prefill import attend_ref, library_prefill_attention, segment_bounds

# (start, T, Hq, Hkv, D, page, segment keys): no prefix, a prefix in one segment, uneven segments and
# a start off the page grid, GQA 1 / 4 / 8, one query
CASES = [(0, 9, 4, 2, 16, 8, 64), (24, 7, 4, 4, 32, 8, 64), (37, 11, 8, 2, 16, 4, 10), (53, 1, 16, 2, 32, 16, 7),
         (100, 20, 8, 1, 16, 8, 33)]


def _pool(n_ctx: int, hkv: int, d: int, page: int, dtype: torch.dtype, seed: int = 0):
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start, t, hq, hkv, d, page, seg", CASES)
def test_library_path_equals_the_reference(start, t, hq, hkv, d, page, seg, dtype):
    k, v, pages = _pool(start + t, hkv, d, page, dtype)
    q = torch.randn(t, hq, 2 * d, dtype=dtype)[..., :d]  # a strided view, as the model passes it
    ref = paged_attention_ref(q, k, v, pages, start, d ** -0.5)
    got = library_prefill_attention(q, k, v, pages, start, d ** -0.5, segment_keys=seg, attend=attend_ref)
    assert got.dtype == dtype and got.shape == ref.shape and not got.isnan().any()
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def test_a_wrong_merge_would_show():
    """The merge weighs parts by their log-sum-exp: dropping a segment's part changes the output."""
    start, t, hq, hkv, d, page = 40, 6, 4, 2, 16, 8
    k, v, pages = _pool(start + t, hkv, d, page, torch.float32)
    q = torch.randn(t, hq, d)
    ref = paged_attention_ref(q, k, v, pages, start, d ** -0.5)
    calls = []

    def lossy(q_, k_, v_, causal, scale):
        o, lse = attend_ref(q_, k_, v_, causal, scale)
        calls.append(causal)
        return (o, lse) if len(calls) != 2 else (o, lse - 30.0)  # the first prefix segment weighs ~nothing

    got = library_prefill_attention(q, k, v, pages, start, d ** -0.5, segment_keys=16, attend=lossy)
    assert calls == [True, False, False, False]
    assert ((got - ref).norm() / ref.norm()).item() > 1e-2


@pytest.mark.parametrize("n, keys", [(1, 1), (10, 3), (258048, 32768), (100, 100), (101, 100), (7, 50)])
def test_segment_bounds_cover_once_and_stay_bounded(n, keys):
    bounds = segment_bounds(n, keys)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b <= a + keys for a, b in bounds)
    assert all(b == a2 for (_, b), (a2, _) in zip(bounds, bounds[1:]))
    assert len(bounds) == -(-n // keys)
    lengths = [b - a for a, b in bounds]
    assert max(lengths) - min(lengths) <= len(bounds)  # near-equal
    assert segment_bounds(0, keys) == []


def test_quantized_cache_is_refused():
    k = torch.zeros(4, 8, 2, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="unquantized"):
        library_prefill_attention(torch.zeros(3, 4, 16), k, k, torch.arange(4), 5, 0.25, segment_keys=8,
                                  attend=attend_ref)


def test_dispatcher_falls_back_when_the_library_refuses(monkeypatch, caplog):
    """A RuntimeError from the library (an op this torch lacks) is logged once and the chunk, and
    every later one, runs the other path; an out-of-memory error is not swallowed."""
    k, v, pages = _pool(30, 2, 16, 8, torch.float32)
    q = torch.randn(6, 4, 16)
    monkeypatch.setattr(attention, "_library_refused", [])
    monkeypatch.setattr(attention, "use_library_prefill", lambda *a: not attention._library_refused)
    calls = []

    def refuse(*a, **kw):
        calls.append(1)
        raise RuntimeError("no cuDNN attention here")

    monkeypatch.setattr(attention, "library_prefill_attention", refuse)
    ref = paged_attention_ref(q, k, v, pages, 24, 0.25)
    with caplog.at_level("WARNING"):
        torch.testing.assert_close(paged_attention(q, k, v, pages, 24, 0.25), ref)
        torch.testing.assert_close(paged_attention(q, k, v, pages, 24, 0.25), ref)
    assert len(calls) == 1 and "no cuDNN attention here" in caplog.text
    assert attention._library_refused

    def oom(*a, **kw):
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(attention, "_library_refused", [])
    monkeypatch.setattr(attention, "library_prefill_attention", oom)
    with pytest.raises(torch.OutOfMemoryError):
        paged_attention(q, k, v, pages, 24, 0.25)


def test_the_path_runs_only_on_cuda_unquantized_long_prefixes():
    q = torch.zeros(4, 16, 256, dtype=torch.bfloat16)
    k = torch.zeros(2, 64, 2, 256, dtype=torch.bfloat16)
    long = attention.LIBRARY_PREFIX_MIN
    assert not attention.use_library_prefill(q, k, long, None)  # CPU
    meta_q = torch.empty(4, 16, 256, dtype=torch.bfloat16, device="meta")
    assert not attention.use_library_prefill(meta_q, k, long, None)


def test_activation_reserve_counts_the_library_transients(monkeypatch):
    """On CUDA, with an unquantized cache and contexts past the threshold, the reserve grows by the
    path's transients (no device is touched: the reserve is arithmetic); not with the path off."""
    from ft.engine.loader import activation_reserve
    from ft.model.config import ModelConfig
    from ft.tools.demo import DEMO_CONFIG

    cfg = ModelConfig.from_dict(DEMO_CONFIG)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    long, short = 4 * attention.LIBRARY_PREFIX_MIN, attention.LIBRARY_PREFIX_MIN // 2
    monkeypatch.setattr(attention, "LIBRARY_PREFILL_ON_CUDA", False)
    off = activation_reserve(cfg, bf16, cuda, 256, 1, None, long)
    monkeypatch.setattr(attention, "LIBRARY_PREFILL_ON_CUDA", True)
    base = activation_reserve(cfg, bf16, cuda, 256, 1, None, short)
    assert off == base
    grown = activation_reserve(cfg, bf16, cuda, 256, 1, None, long)
    assert grown - base == library_prefill_reserve(256, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 2)
    assert activation_reserve(cfg, bf16, cuda, 256, 1, torch.uint8, long) == base  # NVFP4 KV stays on Triton
    assert activation_reserve(cfg, bf16, torch.device("cpu"), 256, 1, None, long) < base  # no Triton MoE workspace either
    # the segment's K and V or the diagonal's repeated K/V, whichever is larger, plus per-query buffers
    assert library_prefill_reserve(4096, 16, 2, 256, 2) >= attention.LIBRARY_SEGMENT_BYTES
