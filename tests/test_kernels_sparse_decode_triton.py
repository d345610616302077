"""QSA's sparse decode attention (`ft.kernels.attention.sparse_decode`): the Triton kernel against
`sparse_decode_attention_ref` under the interpreter (fp32 and fp16 queries; caches as stored, fp8 and
NVFP4), and the reference against the torch sparse attention of `ft.model.layers.qsa` on QSA's own
token lists. Lists with unused (-1) entries, out of order, a sequence without any position, positions
on several pages; split-K forced to 1 and left to the kernel. The output is NaN-poisoned nowhere: the
kernel allocates it; the test checks it is finite."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.attention import sparse_decode as details
from ft.kernels.attention.reference import sparse_decode_attention_ref, write_kv_ref
from ft.memory.kv_pool import NVFP4_KV, kv_row_size
from ft.model.layers.qsa import select_tokens, sparse_attention

PAGE = 8
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
CASES = [(4, 2, 32), (6, 2, 64), (2, 1, 16)]  # (Hq, Hkv, D)
KV = {"as-stored": None, "fp8": torch.float8_e4m3fn, "nvfp4": NVFP4_KV}


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt().clamp_min(1e-30))


def make_cache(hkv: int, d: int, lengths: list[int], dtype: torch.dtype, kv: torch.dtype | None, seed: int):
    """Caches holding each sequence's random K/V in shuffled pages, its page table and the (K, V) scales."""
    g = torch.Generator().manual_seed(seed)
    pages_each = [-(-n // PAGE) for n in lengths]
    order = torch.randperm(sum(pages_each) + 3, generator=g)
    cache_dtype = kv or dtype
    row = kv_row_size(d, cache_dtype)
    k_cache = torch.zeros(len(order), PAGE, hkv, row, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    scale = None if kv is None else torch.tensor([0.05, 0.04])
    table = torch.zeros(len(lengths), max(pages_each), dtype=torch.int64)
    used = 0
    for b, n in enumerate(lengths):
        table[b, : pages_each[b]] = order[used: used + pages_each[b]]
        used += pages_each[b]
        k, v = torch.randn(n, hkv, d, generator=g).to(dtype), torch.randn(n, hkv, d, generator=g).to(dtype)
        write_kv_ref(k_cache, v_cache, k, v, table[b], 0, scale)
    return k_cache, v_cache, table, scale


def three_lists(g: torch.Generator) -> torch.Tensor:
    """Lists [3, 45] over sequences of 70, 5 and 33 tokens: 40 positions out of order across pages, none,
    and every other position (holes)."""
    tokens = torch.full((3, 45), -1, dtype=torch.int64)
    tokens[0, :40] = torch.randperm(70, generator=g)[:40]
    tokens[2, 3:36:2] = torch.arange(17) * 2
    return tokens


@pytest.mark.parametrize("kv", list(KV), ids=list(KV))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("hq", "hkv", "d", "splits"), [(*c, None) for c in CASES] + [(4, 2, 32, 1)],
                         ids=[f"Hq{a}-Hkv{b}-D{c}" for a, b, c in CASES] + ["Hq4-Hkv2-D32-one-split"])
def test_kernel_equals_the_reference(hq, hkv, d, dtype, kv, splits):
    lengths = [70, 5, 33]
    k_cache, v_cache, table, scale = make_cache(hkv, d, lengths, dtype, KV[kv], seed=d + hq)
    g = torch.Generator().manual_seed(1)
    w = 45
    tokens = torch.full((len(lengths), w), -1, dtype=torch.int64)
    tokens[0, :40] = torch.randperm(70, generator=g)[:40]  # out of order, across pages
    tokens[0, 41] = 69
    tokens[2, 3:36:2] = torch.arange(17) * 2  # holes
    # sequence 1 has no position: zeros
    q = torch.randn(len(lengths), hq, d, generator=g).to(dtype)
    want = sparse_decode_attention_ref(q, k_cache, v_cache, table, tokens, d ** -0.5, scale)
    got = details.sparse_decode_attention_triton(q, k_cache, v_cache, table, tokens, d ** -0.5, scale, splits=splits)
    assert got.shape == want.shape and got.dtype == dtype and torch.isfinite(got).all()
    assert torch.equal(want[1], torch.zeros_like(want[1])) and torch.equal(got[1], torch.zeros_like(got[1]))
    for b in (0, 2):
        assert rel_rms(got[b], want[b]) < TOL[dtype], b


@pytest.mark.parametrize("kv", ["as-stored", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_the_output_gate_is_applied_by_the_combine(dtype, kv):
    """With `gate` (a strided view, as QSA passes its q projection's half) the kernels' output is
    o * sigmoid(gate) rounded once, as the reference's; the reference's gate is that product."""
    hq, hkv, d, lengths = 6, 2, 64, [70, 5, 33]
    k_cache, v_cache, table, scale = make_cache(hkv, d, lengths, dtype, KV[kv], seed=11)
    g = torch.Generator().manual_seed(2)
    tokens = three_lists(g)
    q_and_gate = torch.randn(3, hq, 2 * d, generator=g).to(dtype)
    q, gate = q_and_gate.chunk(2, dim=-1)  # views: gate's rows stride 2D
    q = q.contiguous()
    want = sparse_decode_attention_ref(q, k_cache, v_cache, table, tokens, d ** -0.5, scale, gate=gate)
    plain = sparse_decode_attention_ref(q, k_cache, v_cache, table, tokens, d ** -0.5, scale)
    assert rel_rms(want, (plain.float() * torch.sigmoid(gate.float())).to(dtype)) < TOL[dtype]
    assert not torch.allclose(want.float(), plain.float())
    for splits in (None, 1, 3):
        got = details.sparse_decode_attention_triton(q, k_cache, v_cache, table, tokens, d ** -0.5, scale,
                                                     splits=splits, gate=gate)
        assert torch.equal(got[1], torch.zeros_like(got[1]))  # no position: zeros, gated too
        for b in (0, 2):
            assert rel_rms(got[b], want[b]) < TOL[dtype], (b, splits)


def test_no_list_gives_zeros():
    k_cache, v_cache, table, _ = make_cache(2, 16, [9], torch.float32, None, seed=3)
    q = torch.randn(1, 4, 16)
    got = details.sparse_decode_attention_triton(q, k_cache, v_cache, table, torch.zeros(1, 0, dtype=torch.int64),
                                                 0.25, gate=torch.randn(1, 4, 16))
    assert torch.equal(got, torch.zeros_like(got))


def test_the_reference_is_qsa_attention_on_qsa_lists():
    """On the lists QSA's selection makes (`select_tokens`), the reference over the paged cache gives what
    `sparse_attention` gives over the sequence's whole K and V."""
    hq, hkv, d, n = 4, 2, 16, 53
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    k_cache = torch.zeros(8, PAGE, hkv, d)
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(8, generator=g)[None, :]
    write_kv_ref(k_cache, v_cache, k, v, table[0], 0)
    index_q, keys = torch.randn(1, 2, 8, generator=g), torch.randn(n // 4, 8, generator=g)
    tokens = select_tokens(index_q, keys, torch.tensor([n - 1]), budget_blocks=5, ratio=4)
    assert (tokens >= 0).sum() == 5 * 4 + 1  # 5 blocks of 4, and position 52, which starts a block of its own
    q = torch.randn(1, hq, d, generator=g)
    want = sparse_attention(q, k, v, tokens, d ** -0.5)
    got = sparse_decode_attention_ref(q, k_cache, v_cache, table, tokens, d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fewer = tokens.clone()
    fewer[0, 0] = -1  # one selected token less: another result (the lists matter)
    assert not torch.allclose(sparse_decode_attention_ref(q, k_cache, v_cache, table, fewer, d ** -0.5), want)


@pytest.mark.parametrize("kv", list(KV), ids=list(KV))
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_one_split_writes_the_combines_bits(dtype, gated, kv):
    """At one split (a prefill's rows) the kernel writes the output itself (`QsaOptions.one_pass`): the same
    bits as its partials through the combine kernel (variant "qsa-sparse-combine"), gate or none, and a row
    without any position stays zeros."""
    from ft.kernels.options import use_kernel_options, variant

    hq, hkv, d, lengths = 6, 2, 64, [70, 5, 33]
    k_cache, v_cache, table, scale = make_cache(hkv, d, lengths, dtype, KV[kv], seed=21)
    g = torch.Generator().manual_seed(4)
    tokens = three_lists(g)
    q = torch.randn(3, hq, d, generator=g).to(dtype)
    gate = torch.randn(3, hq, 2 * d, generator=g).to(dtype)[..., d:] if gated else None
    got = details.sparse_decode_attention_triton(q, k_cache, v_cache, table, tokens, d ** -0.5, scale, splits=1,
                                                 gate=gate)
    with use_kernel_options(variant("qsa-sparse-combine")):
        two = details.sparse_decode_attention_triton(q, k_cache, v_cache, table, tokens, d ** -0.5, scale, splits=1,
                                                     gate=gate)
    assert torch.equal(got, two)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    want = sparse_decode_attention_ref(q, k_cache, v_cache, table, tokens, d ** -0.5, scale, gate=gate)
    for b in (0, 2):
        assert rel_rms(got[b], want[b]) < TOL[dtype], b


@pytest.mark.parametrize("tile", [(16, 2, 2), (64, 4, 3)], ids=["N16", "N64"])
def test_one_split_tile_gives_the_reference(tile):
    """`QsaOptions.one_split_tile`'s positions a tile change the loop, never the result: a list longer than
    one tile, one tile and a half, and none."""
    from ft.kernels.options import use_kernel_options, variant

    hq, hkv, d, lengths = 4, 2, 32, [150, 5, 40]
    k_cache, v_cache, table, _ = make_cache(hkv, d, lengths, torch.float32, None, seed=5)
    g = torch.Generator().manual_seed(6)
    tokens = torch.full((3, 100), -1, dtype=torch.int64)
    tokens[0, :97] = torch.randperm(150, generator=g)[:97]
    tokens[2, :40] = torch.arange(40)
    q = torch.randn(3, hq, d, generator=g)
    want = sparse_decode_attention_ref(q, k_cache, v_cache, table, tokens, d ** -0.5)
    with use_kernel_options(variant(**{"qsa.one_split_tile": tile})):
        got = details.sparse_decode_attention_triton(q, k_cache, v_cache, table, tokens, d ** -0.5, splits=1)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    for b in (0, 2):
        assert rel_rms(got[b], want[b]) < TOL[torch.float32], b


@pytest.mark.parametrize("kv", ["as-stored", "fp8", "nvfp4"])
def test_a_quantized_cache_takes_its_own_one_split_tile(kv):
    """At one split an fp8 or NVFP4 cache takes `QsaOptions.one_split_tile_quantized`, a cache as stored
    `one_split_tile`: each kind still gives the reference with its own tile while the other's is (16, 2, 2)."""
    from ft.kernels.options import use_kernel_options, variant

    hq, hkv, d, lengths = 4, 2, 32, [150, 40]
    k_cache, v_cache, table, scale = make_cache(hkv, d, lengths, torch.float32, KV[kv], seed=7)
    g = torch.Generator().manual_seed(8)
    tokens = torch.full((2, 100), -1, dtype=torch.int64)
    tokens[0, :97] = torch.randperm(150, generator=g)[:97]
    tokens[1, :40] = torch.arange(40)
    q = torch.randn(2, hq, d, generator=g)
    want = sparse_decode_attention_ref(q, k_cache, v_cache, table, tokens, d ** -0.5, scale)
    own, other = ("qsa.one_split_tile", "qsa.one_split_tile_quantized") if kv == "as-stored" else \
        ("qsa.one_split_tile_quantized", "qsa.one_split_tile")
    with use_kernel_options(variant(**{own: (64, 4, 3), other: (16, 2, 2)})):
        launched = []
        real = details._sparse_decode_kernel
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(details, "_sparse_decode_kernel", _Spy(real, launched))
            got = details.sparse_decode_attention_triton(q, k_cache, v_cache, table, tokens, d ** -0.5, scale, splits=1)
    assert launched == [64]
    for b in (0, 1):
        assert rel_rms(got[b], want[b]) < TOL[torch.float32], b


class _Spy:
    """`kernel[grid](...)` as the kernel, noting each launch's BLOCK_N."""

    def __init__(self, kernel, launched: list):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append(kwargs["BLOCK_N"])
            return self.kernel[grid](*args, **kwargs)
        return launch
