"""The SiLU gate and the routed + shared expert combine: Triton (interpreter) against the torch
references, which are the model's own ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ft.kernels.activation import expert_combine_ref, silu_mul_ref
from ft.kernels.activation.kernel import expert_combine_triton, silu_mul_triton

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}  # NOTE: no bf16 in the interpreter
TOL = {torch.float32: 1e-6, torch.float16: 2e-3}
SHAPES = [(1, 48), (3, 1000), (2, 2048)]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype)


def test_references_are_the_model_ops():
    g, u = randn(4, 96, dtype=torch.bfloat16, seed=1), randn(4, 96, dtype=torch.bfloat16, seed=2)
    assert torch.equal(silu_mul_ref(g, u), F.silu(g) * u)
    r, s, gl = g, u, randn(4, 1, dtype=torch.bfloat16, seed=3)
    assert torch.equal(expert_combine_ref(r, s, gl), r + s * torch.sigmoid(gl))


@pytest.mark.parametrize("t,n", SHAPES, ids=[f"T{t}-N{n}" for t, n in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_silu_mul(t, n, dtype):
    gu = randn(t, 2 * n, dtype=dtype, seed=t * n)  # strided halves, as an MLP's fused gate/up would be
    gate, up = gu[:, :n], gu[:, n:]
    out = torch.full((t, n), float("nan"), dtype=dtype)
    silu_mul_triton(gate, up, out=out)
    assert not out.isnan().any()
    assert rel_rms(out, silu_mul_ref(gate, up)) < TOL[dtype]


@pytest.mark.parametrize("t,n", SHAPES, ids=[f"T{t}-N{n}" for t, n in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_expert_combine(t, n, dtype):
    routed, shared = randn(t, n, dtype=dtype, seed=1), randn(t, n, dtype=dtype, seed=2)
    gate_logit = randn(t, 1, dtype=dtype, seed=3)
    out = torch.full((t, n), float("nan"), dtype=dtype)
    expert_combine_triton(routed, shared, gate_logit, out=out)
    assert not out.isnan().any()
    assert rel_rms(out, expert_combine_ref(routed, shared, gate_logit)) < TOL[dtype]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="gate_logit"):
        expert_combine_triton(torch.ones(2, 8), torch.ones(2, 8), torch.ones(2, 8))
    with pytest.raises(ValueError, match="unit column stride"):
        silu_mul_triton(torch.ones(8, 2).T, torch.ones(2, 8))


def test_a_wrong_out_or_mismatched_operand_is_refused_before_any_launch():
    gate, up = torch.zeros(4, 32), torch.zeros(4, 32)
    for bad in (torch.zeros(4, 16), torch.zeros(4, 32, dtype=torch.float16), torch.zeros(32, 4).t()):
        with pytest.raises(ValueError, match="out must be"):
            silu_mul_triton(gate, up, out=bad)
        with pytest.raises(ValueError, match="out must be"):
            expert_combine_triton(gate, up, torch.zeros(4, 1), out=bad)
    with pytest.raises(ValueError, match="one shape"):
        silu_mul_triton(gate, torch.zeros(4, 16))
    with pytest.raises(ValueError, match="one shape"):
        expert_combine_triton(gate, torch.zeros(3, 32), torch.zeros(4, 1))
    out = torch.empty(4, 32)
    assert silu_mul_triton(gate, up, out=out) is out
