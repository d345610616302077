"""The grouped (prefill) MoE with its MMAs in fp16 for a bf16 model (`MoeOptions.grouped_f16`, variant
"moe-grouped-f16"): x converted once a pass and h stored in fp16, both saturated at fp16's largest. Against
the torch reference (bf16 x: in the interpreter only the fp16 MMAs this option runs are right, so the bf16
path is not the yardstick here); a bf16 x past fp16's range gives finite sums; the option's workspace counts
the converted x. Interpreter on the CPU (tests/gpu: at the model's shapes)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels modules below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.moe import moe_over_slots_ref  # noqa: E402
from ft.kernels.moe.kernel import moe_over_slots_triton  # noqa: E402
from ft.kernels.moe.slots import moe_workspace_bytes  # noqa: E402
from ft.kernels.options import use_kernel_options, variant  # noqa: E402
from triton_flags import spy_launches  # noqa: E402

F16 = variant("moe-grouped-f16")


def _case(tokens: int, seed: int, skip: float = 0.0):
    from test_kernels_moe_triton import _routing, _slot_pool

    gen = torch.Generator().manual_seed(seed)
    w = _slot_pool(4, 64, 32, gen)
    slots, weights = _routing(tokens, 2, 4, skip, gen)
    return torch.randn(tokens, 64, generator=gen).bfloat16(), slots, weights.bfloat16(), w


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("swap", [False, True], ids=["plain", "swapped"])
def test_fp16_mmas_match_the_reference(monkeypatch, swap):
    import ft.kernels.moe.grouped_kernel as details

    gate_up = spy_launches(monkeypatch, details, "_grouped_gate_up_kernel")
    x, slots, weights, w = _case(12, 3, 0.1)
    cfg = (4, 16, 32, 4, 1, swap)
    with use_kernel_options(F16):
        y = moe_over_slots_triton(x, slots, weights, w, grouped=True, grouped_config=cfg)
    assert gate_up[-1]["_args"][0].dtype == torch.float16 and y.dtype == torch.bfloat16
    assert _rel(y, moe_over_slots_ref(x, slots, weights, w)) < 2e-2


def test_a_bf16_x_past_fp16s_range_saturates():
    """Elements past 65,504 (bf16 holds them) saturate instead of turning into inf: the sums stay finite."""
    x, slots, weights, w = _case(8, 5)
    x[2, 3], x[5, 10] = 1e6, -3e5
    with use_kernel_options(F16):
        y = moe_over_slots_triton(x, slots, weights, w, grouped=True, grouped_config=(4, 16, 32, 4, 1))
    assert y.isfinite().all()
    clipped = x.float().clamp(-65504, 65504).bfloat16()
    assert _rel(y[[0, 1, 3, 4, 6, 7]], moe_over_slots_ref(clipped, slots, weights, w)[[0, 1, 3, 4, 6, 7]]) < 2e-2


def test_the_workspace_counts_the_converted_x():
    base = moe_workspace_bytes(4096, 10, 2048, 512)
    with use_kernel_options(F16):
        assert moe_workspace_bytes(4096, 10, 2048, 512) == base + 4096 * 2048 * 2
