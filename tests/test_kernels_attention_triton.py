"""Paged decode attention and the decode KV write: the batched references against the per-sequence
prefill references, and the Triton kernels (single pass, split-K) against the references under the
interpreter. The pool is NaN everywhere but the sequences' tokens, and page-table entries past a
sequence's length point at NaN pages: nothing outside a sequence may reach its result. The output
gate is a strided view of a q-projection-like tensor whose q halves are NaN: a read outside the
gate's columns shows."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.attention import (
    decode_attention_splits,
    decode_attention_workspace,
    paged_attention_ref,
    paged_decode_attention,
    paged_decode_attention_ref,
    write_kv_decode,
    write_kv_decode_ref,
    write_kv_ref,
)
from ft.kernels.attention.kernel import (
    paged_decode_attention_triton,
    write_kv_decode_triton,
)
from ft.kernels.attention.reference import dequantize_kv, quantize_kv

TOL = {torch.float32: 1e-5, torch.float16: 5e-3}
"""Relative RMS: fp32 up to summation order; fp16 probabilities and products rounded as the reference rounds them."""
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
LAYERS, LAYER = 2, 1  # k_cache, v_cache are views of layer 1 of a two-layer pool: not contiguous

# (seq_lens, Hq, Hkv, D, page_size): lengths 1, page boundaries and one past; GQA ratios 1, 2, 8
CASES = [
    ((1, 8, 9, 24), 4, 4, 32, 8),
    ((16, 5, 4, 17), 4, 2, 64, 4),
    ((33, 1, 16), 16, 2, 64, 16),
    ((0, 12), 8, 1, 48, 8),  # a padding row (length 0) and a head dim that is not a power of two
    ((21,), 2, 1, 128, 8),
    ((19,), 16, 2, 256, 16),  # the flagship's heads, tiny context
]
CASE_IDS = [f"B{len(s)}-Hq{hq}-Hkv{hkv}-D{d}-page{p}" for s, hq, hkv, d, p in CASES]


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS difference; NaN anywhere in `out` (an unwritten poisoned output, a leak) gives nan."""
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def make_batch(seq_lens, hkv, d, page, dtype, seed=0, spare=3):
    """A NaN pool [P, L, 2, page, Hkv, D] with random K/V at the sequences' tokens, on shuffled pages;
    page-table entries past each sequence's pages point at NaN pages (spare pages, page 0 among them).
    -> (kv, page_table [B, max_pages] int64, seq_lens [B] int32)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in seq_lens]
    width = max(need) + 1
    pages = torch.randperm(sum(need) + spare - 1, generator=gen) + 1
    pages = torch.cat([pages[:sum(need)], torch.tensor([0]), pages[sum(need):]])  # page 0 a NaN page: a masked
    # load that falls back to page 0 would read NaN
    kv = torch.full((len(pages), LAYERS, 2, page, hkv, d), float("nan"), dtype=dtype)
    table = torch.empty((len(seq_lens), width), dtype=torch.int64)
    first = 0
    for b, (n, k) in enumerate(zip(seq_lens, need)):
        table[b, :k] = pages[first:first + k]
        table[b, k:] = pages[sum(need):][torch.randint(spare, (width - k,), generator=gen)]  # garbage: NaN pages
        first += k
        pos = torch.arange(n)
        for layer in range(LAYERS):
            kv[table[b, pos // page], layer, :, pos % page] = torch.randn(n, 2, hkv, d, generator=gen).to(dtype)
    return kv, table, torch.tensor(seq_lens, dtype=torch.int32)


def layer_views(kv: torch.Tensor):
    return kv[:, LAYER, 0], kv[:, LAYER, 1]


def random_q(b, hq, d, dtype, seed=1):
    return torch.randn(b, hq, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def random_gate(b, hq, d, dtype, seed=4):
    """The output gate as the model passes it: gate half of a q projection [B, Hq, 2D] (q, gate
    interleaved per head) -> a [B, Hq, D] view with strides (2 Hq D, 2D, 1); the q halves are NaN."""
    qg = torch.full((b, hq, 2 * d), float("nan"), dtype=dtype)
    qg[..., d:] = (2 * torch.randn(b, hq, d, generator=torch.Generator().manual_seed(seed))).to(dtype)
    return qg[..., d:]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(("seq_lens", "hq", "hkv", "d", "page"), CASES, ids=CASE_IDS)
def test_decode_ref_matches_per_sequence_ref(seq_lens, hq, hkv, d, page, dtype):
    kv, table, lens = make_batch(seq_lens, hkv, d, page, dtype)
    k_cache, v_cache = layer_views(kv)
    q = random_q(len(seq_lens), hq, d, dtype)
    scale = d ** -0.5
    out = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        pages = table[b, :-(-n // page)]
        ref = paged_attention_ref(q[b:b + 1], k_cache, v_cache, pages, n - 1, scale)[0]
        assert rel_rms(out[b], ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(("seq_lens", "hq", "hkv", "d", "page"), CASES, ids=CASE_IDS)
def test_decode_ref_gate(seq_lens, hq, hkv, d, page, dtype):
    """The gated reference is the fp32 attention output times sigmoid(gate) in fp32, rounded once:
    bit for bit. Its fp32 output is the reference's on q.float() (the same fp32 ops on the same values)."""
    kv, table, lens = make_batch(seq_lens, hkv, d, page, dtype)
    k_cache, v_cache = layer_views(kv)
    q = random_q(len(seq_lens), hq, d, dtype)
    gate = random_gate(len(seq_lens), hq, d, dtype)
    scale = d ** -0.5
    out = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale, gate=gate)
    o32 = paged_decode_attention_ref(q.float(), k_cache, v_cache, table, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.equal(out, (o32 * torch.sigmoid(gate.float())).to(dtype))
    if dtype == torch.float32:  # nothing to round: the ungated output times the gate
        ungated = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale)
        assert torch.equal(out, ungated * torch.sigmoid(gate))
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))


def decode_tokens(table, lens, page):
    """The slots of each sequence's next token (at position seq_lens[b]) -> slot_mapping [B] int64."""
    pos = lens.long()
    return table.gather(1, (pos // page)[:, None])[:, 0] * page + pos % page


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_write_kv_decode_ref_matches_write_kv_ref(dtype):
    page, hkv, d = 4, 2, 16
    kv, table, lens = make_batch((3, 4, 8, 1), hkv, d, page, dtype)
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(4, hkv, d, generator=gen).to(dtype) for _ in range(2))
    slots = decode_tokens(table, lens, page)
    slots[2] = -1  # a padding row: writes nothing
    expected = kv.clone()
    for b in (0, 1, 3):
        write_kv_ref(*layer_views(expected), k[b:b + 1], v[b:b + 1], table[b], int(lens[b]))
    write_kv_decode_ref(*layer_views(kv), k, v, slots)
    torch.testing.assert_close(kv, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(("hkv", "d", "page"), [(2, 16, 4), (1, 48, 8), (2, 256, 16)], ids=["Hkv2-D16-page4",
                                                                                          "Hkv1-D48-page8",
                                                                                          "Hkv2-D256-page16"])
def test_write_kv_decode_triton(hkv, d, page, dtype):
    kv, table, lens = make_batch((3, page - 1, 2 * page, 1), hkv, d, page, dtype)
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(4, hkv, d, generator=gen).to(dtype) for _ in range(2))
    slots = decode_tokens(table, lens, page)
    slots[1] = -1
    expected = kv.clone()
    write_kv_decode_ref(*layer_views(expected), k, v, slots)
    write_kv_decode_triton(*layer_views(kv), k, v, slots)
    torch.testing.assert_close(kv, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["extra-fp32", "extra-fp16"])
def test_write_kv_decode_writes_the_extra_rows_in_its_launch(monkeypatch, cache_dtype):
    """`extra` (QSA's raw indexer keys): the rows land at the tokens' slots of their own paged cache (cast to
    its dtype), padding rows write nothing, K and V as without it; the dispatcher takes the kernel's
    launch, or `write_slots` where the extra cache's pages differ from the KV cache's."""
    from ft.kernels.attention import write_kv_decode
    from ft.kernels.slot_write import write_slots_ref

    hkv, d, page, dtype = 2, 16, 4, torch.float16
    kv, table, lens = make_batch((3, page - 1, 2 * page, 1), hkv, d, page, dtype)
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(4, hkv, d, generator=gen).to(dtype) for _ in range(2))
    rows = torch.randn(4, 24, generator=gen).to(dtype)
    slots = decode_tokens(table, lens, page)
    slots[1] = -1
    pages = kv.shape[0]
    index = torch.full((int(pages), page, 24), float("nan"), dtype=cache_dtype)
    want_kv, want_index = kv.clone(), index.clone()
    write_kv_decode_ref(*layer_views(want_kv), k, v, slots)
    write_slots_ref(want_index, slots, rows, page_size=page)
    write_kv_decode_triton(*layer_views(kv), k, v, slots, extra=(index, rows))
    torch.testing.assert_close(kv, want_kv, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(index, want_index, rtol=0, atol=0, equal_nan=True)
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    for pages_of in (page, 2 * page):  # the same page size: one launch; another: the KV launch, then write_slots
        got = torch.full((int(pages), pages_of, 24), float("nan"), dtype=cache_dtype)
        want = got.clone()
        write_slots_ref(want, slots, rows, page_size=pages_of)
        write_kv_decode(*layer_views(kv.clone()), k, v, slots, extra=(got, rows))
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


# every path ungated; the gate on the split path (the single kernel's gate: test_decode_attention_gate_is_the_product);
# 37 splits: the combine's loops over more than one chunk of COMBINE_CHUNK_S, the last one partial
@pytest.mark.parametrize(("path", "gated"), [("single", False), ("split3", False), ("split8", False), ("split3", True),
                                             ("split37", True)],
                         ids=["single-nogate", "split3-nogate", "split8-nogate", "split3-gate", "split37-gate"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(("seq_lens", "hq", "hkv", "d", "page"), CASES, ids=CASE_IDS)
def test_decode_attention_triton(seq_lens, hq, hkv, d, page, dtype, path, gated):
    kv, table, lens = make_batch(seq_lens, hkv, d, page, dtype)
    k_cache, v_cache = layer_views(kv)
    b = len(seq_lens)
    q = random_q(b, hq, d, dtype)
    gate = random_gate(b, hq, d, dtype) if gated else None
    scale = d ** -0.5
    splits = 1 if path == "single" else int(path.removeprefix("split"))
    ws = decode_attention_workspace(b + 1, hq, d, splits, "cpu")  # larger than needed: a bucket's prefix
    ws.acc.fill_(float("nan"))
    ws.stats.fill_(float("nan"))
    out = torch.full_like(q, float("nan"))
    # NOTE: 16-token blocks: several blocks per sequence, blocks that straddle pages and split ends
    y = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, scale, splits=splits, workspace=ws, out=out,
                                      gate=gate, config={"BLOCK_N": 16})
    assert y.data_ptr() == out.data_ptr()
    assert rel_rms(y, paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale, gate=gate)) < TOL[dtype]
    for i, n in enumerate(seq_lens):
        if n == 0:  # a padding row: zeros, gated or not
            assert torch.equal(y[i], torch.zeros_like(y[i]))


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention_gate_is_the_product(splits):
    """fp32: the gated kernels give the ungated kernels' output times sigmoid(gate), up to the
    sigmoid's last bits (the same attention, the same order of sums)."""
    kv, table, lens = make_batch((37, 0, 5), 2, 64, 8, torch.float32)
    q = random_q(3, 8, 64, torch.float32)
    gate = random_gate(3, 8, 64, torch.float32)
    args = (q, *layer_views(kv), table, lens, 0.125)
    y = paged_decode_attention_triton(*args, splits=splits, gate=gate, config={"BLOCK_N": 16})
    ungated = paged_decode_attention_triton(*args, splits=splits, config={"BLOCK_N": 16})
    torch.testing.assert_close(y, ungated * torch.sigmoid(gate), rtol=1e-6, atol=1e-7)


def test_decode_attention_default_blocks():
    """The default configuration (64-token blocks) and workspace allocation of the split path."""
    kv, table, lens = make_batch((70, 3), 2, 32, 16, torch.float32)
    q = random_q(2, 4, 32, torch.float32)
    ref = paged_decode_attention_ref(q, *layer_views(kv), table, lens, 0.2)
    for splits in (1, 2):
        y = paged_decode_attention_triton(q, *layer_views(kv), table, lens, 0.2, splits=splits)
        assert rel_rms(y, ref) < TOL[torch.float32]


def test_split_rule():
    assert decode_attention_splits(1, 2, 64) == 1  # short contexts: single pass
    assert decode_attention_splits(1, 2, 4096) == 16
    assert decode_attention_splits(8, 2, 4096) == 16
    assert decode_attention_splits(1, 2, 65536) == 128
    assert decode_attention_splits(8, 2, 65536) == 17  # ~264 programs
    assert decode_attention_splits(64, 2, 262144) == 3
    ws = decode_attention_workspace(8, 16, 256, 17, "cpu")
    assert ws.rows == 136 and ws.acc.shape == (136, 16, 256) and ws.stats.shape == (136, 16, 2)
    assert decode_attention_splits(1, 2, 131072, target_programs=396, max_splits=256) == 198


def test_prmt_split_count_aims_at_its_own_occupancy(monkeypatch):
    """The NVFP4_PRMT kernel's split count (`decode_split_count`): `prmt_programs_per_sm` programs
    an SM on a device with SMs (three on a 132-SM H200 at 168 registers), the library rule
    elsewhere and for other kernels."""
    import ft.kernels.attention.decode_tuning as attention_kernel

    monkeypatch.setattr(attention_kernel, "sm_count", lambda device: 132)
    from ft.kernels.options import kernel_options, use_kernel_options, variant

    assert kernel_options().decode_attention.prmt_programs_per_sm == 3
    dev = torch.device("cpu")
    assert attention_kernel.decode_split_count(1, 2, 131072, dev, prmt=True) == 198
    assert attention_kernel.decode_split_count(8, 2, 131072, dev, prmt=True) == 24  # 384 programs: one wave
    assert attention_kernel.decode_split_count(256, 2, 131072, dev, prmt=True) == 1
    assert attention_kernel.decode_split_count(1, 2, 4096, dev, prmt=True) == 16  # by length
    assert attention_kernel.decode_split_count(1, 2, 131072, dev, prmt=False) == 128  # the library rule
    with use_kernel_options(variant(**{"decode_attention.prmt_programs_per_sm": 0})):
        assert attention_kernel.decode_split_count(1, 2, 131072, dev, prmt=True) == 128


def test_dispatchers(monkeypatch):
    kv, table, lens = make_batch((5, 9), 2, 32, 4, torch.float32)
    q = random_q(2, 4, 32, torch.float32)
    ref = paged_decode_attention_ref(q, *layer_views(kv), table, lens, 0.3)
    monkeypatch.delenv("FT_TRITON_INTERPRET_TEST", raising=False)
    assert torch.equal(paged_decode_attention(q, *layer_views(kv), table, lens, 0.3), ref)  # the reference
    import ft.kernels.attention.kernel as details

    calls = []
    real_attn, real_write = details.paged_decode_attention_triton, details.write_kv_decode_triton
    monkeypatch.setattr(details, "paged_decode_attention_triton",
                        lambda *a, **kw: calls.append(kw) or real_attn(*a, **kw))
    monkeypatch.setattr(details, "write_kv_decode_triton", lambda *a: calls.append("write") or real_write(*a))
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    assert rel_rms(paged_decode_attention(q, *layer_views(kv), table, lens, 0.3, max_seq_len=4096), ref) < 1e-5
    assert calls[-1]["max_seq_len"] == 4096 and calls[-1]["gate"] is None
    gate = random_gate(2, 4, 32, torch.float32)
    gated_ref = paged_decode_attention_ref(q, *layer_views(kv), table, lens, 0.3, gate=gate)
    y = paged_decode_attention(q, *layer_views(kv), table, lens, 0.3, gate=gate)
    assert calls[-1]["gate"] is gate and rel_rms(y, gated_ref) < 1e-5
    gate_t = gate.transpose(0, 2).contiguous().transpose(0, 2)  # D's stride not 1: the kernels take a copy
    assert rel_rms(paged_decode_attention_triton(q, *layer_views(kv), table, lens, 0.3, gate=gate_t), gated_ref) < 1e-5
    with pytest.raises(ValueError, match="gate"):
        paged_decode_attention_triton(q, *layer_views(kv), table, lens, 0.3, gate=gate[:, :2])
    with pytest.raises(ValueError, match="gate"):
        paged_decode_attention_triton(q, *layer_views(kv), table, lens, 0.3, gate=gate.half())
    monkeypatch.delenv("FT_TRITON_INTERPRET_TEST")
    out = torch.full_like(q, float("nan"))
    y = paged_decode_attention(q, *layer_views(kv), table, lens, 0.3, gate=gate, out=out)  # the reference
    assert y.data_ptr() == out.data_ptr() and torch.equal(y, gated_ref)
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    k = torch.randn(2, 2, 32)
    write_kv_decode(*layer_views(kv), k, k, decode_tokens(table, lens, 4))
    assert calls[-1] == "write" and torch.equal(layer_views(kv)[0][table[1, 2], 1], k[1])
    with pytest.raises(ValueError, match="page_table"):
        paged_decode_attention_triton(q, *layer_views(kv), table[:1], lens, 0.3)
    with pytest.raises(ValueError, match="workspace"):
        paged_decode_attention_triton(q, *layer_views(kv), table, lens, 0.3, splits=4,
                                      workspace=decode_attention_workspace(2, 4, 32, 3, "cpu"))


def test_debug_checks(monkeypatch):
    kv, table, lens = make_batch((5, 9), 2, 32, 4, torch.float32)
    q = random_q(2, 4, 32, torch.float32)
    monkeypatch.setenv("FT_DEBUG", "1")
    paged_decode_attention(q, *layer_views(kv), table, lens, 0.3)
    bad = table.clone()
    bad[1, 0] = kv.shape[0]
    with pytest.raises(ValueError, match="page ids"):
        paged_decode_attention(q, *layer_views(kv), bad, lens, 0.3)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, *layer_views(kv), table, lens + 100, 0.3)


# ------------------------------------------------------------------------------- fp8 KV cache

FP8 = torch.float8_e4m3fn


def fp8_batch(seq_lens, hkv, d, page, seed=0):
    """make_batch's layout with an fp8 pool (NaN where no token is: fp8's NaN bits), its K/V written
    through the reference quantizer with per-layer scales -> (kv fp8, table, lens, kv_scale [2], dequantized copy fp32)."""
    kv32, table, lens = make_batch(seq_lens, hkv, d, page, torch.float32, seed)
    kv32 = kv32 * 3.0  # values past 448 / scale would clamp: the scale must cover them
    scale = torch.tensor([0.05, 0.03], dtype=torch.float32)
    kv8 = torch.empty(kv32.shape, dtype=FP8)
    kv8[:, :, 0] = quantize_kv(kv32[:, :, 0], scale[0], FP8)
    kv8[:, :, 1] = quantize_kv(kv32[:, :, 1], scale[1], FP8)
    return kv8, table, lens, scale


def test_fp8_reference_round_trip_and_clamp():
    x = torch.tensor([0.0, 1.0, -3.3, 1e6, -1e6, 7e-4])
    s = torch.tensor(0.01)
    q = quantize_kv(x, s, FP8)
    back = dequantize_kv(q, s, torch.float32)
    assert torch.equal(back[3:5], torch.tensor([4.48, -4.48]))  # clamped to 448 * scale, never NaN
    assert (back[:3] - x[:3]).abs().max() <= 0.0625 * x[:3].abs().max()  # e4m3: 3 mantissa bits
    assert not back.isnan().any()


@pytest.mark.parametrize("path", ["single", "split3"])
@pytest.mark.parametrize(("seq_lens", "hq", "hkv", "d", "page"), CASES[:4], ids=CASE_IDS[:4])
def test_decode_attention_fp8_cache(seq_lens, hq, hkv, d, page, path):
    """An fp8 cache: the kernels (fp32 and fp16 queries) against the reference, which dequantizes."""
    kv8, table, lens, scale = fp8_batch(seq_lens, hkv, d, page)
    k_cache, v_cache = layer_views(kv8)
    b = len(seq_lens)
    splits = 1 if path == "single" else 3
    for dtype in (torch.float32, torch.float16):
        q = random_q(b, hq, d, dtype)
        ref = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, d ** -0.5, kv_scale=scale)
        y = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, d ** -0.5, splits=splits,
                                          config={"BLOCK_N": 16}, kv_scale=scale)
        assert rel_rms(y, ref) < TOL[dtype], dtype
    # the dequantized values through the unquantized reference: the same attention
    deq = kv8.float()
    deq[:, :, 0] *= scale[0]
    deq[:, :, 1] *= scale[1]
    q = random_q(b, hq, d, torch.float32)
    plain = paged_decode_attention_ref(q, *layer_views(deq), table, lens, d ** -0.5)
    assert rel_rms(paged_decode_attention_ref(q, k_cache, v_cache, table, lens, d ** -0.5, kv_scale=scale),
                   plain) < 1e-6
    with pytest.raises(ValueError, match="kv_scale"):
        paged_decode_attention_triton(q, k_cache, v_cache, table, lens, d ** -0.5)


def test_write_kv_decode_fp8_matches_reference():
    kv8, table, lens, scale = fp8_batch((3, 7, 16, 1), 2, 32, 8)
    gen = torch.Generator().manual_seed(3)
    k, v = ((torch.randn(4, 2, 32, generator=gen) * 5).to(torch.float16) for _ in range(2))
    k[0, 0, 0] = 1e4  # clamps
    slots = decode_tokens(table, lens, 8)
    slots[1] = -1
    expected = kv8.clone()
    write_kv_decode_ref(*layer_views(expected), k, v, slots, kv_scale=scale)
    write_kv_decode_triton(*layer_views(kv8), k, v, slots, kv_scale=scale)
    assert torch.equal(kv8.view(torch.uint8), expected.view(torch.uint8))


# ------------------------------------------------------------------------------- NVFP4 KV cache

NVFP4 = torch.uint8  # an NVFP4 cache: rows of D/2 E2M1 code bytes then D/16 e4m3 block-scale bytes


def nvfp4_batch(seq_lens, hkv, d, page, seed=0):
    """make_batch's layout as an NVFP4 pool [P, L, 2, page, Hkv, D/2 + D/16] uint8: the sequences' K/V
    through the reference quantizer with per-layer scales, every other row 0xFF (codes -6 with NaN
    block scales: a read outside the sequences gives NaN) -> (kv uint8, table, lens, kv_scale [2])."""
    kv32, table, lens = make_batch(seq_lens, hkv, d, page, torch.float32, seed)
    kv32 = kv32 * 3.0
    scale = torch.tensor([0.05, 0.03], dtype=torch.float32)
    kv4 = torch.stack([quantize_kv(kv32[:, :, i], scale[i], NVFP4) for i in (0, 1)], dim=2)
    kv4[kv32[..., 0].isnan()] = 0xFF
    return kv4, table, lens, scale


def nvfp4_special_values(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """[n, d] test data for the quantizer (d % 16 == 0): Gaussian blocks of magnitudes 1e-4 .. 1e3
    (block scales from e4m3 subnormals to the 448 clamp, where values saturate at 6), an all-zero
    block (scale 1.0), and, at layer scale 0.5, a block of amax 6 (block scale 2, so x / (b * s) = x)
    holding every E2M1 rounding tie, both signs, a negative zero and a value rounding to -0."""
    x = torch.randn(n, d, generator=gen) * torch.logspace(-4, 3, n * d // 16).reshape(n, d // 16, 1) \
        .repeat_interleave(16, -1).reshape(n, d)
    x[0, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
                              -0.0, -0.1])
    if d > 16:
        x[0, 16:32] = 0.0
    return x


def test_nvfp4_reference_is_the_checkpoint_quantizers_rounding():
    """quantize_kv's NVFP4 rows are ModelOpt's NVFP4 (ft.tools.nvfp4_quantize, bit for bit there)
    with the layer scale as scale_2: the same codes and block scales, byte for byte; dequantize_kv
    gives ft.kernels.nvfp4's dequantized values. (scale_2 = global_amax / 2688 exactly for these.)"""
    from ft.kernels.nvfp4.reference import dequantize_nvfp4
    from ft.tools.nvfp4_quantize import quantize_nvfp4

    x = nvfp4_special_values(24, 64, torch.Generator().manual_seed(0))
    for s in (0.5, 0.125, 1.0, 2.0**-10, 3.0):
        packed, blocks, s2 = quantize_nvfp4(x, global_amax=2688.0 * s, scale_2_division="exact")
        assert s2.item() == s
        rows = quantize_kv(x, torch.tensor(s), NVFP4)
        assert rows.dtype == torch.uint8 and rows.shape == (24, 64 // 2 + 64 // 16)
        assert torch.equal(rows[:, :32], packed) and torch.equal(rows[:, 32:], blocks.view(torch.uint8))
        assert torch.equal(dequantize_kv(rows, torch.tensor(s), torch.float32), dequantize_nvfp4(packed, blocks, s2))
    rows = quantize_kv(x, torch.tensor(0.5), NVFP4)
    codes = torch.stack([rows[0, :8] & 0xF, rows[0, :8] >> 4], -1).flatten().tolist()
    assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 0, 8]  # ties to even, -0.0 -> 0, -0.1 -> 8
    assert rows[0, 32] == 0x40 and rows[0, 33] == 0x38  # block scales 2.0 and 1.0 (the zero block) as e4m3 bits
    gauss = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    back = dequantize_kv(quantize_kv(gauss, torch.tensor(1.0), NVFP4), torch.tensor(1.0), torch.float32)
    assert 0.05 < rel_rms(back, gauss) < 0.12  # E2M1 with a scale per 16: ~10% relative RMS on Gaussian data
    with pytest.raises(ValueError, match="kv_scale"):
        quantize_kv(x, None, NVFP4)
    with pytest.raises(ValueError, match="multiple of 9"):
        dequantize_kv(torch.zeros(2, 10, dtype=torch.uint8), torch.tensor(1.0), torch.float32)


@pytest.mark.parametrize(("hkv", "d", "page", "dtype"), [(2, 16, 4, torch.float32), (1, 48, 8, torch.float16),
                                                         (2, 256, 16, torch.bfloat16), (3, 64, 4, torch.float32)],
                         ids=["Hkv2-D16-fp32", "Hkv1-D48-fp16", "Hkv2-D256-bf16", "Hkv3-D64-fp32"])
def test_write_kv_decode_nvfp4_matches_reference(hkv, d, page, dtype):
    """The Triton decode write quantizes to NVFP4 exactly as the reference (bit for bit: block amax,
    e4m3 block scale rounded by hand, IEEE divisions, E2M1 ties to even, saturation, signs, packing),
    padding rows write nothing, other rows keep their bytes; k and v strided views."""
    kv4, table, lens, scale = nvfp4_batch((3, page - 1, 2 * page, 1), hkv, d, page)
    gen = torch.Generator().manual_seed(3)
    kvx = torch.stack([nvfp4_special_values(4 * hkv, d, gen).reshape(4, hkv, d) for _ in range(2)], dim=2)
    k, v = kvx[:, :, 0].to(dtype), kvx[:, :, 1].to(dtype)  # strided views [4, Hkv, D]
    slots = decode_tokens(table, lens, page)
    slots[1] = -1
    for s in (scale, torch.tensor([0.5, 0.125])):  # 0.5: block 0 of k holds every tie exactly
        expected = kv4.clone()
        got = kv4.clone()
        write_kv_decode_ref(*layer_views(expected), k, v, slots, kv_scale=s)
        write_kv_decode_triton(*layer_views(got), k, v, slots, kv_scale=s)
        assert torch.equal(got, expected)
        assert not torch.equal(expected, kv4)  # something was written
    with pytest.raises(ValueError, match="kv_scale"):
        write_kv_decode_triton(*layer_views(got), k, v, slots)


def test_write_kv_nvfp4_prefill_and_decode_references_agree():
    """The prefill write (a chunk of tokens) stores what the decode write stores token by token."""
    kv4, table, lens, scale = nvfp4_batch((3, 4, 8, 1), 2, 32, 4)
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(4, 2, 32, generator=gen) for _ in range(2))
    slots = decode_tokens(table, lens, 4)
    slots[2] = -1
    expected = kv4.clone()
    for b in (0, 1, 3):
        write_kv_ref(*layer_views(expected), k[b:b + 1], v[b:b + 1], table[b], int(lens[b]), kv_scale=scale)
    write_kv_decode_ref(*layer_views(kv4), k, v, slots, kv_scale=scale)
    assert torch.equal(kv4, expected)


# the loops the defaults run (PRMT where D % 64 == 0 and q is 16-bit, else f16) on every case, single
# and split; the others (the byte-wise halves, whole tiles, the CUDA-core loop, which needs D % 64 == 0)
# on two cases each, split only, to keep the interpreter's time bounded
NVFP4_LOOP_CASES = [(loop, c, i) for loop in ("prmt", "f16") for c, i in zip(CASES, CASE_IDS)] + \
    [("halves", CASES[k], CASE_IDS[k]) for k in (1, 3)] + [("tiles", CASES[k], CASE_IDS[k]) for k in (0, 5)]
NVFP4_DEFAULT_LOOPS = ("prmt", "f16")


@pytest.mark.parametrize(("loop", "case", "path"),
                         [(lp, c, p) for lp, c, _ in NVFP4_LOOP_CASES
                          for p in (("single", "split3") if lp in NVFP4_DEFAULT_LOOPS else ("split3",))],
                         ids=[f"{i}-{lp}-{p}" for lp, _, i in NVFP4_LOOP_CASES
                              for p in (("single", "split3") if lp in NVFP4_DEFAULT_LOOPS else ("split3",))])
def test_decode_attention_nvfp4_cache(loop, case, path):
    """An NVFP4 cache: the kernels (fp32 and fp16 queries; gated fp16) against the reference, which
    dequantizes; the reference equals the unquantized reference on the dequantized values. Both
    inner loops: whole dequantized tiles, q's even and odd columns against the low and high
    nibbles (`NVFP4_HALVES`, the default; it takes D >= 32, smaller heads run the tiles), and fp16 dots
    over tiles decoded in fp16 (`NVFP4_F16`; a word at a time where D % 64 == 0 and D == BLOCK_D;
    fp32 queries rounded to fp16: within fp16's tolerance), and the halves decoded straight to fp16
    (`NVFP4_PRMT`: D % 64 == 0; on CPU its byte-wise stand-in for the PTX, fp32 queries keep the halves)."""
    seq_lens, hq, hkv, d, page = case
    kv4, table, lens, scale = nvfp4_batch(seq_lens, hkv, d, page)
    k_cache, v_cache = layer_views(kv4)
    b = len(seq_lens)
    splits = 1 if path == "single" else 3
    for dtype, gated in ((torch.float32, False), (torch.float16, False), (torch.float16, True)):
        q = random_q(b, hq, d, dtype)
        gate = random_gate(b, hq, d, dtype) if gated else None
        ref = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, d ** -0.5, gate=gate, kv_scale=scale)
        out = torch.full_like(q, float("nan"))
        y = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, d ** -0.5, splits=splits, out=out,
                                          gate=gate, config={"BLOCK_N": 16, "NVFP4_HALVES": loop == "halves",
                                                                  "NVFP4_F16": loop == "f16",
                                                                  "NVFP4_PRMT": loop == "prmt"}, kv_scale=scale)
        assert rel_rms(y, ref) < TOL[torch.float16 if loop in ("f16", "prmt") else dtype], (dtype, gated)
        for i, n in enumerate(seq_lens):
            if n == 0:
                assert torch.equal(y[i], torch.zeros_like(y[i]))
    deq = torch.stack([dequantize_kv(kv4[:, :, i], scale[i], torch.float32) for i in (0, 1)], dim=2)
    q = random_q(b, hq, d, torch.float32)
    plain = paged_decode_attention_ref(q, *layer_views(deq), table, lens, d ** -0.5)
    assert rel_rms(paged_decode_attention_ref(q, k_cache, v_cache, table, lens, d ** -0.5, kv_scale=scale),
                   plain) < 1e-6
    with pytest.raises(ValueError, match="kv_scale"):
        paged_decode_attention_triton(q, k_cache, v_cache, table, lens, d ** -0.5)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode_attention_triton(q[..., :16], k_cache, v_cache, table, lens, d ** -0.5, kv_scale=scale)
