"""The SiLU gate and the expert combine on CUDA at flagship shapes (bf16) against the references,
and the dispatchers take the kernels."""

from __future__ import annotations

import pytest
import torch

from ft.kernels.activation import expert_combine, expert_combine_ref, silu_mul, silu_mul_ref

pytestmark = pytest.mark.gpu

TOL = 4e-3  # one bf16 rounding of an exp-based activation taken the other way, at most


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("t", [1, 8, 1024], ids=lambda t: f"T{t}")
def test_activation_kernels_match_references(t):
    g = torch.Generator(device="cuda").manual_seed(t)
    gate, up = (torch.randn(t, 512, device="cuda", generator=g) * 3).bfloat16(), torch.randn(
        t, 512, device="cuda", generator=g).bfloat16()
    assert rel_rms(silu_mul(gate, up), silu_mul_ref(gate, up)) < TOL
    routed, shared = torch.randn(t, 2048, device="cuda", generator=g).bfloat16(), torch.randn(
        t, 2048, device="cuda", generator=g).bfloat16()
    gl = (torch.randn(t, 1, device="cuda", generator=g) * 3).bfloat16()
    assert rel_rms(expert_combine(routed, shared, gl), expert_combine_ref(routed, shared, gl)) < TOL
