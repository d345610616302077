"""The long-prefix prefill path (`ft.kernels.attention.library_prefill`) on the CPU with torch
stand-ins for the library call and the rest (`attend_ref`, `rest_ref`): segments, padded query
rows, the GQA-as-MHA layout of the queries and the log-sum-exp merge against
`paged_attention_ref`; the dispatcher's fallback when the library refuses; the activation reserve
that counts the path's transients. The Triton kernel's log-sum-exp output is tested beside the
kernel (tests/test_kernels_prefill_attention_triton.py)."""

from __future__ import annotations

import pytest
import torch

from ft.kernels import attention
from ft.kernels import options
from ft.kernels.attention import library_prefill_reserve, paged_attention, paged_attention_ref
from ft.kernels.attention.library_prefill import (
    attend_ref,
    library_prefill_attention,
    padded_rows,
    rest_ref,
    segment_bounds,
)
from ft.kernels.attention.reference import paged_attention_lse_ref

# (start, T, Hq, Hkv, D, page, granule, segment keys): under one granule (all on the rest), one
# segment, segments of several lengths with a start off the grid, GQA 1 / 4 / 8, one query, T not a
# power of two (padded rows)
CASES = [(7, 9, 4, 2, 16, 8, 16, 64), (24, 7, 4, 4, 32, 8, 16, 64), (37, 11, 8, 2, 16, 4, 8, 16),
         (53, 1, 16, 2, 32, 16, 16, 16), (100, 20, 8, 1, 16, 8, 8, 32), (112, 5, 4, 2, 16, 8, 16, 1 << 20)]


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
@pytest.mark.parametrize("start, t, hq, hkv, d, page, granule, seg", CASES)
def test_library_path_equals_the_reference(start, t, hq, hkv, d, page, granule, seg, dtype):
    k, v, pages = _pool(start + t, hkv, d, page, dtype)
    q = torch.randn(t, hq, 2 * d, dtype=dtype)[..., :d]  # a strided view, as the model passes it
    ref = paged_attention_ref(q, k, v, pages, start, d ** -0.5)
    got = library_prefill_attention(q, k, v, pages, start, d ** -0.5, granule=granule, segment_keys=seg,
                                    attend=attend_ref, rest=rest_ref)
    assert got.dtype == dtype and got.shape == ref.shape and not got.isnan().any()
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def test_every_part_is_weighed():
    """The merge weighs parts by their log-sum-exp, and the segments see the keys they should: a
    segment's part made to weigh ~nothing changes the output; the library sees only padded rows."""
    start, t, hq, hkv, d, page = 40, 6, 4, 2, 16, 8
    k, v, pages = _pool(start + t, hkv, d, page, torch.float32)
    q = torch.randn(t, hq, d)
    ref = paged_attention_ref(q, k, v, pages, start, d ** -0.5)
    shapes = []

    def lossy(q_, k_, v_, scale):
        o, lse = attend_ref(q_, k_, v_, scale)
        shapes.append((tuple(q_.shape), k_.shape[2]))
        return (o, lse) if len(shapes) != 2 else (o, lse - 30.0)

    got = library_prefill_attention(q, k, v, pages, start, d ** -0.5, granule=8, segment_keys=16, attend=lossy,
                                    rest=rest_ref)
    assert shapes == [((1, hkv, 2 * padded_rows(t), d), 16), ((1, hkv, 2 * padded_rows(t), d), 16),
                      ((1, hkv, 2 * padded_rows(t), d), 8)]
    assert ((got - ref).norm() / ref.norm()).item() > 1e-2


@pytest.mark.parametrize("n, granule, keys", [(16, 16, 16), (48, 16, 64), (245760, 16384, 65536), (112, 16, 1 << 20),
                                              (96, 32, 40)])
def test_segment_bounds_cover_once_with_few_lengths(n, granule, keys):
    bounds = segment_bounds(n, granule, keys)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(b == a2 for (_, b), (a2, _) in zip(bounds, bounds[1:]))
    lengths = [b - a for a, b in bounds]
    assert lengths == sorted(lengths, reverse=True)
    for n_ in lengths:  # granule * 2**k, within the budget (or the granule itself)
        assert n_ % granule == 0 and (n_ // granule) & (n_ // granule - 1) == 0
        assert n_ <= max(keys, granule)
    assert len(set(lengths)) <= (n // granule).bit_length()
    with pytest.raises(ValueError, match="granule"):
        segment_bounds(n + 1, granule, keys)


def test_padded_rows():
    assert [padded_rows(t) for t in (1, 16, 17, 4095, 4096, 4097)] == [16, 16, 32, 4096, 4096, 8192]


def test_reference_log_sum_exp_is_the_softmax_normalizer():
    k, v, pages = _pool(30, 2, 16, 8, torch.float32)
    q = torch.randn(6, 4, 16)
    lse = paged_attention_lse_ref(q, k, v, pages, 24, 0.25)
    assert lse.shape == (4, 6)
    # the last query sees all 30 keys: exp(score - lse) sums to 1
    keys = k[pages[torch.arange(30) // 8], torch.arange(30) % 8].repeat_interleave(2, dim=1)  # [30, 4, 16]
    s = torch.einsum("hd,nhd->hn", q[-1], keys) * 0.25
    torch.testing.assert_close(torch.exp(s - lse[:, -1:]).sum(-1), torch.ones(4))


def test_quantized_cache_or_off_grid_granule_is_refused():
    k = torch.zeros(4, 8, 2, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="unquantized"):
        library_prefill_attention(torch.zeros(3, 4, 16), k, k, torch.arange(4), 5, 0.25, granule=8, segment_keys=8,
                                  attend=attend_ref, rest=rest_ref)
    k = torch.zeros(4, 8, 2, 16)
    with pytest.raises(ValueError, match="page size"):
        library_prefill_attention(torch.zeros(3, 4, 16), k, k, torch.arange(4), 20, 0.25, granule=12, segment_keys=12,
                                  attend=attend_ref, rest=rest_ref)


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


def test_the_path_runs_only_on_cuda():
    assert options.kernel_options().prefill_attention.library_on_cuda  # on by default
    q = torch.zeros(4, 16, 256, dtype=torch.bfloat16)
    k = torch.zeros(2, 64, 2, 256, dtype=torch.bfloat16)
    assert not attention.use_library_prefill(q, k, attention.LIBRARY_GRANULE_KEYS, None)  # CPU


def test_activation_reserve_counts_the_library_transients(monkeypatch):
    """On CUDA, with an unquantized cache and contexts past the granule, the reserve grows by the
    path's transients (no device is touched: the reserve is arithmetic); not with the path off."""
    from ft.engine.ranks.loader import activation_reserve
    from ft.model.config import ModelConfig
    from ft.tools.demo import DEMO_CONFIG

    cfg = ModelConfig.from_dict(DEMO_CONFIG)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    long, short = 4 * attention.LIBRARY_GRANULE_KEYS, attention.LIBRARY_GRANULE_KEYS // 2
    monkeypatch.setattr(options, "_current", options.variant("attention-prefill-triton-only"))
    off = activation_reserve(cfg, bf16, cuda, 256, 1, None, long)
    monkeypatch.setattr(options, "_current", options.DEFAULTS)
    base = activation_reserve(cfg, bf16, cuda, 256, 1, None, short)
    assert off == base
    grown = activation_reserve(cfg, bf16, cuda, 256, 1, None, long)
    assert grown - base == library_prefill_reserve(256, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 2)
    assert activation_reserve(cfg, bf16, cuda, 256, 1, torch.uint8, long) == base  # NVFP4 KV stays on Triton
    assert library_prefill_reserve(4096, 16, 2, 256, 2) >= attention.LIBRARY_SEGMENT_BYTES


@pytest.mark.parametrize("card_gib, limit_gib, chunk", [(16, None, 4096), (48, None, 8192), (141, None, 16384),
                                                        (141, 32, 4096), (141, 80, 16384), (80, 200, 16384),
                                                        (81559 / 1024, None, 16384), (39.4, None, 8192),
                                                        (24, None, 4096), (141, 64, 8192)])
def test_default_prefill_chunk_follows_the_card(monkeypatch, card_gib, limit_gib, chunk):
    """--max-prefill-length's default: by the card the budget sees (the limit when smaller); 4,096 on the CPU.
    Cards as they report themselves: an H100 80GB 81,559 MiB, an A100 40GB ~39.4 GiB."""
    from types import SimpleNamespace

    from ft.memory.budget import default_prefill_length

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(total_memory=int(card_gib * 2**30)))
    limit = limit_gib << 30 if limit_gib else None
    assert default_prefill_length(torch.device("cuda"), limit) == chunk
    assert default_prefill_length(torch.device("cpu"), limit) == 4096


def test_a_streamed_prefill_chunk_is_the_largest_whose_reserve_fits_a_tenth_of_the_card():
    """Offloaded with streamed prefill: the largest of 16,384 / 8,192 / 4,096 whose chunk-sized reserve
    is at most a tenth of the card, else 4,096; the 80B's own reserves (bf16, flagship shapes) give the
    32 GiB card 16,384 and the 16 GiB card 8,192."""
    from ft.memory.budget import STREAMED_PREFILL_SHARE, streamed_prefill_length

    gib = 1 << 30
    asked = []

    def linear(tokens: int) -> int:  # ~0.17 GiB per 1,024 tokens, as the 80B's activations and passes
        asked.append(tokens)
        return int(0.17 * gib * tokens / 1024)

    assert streamed_prefill_length(32 * gib, linear) == 16384 and asked == [16384]
    assert streamed_prefill_length(16 * gib, linear) == 8192
    assert streamed_prefill_length(8 * gib, linear) == 4096
    assert streamed_prefill_length(2 * gib, linear) == 4096  # nothing fits: the smallest
    edge = int(0.17 * gib * 16) / STREAMED_PREFILL_SHARE  # exactly a tenth: fits
    assert streamed_prefill_length(int(edge) + 1, linear) == 16384
    assert streamed_prefill_length(int(edge) - 1024, linear) == 8192

    from ft.engine.ranks.loader import activation_reserve
    from ft.kernels.moe import moe_pools_workspace_bytes, moe_workspace_bytes
    from ft.model.config import ModelConfig

    cfg = ModelConfig.from_file("bench/configs/qwen3-next-80b-a3b.json")
    cuda = torch.device("cuda")

    def flagship(tokens: int) -> int:
        dims = (tokens, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, 2)
        return activation_reserve(cfg, torch.bfloat16, cuda, tokens, 64, None, 262144) \
            + max(0, moe_pools_workspace_bytes(*dims) - moe_workspace_bytes(*dims))

    assert streamed_prefill_length(32 * gib, flagship) == 16384
    assert streamed_prefill_length(16 * gib, flagship) == 8192
