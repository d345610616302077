"""The whole-K tiles' fp16 block sums (`Nvfp4Options.half_sums`, variant "nvfp4-half-sums"): the Triton
stand-in of `pair_half_sum` against fp16 sums taken in torch in the same order, bit for bit; the M = 1
GEMV and the decode MoE with the variant against the references; fp32 models keep the fp32 sums, bit for
bit; an x row past `HALF_SUM_LIMIT` is scaled, not overflowed. Interpreter on the CPU (tests/gpu: the PTX)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels modules below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.moe import moe_decode_ref  # noqa: E402
from ft.kernels.moe.decode_kernel import moe_decode_triton  # noqa: E402
from ft.kernels.nvfp4 import nvfp4_linear_ref  # noqa: E402
from ft.kernels.nvfp4.decode import HALF_SUM_LIMIT  # noqa: E402
from ft.kernels.nvfp4.kernel import nvfp4_linear_triton  # noqa: E402
from ft.kernels.options import use_kernel_options, variant  # noqa: E402
from ft.tools.nvfp4_quantize import quantize_nvfp4  # noqa: E402
from triton_flags import spy_launches  # noqa: E402

HALF = variant("nvfp4-half-sums")


def test_pair_half_sum_stand_in_is_fp16_sums_in_order():
    from half_sum_probe import half_sums_in_torch, run_probe

    gen = torch.Generator().manual_seed(3)
    n = 64
    words = torch.randint(-2**31, 2**31, (2 * n,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = (torch.randn(16 * n, generator=gen) * torch.logspace(-3, 3, 16 * n)).half()
    assert torch.equal(run_probe(words, x, asm=False), half_sums_in_torch(words, x))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("k", [128, 320], ids=["one-tile", "two-tiles"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gemv_half_sums_match_ref(monkeypatch, k, dtype):
    import ft.kernels.nvfp4.kernel as details

    launches = spy_launches(monkeypatch, details, "_nvfp4_gemv_kernel")
    gen = torch.Generator().manual_seed(k)
    packed, scale, scale_2 = quantize_nvfp4(torch.randn(24, k, generator=gen) * 3)
    x = torch.randn(1, k, generator=gen).to(dtype)
    with use_kernel_options(HALF):
        y = nvfp4_linear_triton(x, packed, scale, scale_2, path="gemv")
    assert launches[-1]["HALF"] is True
    # fp16 sums of 16 exact products: within fp16's rounding of the block sums (~2**-11), under bf16's
    assert _rel(y, nvfp4_linear_ref(x, packed, scale, scale_2)) < {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


def test_gemv_half_sums_leave_fp32_as_it_was_and_scale_a_large_x():
    """An fp32 x never takes the fp16 sums (the default's bits); a bf16 row with elements past fp16's range
    (the limit, 10**5 and 10**7) is scaled by a power of two and back: finite, as close to the reference as
    a plain row."""
    gen = torch.Generator().manual_seed(5)
    packed, scale, scale_2 = quantize_nvfp4(torch.randn(16, 128, generator=gen))
    x32 = torch.randn(1, 128, generator=gen)
    base = nvfp4_linear_triton(x32, packed, scale, scale_2, path="gemv")
    with use_kernel_options(HALF):
        assert torch.equal(nvfp4_linear_triton(x32, packed, scale, scale_2, path="gemv"), base)
        for big in (HALF_SUM_LIMIT, 1e5, 1e7):
            x = x32.bfloat16()
            x[0, 7], x[0, 70] = big, -big / 3
            y = nvfp4_linear_triton(x, packed, scale, scale_2, path="gemv")
            assert y.isfinite().all() and _rel(y, nvfp4_linear_ref(x, packed, scale, scale_2)) < 1e-2, big


def test_moe_decode_half_sums_match_ref(monkeypatch):
    """Two tokens, two routed experts and the shared one; H = 80 (two whole-K tiles, as 2,560), I = 48; bf16,
    the per-pair down pass (the per-token loop's whole-K tiles take the same `rows_dot_whole_k`: the GEMV's
    tests cover it)."""
    dtype, per_pair = torch.bfloat16, True
    import ft.kernels.moe.decode_kernel as details
    from test_kernels_moe_triton import _routing, _slot_pool

    gate_up = spy_launches(monkeypatch, details, "_moe_decode_gate_up_kernel")
    gen = torch.Generator().manual_seed(7)
    w, shared = _slot_pool(4, 80, 48, gen), _slot_pool(1, 80, 48, gen)
    slots, weights = _routing(2, 2, 4, 0.0, gen)
    weights = torch.cat([weights, torch.rand(2, 1, generator=gen)], dim=1).to(dtype)
    x = torch.randn(2, 80, generator=gen).to(dtype)
    with use_kernel_options(HALF):
        y = moe_decode_triton(x, slots, weights, w, shared, down_per_pair=per_pair)
    assert gate_up[-1]["HALF"] is True
    ref = moe_decode_ref(x, slots, weights, w, shared)
    assert _rel(y, ref) < {torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]


def test_the_defaults_sum_in_fp16_in_the_decode_moe_from_two_tokens_only(monkeypatch):
    """Which launches take the fp16 sums by default (session 44's measurements): the decode MoE from two
    tokens (`half_sums`), not at one (`half_sums_one_token`) nor in the M = 1 GEMV (`half_sums_gemv`); each
    variant turns its own part on or off."""
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

    def gemv_half() -> bool:
        nvfp4_linear_triton(torch.randn(1, 256, generator=gen).bfloat16(), packed, scale, scale_2, path="gemv")
        return gemv[-1]["HALF"]

    assert (moe_half(2), moe_half(1), gemv_half()) == (True, False, False)
    with use_kernel_options(variant("nvfp4-half-sums-one-token", "nvfp4-half-sums-gemv")):
        assert (moe_half(1), gemv_half()) == (True, True)
    with use_kernel_options(variant("nvfp4-no-half-sums")):
        assert moe_half(2) is False
