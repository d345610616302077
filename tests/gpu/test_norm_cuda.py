"""The norm and rotary Triton kernels compiled for the GPU, at the flagship's shapes (Qwen3-Next-80B-A3B:
hidden 2048; Gated DeltaNet 32 value heads of 128; attention q 16 x 256, k 2 x 256, rotary 64), in bf16,
against their torch references on the GPU by relative RMS; in place equal to out of place, bitwise."""

from __future__ import annotations

import pytest
import torch

from ft.kernels.norm import add_rms_norm, gated_rms_norm, qk_norm_rope, rms_norm
from ft.kernels.norm import kernel as details
from ft.kernels.norm.reference import (
    add_rms_norm_ref,
    gated_rms_norm_ref,
    qk_norm_rope_ref,
    rms_norm_ref,
    rotary_inv_freq_ref,
)

pytestmark = pytest.mark.gpu

TOL_BF16 = 4e-3
"""Relative RMS, below one bf16 rounding step (2**-8): the kernels round where the references do, so
results differ only where an fp32 intermediate (sum order, rsqrt, cos) rounds to bf16 the other way."""
T_CASES = (1, 8, 1024)
HIDDEN, HV, DV, HQ, HK, HEAD_DIM, ROTARY_DIM, THETA, EPS = 2048, 32, 128, 16, 2, 256, 64, 10_000_000.0, 1e-6
DEV = "cuda"
BF16 = torch.bfloat16


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS difference; NaN anywhere in `out` (e.g. an unwritten poisoned output) gives nan."""
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) * scale).to(BF16)


@pytest.mark.parametrize("t", T_CASES, ids=[f"T{t}-D{HIDDEN}-bf16" for t in T_CASES])
def test_rms_norm_and_add(t):
    torch.manual_seed(t)
    x, res, w = randn(t, HIDDEN, scale=3.0), randn(t, HIDDEN), randn(HIDDEN, scale=0.1)
    y = details.rms_norm_triton(x, w, EPS, out=nan_like(x))
    assert rel_rms(y, rms_norm_ref(x, w, EPS)) < TOL_BF16
    assert torch.equal(rms_norm(x, w, EPS), y)  # the dispatcher runs this kernel on CUDA
    normed, h = details.add_rms_norm_triton(x, res, w, EPS, out=nan_like(x), residual_out=nan_like(x))
    normed_ref, h_ref = add_rms_norm_ref(x, res, w, EPS)
    assert torch.equal(h, h_ref) and rel_rms(normed, normed_ref) < TOL_BF16
    in_place = res.clone()
    normed2, _ = add_rms_norm(x, in_place, w, EPS)
    details.add_rms_norm_triton(x, in_place, w, EPS, residual_out=in_place)
    assert torch.equal(in_place, h) and torch.equal(normed2, normed)


@pytest.mark.parametrize("t", T_CASES, ids=[f"T{t}-H{HV}-D{DV}-bf16" for t in T_CASES])
def test_gated_rms_norm(t):
    torch.manual_seed(t)
    x, gate, w = randn(t, HV, DV, scale=3.0), randn(t, HV, DV, scale=2.0), randn(DV, scale=0.1) + 1
    rows, gate_rows = x.reshape(-1, DV), gate.reshape(-1, DV)  # as the model calls it
    y = details.gated_rms_norm_triton(rows, gate_rows, w, EPS, out=nan_like(rows))
    assert rel_rms(y, gated_rms_norm_ref(rows, gate_rows, w, EPS)) < TOL_BF16
    assert torch.equal(gated_rms_norm(rows, gate_rows, w, EPS), y)


@pytest.mark.parametrize("t", T_CASES, ids=[f"T{t}-Hq{HQ}-Hk{HK}-D{HEAD_DIM}-R{ROTARY_DIM}-bf16" for t in T_CASES])
def test_qk_norm_rope(t):
    torch.manual_seed(t)
    qg = randn(t, HQ, 2 * HEAD_DIM, scale=2.0)
    q = qg[..., :HEAD_DIM]  # the model's q: a strided view of q and gate
    k, qw, kw = randn(t, HK, HEAD_DIM), randn(HEAD_DIM, scale=0.1), randn(HEAD_DIM, scale=0.1)
    positions = torch.randint(0, 262_144, (t,), device=DEV)
    inv_freq = rotary_inv_freq_ref(ROTARY_DIM, THETA, torch.device(DEV))
    q_ref, k_ref = qk_norm_rope_ref(q, k, qw, kw, positions, inv_freq, ROTARY_DIM, EPS)
    q_out, k_out = details.qk_norm_rope_triton(q, k, qw, kw, positions, inv_freq, ROTARY_DIM, EPS,
                                               q_out=nan_like(q), k_out=nan_like(k))
    assert rel_rms(q_out, q_ref) < TOL_BF16 and rel_rms(k_out, k_ref) < TOL_BF16
    q_d, k_d = qk_norm_rope(q, k, qw, kw, positions, inv_freq, ROTARY_DIM, EPS)
    assert torch.equal(q_d, q_out) and torch.equal(k_d, k_out)
    k_in, gate = k.clone(), qg[..., HEAD_DIM:].clone()
    details.qk_norm_rope_triton(q, k_in, qw, kw, positions, inv_freq, ROTARY_DIM, EPS, q_out=q, k_out=k_in)
    assert torch.equal(q, q_out) and torch.equal(k_in, k_out)  # in place, q inside qg
    assert torch.equal(qg[..., HEAD_DIM:], gate)  # the gate half untouched
