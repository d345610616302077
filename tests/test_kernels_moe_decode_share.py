"""The decode MoE's gate/up pass with experts shared by two tokens (`MoeOptions.decode_share_min_tokens`,
variant "moe-decode-share-experts"): two pairs that read the same expert in one program of the gate/up and
of the per-pair down pass, the tile decoded once (`rows.dot_words_half2`, `decode.pair_half_sum2`). Every row of the block's output has the bits of the
program-per-pair form: runs of 1-4 pairs on one slot, the shared expert (a run of every token), skipped
pairs (slot -1), padding tokens, one and two whole-K tiles, bf16 and fp16 x (the fp16 block sums, which
sharing needs: an fp32 model keeps a program a pair). Interpreter on the CPU (tests/gpu: the PTX, which
keeps the same bits)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels modules below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.moe import moe_decode_ref  # noqa: E402
from ft.kernels.moe.decode_tiles import sum_counters_needed  # noqa: E402
from ft.kernels.moe.decode_kernel import moe_decode_triton  # noqa: E402
from ft.kernels.options import use_kernel_options, variant  # noqa: E402
from triton_flags import spy_launches  # noqa: E402

SHARE = variant(**{"moe.decode_share_min_tokens": 2})


def _case(tokens: int, hidden: int, slots: int, seed: int, skip: float = 0.0):
    """A pool of `slots` experts (width 48) and a shared one over `hidden`; top-2 routing over so few slots
    that most experts are read by several tokens; the shared expert's weight last."""
    from test_kernels_moe_triton import _routing, _slot_pool

    gen = torch.Generator().manual_seed(seed)
    w, shared = _slot_pool(slots, hidden, 48, gen), _slot_pool(1, hidden, 48, gen)
    table, weights = _routing(tokens, 2, slots, skip, gen)
    weights = torch.cat([weights, torch.rand(tokens, 1, generator=gen)], dim=1)
    return torch.randn(tokens, hidden, generator=gen), table, weights, w, shared


@pytest.mark.parametrize(("tokens", "hidden", "slots", "dtype", "skip"), [
    (6, 80, 4, torch.bfloat16, 0.2), (7, 64, 2, torch.float16, 0.0)], ids=["bf16-two-tiles-skips", "fp16-one-tile-runs-of-7"])
def test_shared_experts_keep_every_rows_bits(monkeypatch, tokens, hidden, slots, dtype, skip):
    import ft.kernels.moe.decode_kernel as details

    gate_up = spy_launches(monkeypatch, details, "_moe_decode_gate_up_kernel")
    down = spy_launches(monkeypatch, details, "_moe_decode_down_pairs_kernel")
    x, table, weights, w, shared = _case(tokens, hidden, slots, 11 + tokens, skip)
    x, weights = x.to(dtype), weights.to(dtype)
    base = moe_decode_triton(x, table, weights, w, shared)
    assert gate_up[-1]["SHARE"] is False and down[-1]["SHARE"] is False
    with use_kernel_options(SHARE):
        y = moe_decode_triton(x, table, weights, w, shared)
    assert gate_up[-1]["SHARE"] is True and gate_up[-1]["BLOCK_P"] >= tokens * 3 and down[-1]["SHARE"] is True
    assert torch.equal(y, base)
    ref = moe_decode_ref(x, table, weights, w, shared)
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2


def test_the_down_pass_summing_its_pairs_counts_each_partner_once(monkeypatch):
    """With the sum in the down pass (`MoeOptions.decode_sum_in_down`, `sum_counters`), a pair's program also
    counts its partner's row on the partner token's counter: every token is summed once, with the bits of
    a program a pair, and the counters are left at zero (the next launch's and a graph replay's)."""
    import ft.kernels.moe.decode_kernel as details

    down = spy_launches(monkeypatch, details, "_moe_decode_down_pairs_kernel")
    x, table, weights, w, shared = _case(4, 80, 2, 21, 0.2)
    x, weights = x.bfloat16(), weights.bfloat16()
    counters = torch.zeros(sum_counters_needed(4, 80), dtype=torch.int32)
    base = moe_decode_triton(x, table, weights, w, shared, sum_counters=counters)
    assert down[-1]["SUM"] is True and not counters.any()
    with use_kernel_options(SHARE):
        y = moe_decode_triton(x, table, weights, w, shared, sum_counters=counters)
        assert down[-1]["SUM"] is True and down[-1]["SHARE"] is True and not counters.any()
        again = moe_decode_triton(x, table, weights, w, shared, sum_counters=counters)
    assert torch.equal(y, base) and torch.equal(again, base)


def test_padding_tokens_pair_with_nobody(monkeypatch):
    """Padding tokens (live < 0) read nothing and their rows are zeros; the live rows keep their bits, with
    live tokens that share experts with padding ones before and after them."""
    import ft.kernels.moe.decode_kernel as details

    gate_up = spy_launches(monkeypatch, details, "_moe_decode_gate_up_kernel")
    x, table, weights, w, shared = _case(6, 64, 3, 5)
    x, weights = x.bfloat16(), weights.bfloat16()
    table[4:] = table[0]  # padding rows routed like a live one, after it (a graph's padding) and before it
    table[2] = table[3]
    live = torch.tensor([0, 1, -1, 3, -1, -1])
    base = moe_decode_triton(x, table, weights, w, shared, live=live)
    with use_kernel_options(SHARE):
        y = moe_decode_triton(x, table, weights, w, shared, live=live)
    assert gate_up[-1]["SHARE"] is True
    assert torch.equal(y, base) and not y[4:].any() and not y[2].any()


def test_below_the_threshold_or_without_the_fp16_sums_each_pair_has_its_program(monkeypatch):
    import ft.kernels.moe.decode_kernel as details

    gate_up = spy_launches(monkeypatch, details, "_moe_decode_gate_up_kernel")
    x, table, weights, w, shared = _case(3, 64, 3, 9)
    x16, w16 = x.bfloat16(), weights.bfloat16()
    with use_kernel_options(variant(**{"moe.decode_share_min_tokens": 4})):
        moe_decode_triton(x16, table, w16, w, shared)  # 3 tokens < 4
        assert gate_up[-1]["SHARE"] is False
    with use_kernel_options(SHARE):
        moe_decode_triton(x, table, weights, w, shared)  # fp32: the fp32 sums
        assert gate_up[-1]["SHARE"] is False
        moe_decode_triton(x16, table, w16, w, shared)
        assert gate_up[-1]["SHARE"] is True
    with use_kernel_options(variant("nvfp4-no-half-sums", **{"moe.decode_share_min_tokens": 2})):
        moe_decode_triton(x16, table, w16, w, shared)
        assert gate_up[-1]["SHARE"] is False
