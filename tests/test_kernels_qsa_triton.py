"""QSA's block scores over the paged cache (`ft.kernels.qsa`) and the fixed-shape decode selection
(`select_decode_tokens`): the Triton kernel against `block_scores_ref` under the interpreter (fp32,
fp16 keys), and the two together against the sequence-level reference (`compress_keys`, the norm, the
rotation, `select_tokens`) on raw keys written into shuffled pages: equal token lists, ties included
(an indexer query of zeros scores every block 0: the lowest blocks win)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.norm.reference import rms_norm_ref
from ft.kernels.qsa import block_scores_ref
from ft.kernels.qsa import kernel as details
from ft.model.layers.qsa import compress_keys, select_decode_tokens, select_tokens

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
    got = select_decode_tokens(scores, lens, 3, RATIO)
    for b, n in enumerate(LENGTHS):
        blocks = rotate(rms_norm_ref(compress_keys(raw[b], RATIO), w, 1e-6), torch.arange(n // RATIO) * RATIO, inv, 1.0)
        want = select_tokens(q[b: b + 1], blocks, torch.tensor([n - 1]), 3, RATIO)
        assert torch.equal(got[b: b + 1], want), b
    if zeros:  # every block ties at 0: the three lowest
        assert got[0, :12].tolist() == list(range(12))
