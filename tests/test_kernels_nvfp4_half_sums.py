"""The decode MoE's fp16 block sums (`Nvfp4Options.half_sums`, on by default): the Triton
stand-in of `pair_half_sum` against fp16 sums taken in torch in the same order, bit for bit; the decode MoE
against the reference on one and two whole-K tiles; fp32 models keep the fp32 sums, bit for bit; an x row
past `HALF_SUM_LIMIT` is scaled, not overflowed; which launches take them by default. Interpreter on the CPU
(tests/gpu: the PTX)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels modules below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.moe import moe_decode_ref  # noqa: E402
from ft.kernels.moe.decode_kernel import moe_decode_triton  # noqa: E402
from ft.kernels.nvfp4.decode import HALF_SUM_LIMIT  # noqa: E402
from ft.kernels.nvfp4.kernel import nvfp4_linear_triton  # noqa: E402
from ft.kernels.options import use_kernel_options, variant  # noqa: E402
from ft.tools.nvfp4_quantize import quantize_nvfp4  # noqa: E402
from triton_flags import spy_launches  # noqa: E402

HALF = variant(**{"nvfp4.half_sums": True})  # (the default, named: the tests hold whatever the default)


def test_pair_half_sum_stand_in_is_fp16_sums_in_order():
    from half_sum_probe import half_sums_in_torch, run_probe

    gen = torch.Generator().manual_seed(3)
    n = 64
    words = torch.randint(-2**31, 2**31, (2 * n,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = (torch.randn(16 * n, generator=gen) * torch.logspace(-3, 3, 16 * n)).half()
    assert torch.equal(run_probe(words, x, asm=False), half_sums_in_torch(words, x))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _moe_case(hidden: int, tokens: int, seed: int):
    """Four routed experts of width 48 and a shared one over `hidden`, two routed pairs a token and the
    shared expert's weight last: (x's shape, slots, weights, pool, shared)."""
    from test_kernels_moe_triton import _routing, _slot_pool

    gen = torch.Generator().manual_seed(seed)
    w, shared = _slot_pool(4, hidden, 48, gen), _slot_pool(1, hidden, 48, gen)
    slots, weights = _routing(tokens, 2, 4, 0.0, gen)
    weights = torch.cat([weights, torch.rand(tokens, 1, generator=gen)], dim=1)
    return torch.randn(tokens, hidden, generator=gen), slots, weights, w, shared


@pytest.mark.parametrize("hidden", [64, 80], ids=["one-tile", "two-tiles"])
def test_moe_decode_half_sums_match_ref(monkeypatch, hidden):
    """Two tokens, two routed experts and the shared one; H = 64 (one whole-K tile) or 80 (two, as 2,560),
    I = 48; bf16, the per-pair down pass (the per-token loop's whole-K tiles take the same `rows_dot_whole_k`)."""
    import ft.kernels.moe.decode_kernel as details

    gate_up = spy_launches(monkeypatch, details, "_moe_decode_gate_up_kernel")
    x, slots, weights, w, shared = _moe_case(hidden, 2, 7)
    x, weights = x.bfloat16(), weights.bfloat16()
    with use_kernel_options(HALF):
        y = moe_decode_triton(x, slots, weights, w, shared, down_per_pair=True)
    assert gate_up[-1]["HALF"] is True
    assert _rel(y, moe_decode_ref(x, slots, weights, w, shared)) < 2e-2


def test_moe_half_sums_leave_fp32_as_it_was_and_scale_a_large_x():
    """An fp32 x never takes the fp16 sums (the no-half-sums bits); a bf16 row with elements past fp16's range
    (the limit, 10**5 and 10**7) is scaled by a power of two and back: finite, as close to the reference as
    a plain row."""
    x32, slots, weights, w, shared = _moe_case(80, 2, 5)
    with use_kernel_options(variant("nvfp4-no-half-sums")):
        base = moe_decode_triton(x32, slots, weights, w, shared)
    with use_kernel_options(HALF):
        assert torch.equal(moe_decode_triton(x32, slots, weights, w, shared), base)
        for big in (HALF_SUM_LIMIT, 1e5, 1e7):
            x = x32.bfloat16()
            x[0, 7], x[1, 70] = big, -big / 3
            y = moe_decode_triton(x, slots, weights.bfloat16(), w, shared)
            ref = moe_decode_ref(x, slots, weights.bfloat16(), w, shared)
            assert y.isfinite().all() and _rel(y, ref) < 2e-2, big


def test_the_defaults_sum_in_fp16_in_the_decode_moe_from_two_tokens_only(monkeypatch):
    """Which launches take the fp16 sums by default (sessions 44 and 46's measurements): the decode MoE from
    two tokens, not at one; the M = 1 GEMV has none; "nvfp4-no-half-sums" turns them off."""
    import ft.kernels.moe.decode_kernel as details
    import ft.kernels.nvfp4.kernel as nv
    from test_kernels_moe_triton import _routing, _slot_pool

    gate_up = spy_launches(monkeypatch, details, "_moe_decode_gate_up_kernel")
    gemv = spy_launches(monkeypatch, nv, "_nvfp4_gemv_kernel")
    gen = torch.Generator().manual_seed(9)
    w = _slot_pool(4, 80, 48, gen)
    packed, scale, scale_2 = quantize_nvfp4(torch.randn(16, 256, generator=gen))

    def moe_half(tokens: int) -> bool:
        slots, weights = _routing(tokens, 2, 4, 0.0, gen)
        moe_decode_triton(torch.randn(tokens, 80, generator=gen).bfloat16(), slots, weights.bfloat16(), w)
        return gate_up[-1]["HALF"]

    assert (moe_half(2), moe_half(1)) == (True, False)
    nvfp4_linear_triton(torch.randn(1, 256, generator=gen).bfloat16(), packed, scale, scale_2, path="gemv")
    assert "HALF" not in gemv[-1]
    with use_kernel_options(variant("nvfp4-no-half-sums")):
        assert moe_half(2) is False
