"""QSA's block scores over the paged cache and the fixed-shape decode selection (`ft.kernels.qsa`):
each Triton kernel against its reference under the interpreter (scores: fp32 and fp16 keys; the
selection: distinct scores, ties, short sequences, several passes), and the two references together
against the sequence-level reference (`compress_keys`, the norm, the rotation, `select_tokens`) on
raw keys written into shuffled pages: the same tokens, ties included (an indexer query of zeros
scores every block 0: the lowest blocks win)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.norm.reference import rms_norm_ref
from ft.kernels.qsa import block_scores_ref, select_decode_tokens_ref
from ft.kernels.qsa import kernel as details
from ft.model.layers.qsa import compress_keys, select_tokens

PAGE, RATIO, HI, DI, ROT = 8, 4, 2, 24, 8
LENGTHS = [41, 3, 17, 64]


def paged_keys(dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    pages_each = [-(-n // PAGE) for n in LENGTHS]
    order = torch.randperm(sum(pages_each) + 2, generator=g)
    cache = torch.zeros(len(order), PAGE, DI, dtype=dtype)
    table = torch.zeros(len(LENGTHS), max(pages_each), dtype=torch.int64)
    raw, used = [], 0
    for b, n in enumerate(LENGTHS):
        table[b, : pages_each[b]] = order[used: used + pages_each[b]]
        used += pages_each[b]
        keys = torch.randn(n, DI, generator=g).to(dtype)
        pos = torch.arange(n)
        cache[table[b][pos // PAGE], pos % PAGE] = keys
        raw.append(keys)
    return cache, table, raw, g


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    half = inv_freq.shape[0]
    ang = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = ang.cos() * scale, ang.sin() * scale
    x1, x2 = x[..., :half], x[..., half: 2 * half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernel_equals_the_reference(dtype):
    cache, table, _, g = paged_keys(dtype, 1)
    q = torch.randn(len(LENGTHS), HI, DI, generator=g)
    w, inv = torch.randn(DI, generator=g) * 0.1, 1.0 / 100.0 ** (torch.arange(0, ROT, 2).float() / ROT)
    lens = torch.tensor(LENGTHS)
    want = block_scores_ref(q, cache, table, lens, w, 1e-6, inv, 1.1, RATIO, 20)
    got = details.block_scores_triton(q, cache, table, lens, w, 1e-6, inv, 1.1, RATIO, 20)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)


def test_a_sequence_inside_the_budget_is_not_scored():
    """`dense_blocks` (the decode path passes its budget): a sequence with at most that many complete blocks
    scores each 0 without reading its keys, in the kernel as in the reference, and the selection takes the
    same tokens as from its real scores (all its blocks); longer sequences keep their scores."""
    cache, table, _, g = paged_keys(torch.float32, 3)
    q = torch.randn(len(LENGTHS), HI, DI, generator=g)
    w, inv = torch.randn(DI, generator=g) * 0.1, 1.0 / 100.0 ** (torch.arange(0, ROT, 2).float() / ROT)
    lens, budget = torch.tensor(LENGTHS), 4  # 41 and 64 tokens: 10 and 16 blocks; 3 and 17: 0 and 4
    full = block_scores_ref(q, cache, table, lens, w, 1e-6, inv, 1.1, RATIO, 20)
    want = block_scores_ref(q, cache, table, lens, w, 1e-6, inv, 1.1, RATIO, 20, dense_blocks=budget)
    got = details.block_scores_triton(q, cache, table, lens, w, 1e-6, inv, 1.1, RATIO, 20, dense_blocks=budget)
    assert torch.equal(torch.isinf(got), torch.isinf(full)) and torch.equal(torch.isinf(want), torch.isinf(full))
    assert not got[2][torch.isfinite(got[2])].any() and not want[2][torch.isfinite(want[2])].any()
    for b in (0, 3):
        assert torch.equal(want[b], full[b])
        fin = torch.isfinite(full[b])
        torch.testing.assert_close(got[b][fin], full[b][fin], rtol=1e-5, atol=1e-5)
    assert torch.equal(details.select_decode_tokens_triton(got, lens, budget, RATIO),
                       select_decode_tokens_ref(full, lens, budget, RATIO))


@pytest.mark.parametrize("zeros", [False, True], ids=["random", "all-tied"])
def test_decode_selection_equals_select_tokens(zeros):
    """block scores + select_decode_tokens = the sequence-level path (the engine's prefill and the
    reference forward) for each sequence's last position; budgets of 3 blocks (chosen) and of more
    blocks than a short sequence has (all of them)."""
    cache, table, raw, g = paged_keys(torch.float32, 2)
    q = torch.zeros(len(LENGTHS), HI, DI) if zeros else torch.randn(len(LENGTHS), HI, DI, generator=g)
    w, inv = torch.randn(DI, generator=g) * 0.1, 1.0 / 100.0 ** (torch.arange(0, ROT, 2).float() / ROT)
    lens = torch.tensor(LENGTHS)
    scores = block_scores_ref(q, cache, table, lens, w, 1e-6, inv, 1.0, RATIO, 16)
    got = select_decode_tokens_ref(scores, lens, 3, RATIO)
    assert torch.equal(details.select_decode_tokens_triton(scores, lens, 3, RATIO), got)
    for b, n in enumerate(LENGTHS):
        blocks = rotate(rms_norm_ref(compress_keys(raw[b], RATIO), w, 1e-6), torch.arange(n // RATIO) * RATIO, inv, 1.0)
        want = select_tokens(q[b: b + 1], blocks, torch.tensor([n - 1]), 3, RATIO)
        # the same tokens (the decode path lists its blocks in order, select_tokens best first), the same tail
        assert sorted(got[b, :12].tolist()) == sorted(want[0, :12].tolist()), b
        assert torch.equal(got[b, 12:], want[0, 12:]), b
    if zeros:  # every block ties at 0: the three lowest
        assert got[0, :12].tolist() == list(range(12))


@pytest.mark.parametrize("case", ["distinct", "ties", "few-blocks", "tiles"])
def test_selection_kernel_equals_the_reference(case):
    """`_select_kernel` against `select_decode_tokens_ref`, entry for entry: random scores, scores drawn
    from three values (ties at the threshold: the lower blocks win), sequences with fewer complete
    blocks than the budget (every block, then -1), and more blocks than one pass reads (2,500 > 1,024)."""
    g = torch.Generator().manual_seed(7)
    lengths = {"distinct": [41, 3, 17, 64, 4, 7], "ties": [41, 64, 60, 33], "few-blocks": [1, 2, 5, 11, 13],
               "tiles": [10_000, 4_101, 9_999]}[case]
    budget, j = (40, 2_560) if case == "tiles" else (5, 20)
    lens = torch.tensor(lengths)
    scores = torch.rand(len(lengths), j, generator=g)
    if case == "ties":
        scores = torch.tensor([0.0, 0.5, 1.0])[torch.randint(0, 3, scores.shape, generator=g)]
    scores = scores.masked_fill(torch.arange(j)[None, :] >= (lens // RATIO)[:, None], float("-inf"))
    want = select_decode_tokens_ref(scores, lens, budget, RATIO)
    assert torch.equal(details.select_decode_tokens_triton(scores, lens, budget, RATIO), want)
