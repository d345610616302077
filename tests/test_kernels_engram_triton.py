"""Qwen3.8-Flash-Next's Engram kernels (`ft.kernels.engram`): the Triton kernels against the torch
references under the interpreter, and the references against the model's batched torch forms
(`EngramHashing.windows` / `rows_of_windows`, `ple_delta_batched`) on one token a sequence (decode) and on
packed sequences (prefill). Rows with slot -1 read empty states and write none; EOS ids inside a context cut
the n-grams."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.engram import ngram_rows_decode_ref, ple_decode_ref, ple_prefill_ref
from ft.kernels.engram import kernel as details
from ft.model.layers.engram import EngramHashing, PLEWeights, ple_delta_batched

EOS = 2


@pytest.mark.parametrize("ngram", [2, 3, 4])
def test_ngram_rows_equal_the_reference_and_the_model(ngram):
    hs = EngramHashing(ngram_size=ngram, heads_per_ngram=3, vocab_size_base=1000, divisible_by=8, eos_token_id=EOS,
                       multipliers=(23703573157769, 20109073645365, 8052911324071, 1299709)[: max(3, ngram)])
    c = hs.context_len
    g = torch.Generator().manual_seed(ngram)
    contexts = torch.randint(0, 300, (6, c), generator=g)
    contexts[1] = 0  # a fresh slot: no context (read as EOS ids)
    contexts[2, -1] = EOS + 1  # an EOS one back
    if c >= 2:
        contexts[3, 0] = EOS + 1  # an EOS two back: cuts order 4's token 3 back
    ids = torch.tensor([5, 17, 2 ** 45 + 1, 299, 7])  # (a large id: its product wraps negative)
    assert int(ids[2] * hs.multipliers[0]) < 0  # so the mix is negative: the remainder's sign is checked
    slots = torch.tensor([0, 1, 2, -1, 3])
    sizes, offsets = hs.head_tensors(torch.device("cpu"))
    want_ctx, got_ctx = contexts.clone(), contexts.clone()
    want = ngram_rows_decode_ref(ids, want_ctx, slots, hs.multipliers, sizes, offsets, hs.heads_per_ngram, EOS)
    got = details.ngram_rows_decode_triton(ids, got_ctx, slots, hs.multipliers, sizes, offsets, hs.heads_per_ngram,
                                           EOS)
    assert torch.equal(got, want) and torch.equal(got_ctx, want_ctx)
    assert torch.equal(want_ctx[[4, 5]], contexts[[4, 5]])  # no row has slots 4, 5; the -1 row wrote nothing
    assert (want >= 0).all() and (want < hs.padded_rows).all()
    # the model's batched form, one token a sequence (live rows only)
    live = slots >= 0
    stored = contexts[slots[live]]
    windows, after = hs.windows(ids[live], torch.where(stored == 0, EOS, stored - 1), torch.arange(int(live.sum()) + 1))
    assert torch.equal(hs.rows_of_windows(windows), want[live])
    assert torch.equal(after + 1, want_ctx[slots[live]])


def _ple_inputs(dtype, seed=0, c=2, d=48, e=24, k=4, dil=3, slots_n=5):
    g = torch.Generator().manual_seed(seed)
    width = c * d
    w = PLEWeights(key_proj=torch.randn(width, e, generator=g) * 0.3, value_proj=torch.randn(d, e, generator=g) * 0.3,
                   norm_key=torch.randn(width, generator=g) * 0.1, norm_query=torch.randn(width, generator=g) * 0.1,
                   norm_conv=torch.randn(width, generator=g) * 0.1, conv=torch.randn(width, k, generator=g) * 0.3,
                   streams=c, dilation=dil)
    histories = torch.randn(slots_n, w.history, width, generator=g).to(dtype)
    emb = torch.randn(4, e, generator=g).to(dtype)
    x = torch.randn(4, width, generator=g).to(dtype)
    return w, histories, emb, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_ple_decode_equals_the_reference_and_the_model(dtype):
    w, histories, emb, x = _ple_inputs(dtype)
    slots = torch.tensor([3, -1, 0, 4])
    key_value = torch.nn.functional.linear(emb, torch.cat([w.key_proj, w.value_proj]).to(dtype))
    norms = [t.to(dtype) for t in (w.norm_key, w.norm_query, w.norm_conv, w.conv)]
    want_h, got_h = histories.clone(), histories.clone()
    want = ple_decode_ref(x, key_value, want_h, slots, *norms, w.streams, w.dilation, w.eps)
    got = details.ple_decode_triton(x, key_value, got_h, slots, *norms, w.streams, w.dilation, w.eps)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_h.float(), want_h.float(), rtol=tol, atol=tol)
    assert torch.equal(want_h[[1, 2]], histories[[1, 2]]) and torch.equal(got_h[[1, 2]], histories[[1, 2]])
    assert torch.equal(want_h[3, :-1], histories[3, 1:])  # moved on by one row
    if dtype != torch.float32:
        return
    # the model's batched form (fp32), one token a sequence, live rows
    live = slots >= 0
    delta, new = ple_delta_batched(emb[live], x[live].reshape(-1, w.streams, x.shape[1] // w.streams), w,
                                   histories[slots[live]], torch.arange(int(live.sum()) + 1))
    torch.testing.assert_close(want[live], x[live] + delta, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(want_h[slots[live]], new, rtol=1e-6, atol=1e-6)
    # the padding row adds a delta from an empty history (and its rows exist: finite)
    assert torch.isfinite(got[~live]).all()


def test_wide_rows_take_several_conv_programs():
    """C*D = 4 x 640: three programs of 1,024 columns a row (the last one partial)."""
    w, histories, emb, x = _ple_inputs(torch.float32, seed=2, c=4, d=640, e=32, slots_n=3)
    slots = torch.tensor([2, 0, -1, 1])
    key_value = torch.nn.functional.linear(emb, torch.cat([w.key_proj, w.value_proj]))
    want_h, got_h = histories.clone(), histories.clone()
    want = ple_decode_ref(x, key_value, want_h, slots, w.norm_key, w.norm_query, w.norm_conv, w.conv, 4, 3, w.eps)
    got = details.ple_decode_triton(x, key_value, got_h, slots, w.norm_key, w.norm_query, w.norm_conv, w.conv, 4, 3,
                                    w.eps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_h, want_h, rtol=1e-6, atol=1e-6)


def test_it_checks_its_inputs():
    w, histories, emb, x = _ple_inputs(torch.float32)
    kv = torch.zeros(4, x.shape[1] + 48)
    with pytest.raises(ValueError, match="histories"):
        details.ple_decode_triton(x, kv, histories[:, :3], torch.zeros(4, dtype=torch.int64), w.norm_key, w.norm_query,
                                  w.norm_conv, w.conv, 2, 3, w.eps)
    with pytest.raises(ValueError, match="n-grams up to 4"):
        details.ngram_rows_decode_triton(torch.zeros(1, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64),
                                         torch.zeros(1, dtype=torch.int64), (1, 2, 3, 4, 5), torch.ones(4),
                                         torch.zeros(4), 1, EOS)


PREFILL_LENGTHS = [1, 3, 12, 5, 10]
"""Packed sequences shorter and longer than the 9-token history (K = 4 taps at dilation 3)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_ple_prefill_equals_the_decode_step_token_by_token_and_the_model(dtype):
    """The prefill kernels = `ple_prefill_ref` (the decode reference over each token in order): the streams plus
    delta and every sequence's history after its last token; in fp32 also the model's batched torch form."""
    t = sum(PREFILL_LENGTHS)
    w, histories, _, _ = _ple_inputs(dtype, seed=5, slots_n=len(PREFILL_LENGTHS))
    g = torch.Generator().manual_seed(6)
    emb = torch.randn(t, w.key_proj.shape[1], generator=g).to(dtype)
    x = torch.randn(t, w.key_proj.shape[0], generator=g).to(dtype)
    cu = torch.tensor([0] + PREFILL_LENGTHS).cumsum(0)
    key_value = torch.nn.functional.linear(emb, torch.cat([w.key_proj, w.value_proj]).to(dtype))
    norms = [t_.to(dtype) for t_ in (w.norm_key, w.norm_query, w.norm_conv, w.conv)]
    want, want_h = ple_prefill_ref(x, key_value, histories, cu, *norms, w.streams, w.dilation, w.eps)
    got, got_h = details.ple_prefill_triton(x, key_value, histories, cu, *norms, w.streams, w.dilation, w.eps)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_h.float(), want_h.float(), rtol=tol, atol=tol)
    assert torch.equal(want_h[0, :-1], histories[0, 1:])  # a one-token sequence: moved on by one row
    if dtype != torch.float32:
        return
    delta, new = ple_delta_batched(emb, x.reshape(t, w.streams, -1), w, histories, cu)
    torch.testing.assert_close(want, x + delta, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(want_h, new, rtol=1e-6, atol=1e-6)


def test_ple_prefill_checks_its_inputs():
    w, histories, emb, x = _ple_inputs(torch.float32)
    kv = torch.zeros(4, x.shape[1] + 48)
    with pytest.raises(ValueError, match="cu_seqlens"):
        details.ple_prefill_triton(x, kv, histories, torch.tensor([0, 4]), w.norm_key, w.norm_query, w.norm_conv,
                                   w.conv, 2, 3, w.eps)
    with pytest.raises(ValueError, match="histories"):
        details.ple_prefill_triton(x, kv, histories[:, :3], torch.tensor([0, 4]), w.norm_key, w.norm_query,
                                   w.norm_conv, w.conv, 2, 3, w.eps)
