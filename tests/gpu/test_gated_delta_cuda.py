"""The Gated DeltaNet decode kernels compiled for the GPU at the flagship's shapes (Qwen3-Next-80B-A3B:
16 key heads and 32 value heads of 128, conv width 4, C = 8192, bf16; states as layer 1 of a
three-layer mamba pool), against the torch reference on the GPU; and the step captured in a CUDA
graph, replayed with new inputs and slots, equal to eager bit for bit."""

from __future__ import annotations

import pytest
import torch

from ft.kernels.gated_delta import gated_delta_decode, gated_delta_decode_ref
from ft.kernels.gated_delta.kernel import gated_delta_decode_triton

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPE = torch.bfloat16
HK, HV, DK, DV, W = 16, 32, 128, 128, 4
C = 2 * HK * DK + HV * DV
SLOTS, LAYERS, LAYER = 24, 3, 1
TOL_O = 4e-3
"""Relative RMS of o, below one bf16 rounding step (2**-8): the kernels round where the reference does,
so results differ only where the conv output y (an fp32 sum in another order) rounds to bf16 the other way."""
TOL_SSM = 4e-3
"""Relative RMS of the updated fp32 states (same source of difference)."""
BATCHES = (1, 8)


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS difference; NaN anywhere in `out` (e.g. an unwritten poisoned output) gives nan."""
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_pools() -> tuple[torch.Tensor, torch.Tensor]:
    """conv [S, L, C, W-1] bf16, ssm [S, L, Hv, Dk, Dv] fp32, random."""
    return (torch.randn(SLOTS, LAYERS, C, W - 1, device=DEV).to(DTYPE) * 2,
            torch.randn(SLOTS, LAYERS, HV, DK, DV, device=DEV) * 0.3)


def make_params() -> dict:
    return {"weight": (torch.randn(C, W, device=DEV) * 0.4).to(DTYPE),
            "a_log": (torch.rand(HV, device=DEV) * 15 + 1).log().to(DTYPE),
            "dt_bias": (torch.randn(HV, device=DEV) * 0.5).to(DTYPE)}


def new_inputs(bsz: int) -> dict:
    ba = torch.randn(bsz, 2 * HV, device=DEV).to(DTYPE)  # b and a as the model's views
    return {"mixed": (torch.randn(bsz, C, device=DEV) * 2).to(DTYPE), "b": ba[:, :HV], "a": ba[:, HV:],
            "slots": torch.randperm(SLOTS, device=DEV)[:bsz]}


def step(fn, x: dict, p: dict, conv: torch.Tensor, ssm: torch.Tensor, **kw) -> torch.Tensor:
    return fn(x["mixed"], x["b"], x["a"], conv[:, LAYER], ssm[:, LAYER], p["weight"], p["a_log"], p["dt_bias"],
              x["slots"], **kw)


@pytest.mark.parametrize("bsz", BATCHES, ids=[f"B{b}-Hk{HK}-Hv{HV}-D{DK}-bf16" for b in BATCHES])
def test_decode_step(bsz):
    torch.manual_seed(bsz)
    conv, ssm = make_pools()
    p, x = make_params(), new_inputs(bsz)
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    o_ref = step(gated_delta_decode_ref, x, p, conv_ref, ssm_ref)
    out = torch.full((bsz, HV, DV), float("nan"), device=DEV, dtype=DTYPE)
    o = step(gated_delta_decode_triton, x, p, conv, ssm, out=out)
    assert o is out and rel_rms(o, o_ref) < TOL_O
    assert torch.equal(conv, conv_ref)  # a shifted copy: bit-exact, and nothing else touched
    region = torch.zeros(SLOTS, LAYERS, dtype=torch.bool, device=DEV)
    region[x["slots"], LAYER] = True
    assert rel_rms(ssm[region], ssm_ref[region]) < TOL_SSM and torch.equal(ssm[~region], ssm_ref[~region])


def test_decode_step_in_cuda_graph():
    """Persistent inputs, one capture; each replay with new inputs and slots equals eager on a copy of the pools."""
    torch.manual_seed(0)
    bsz = 8
    conv, ssm = make_pools()
    p, x = make_params(), new_inputs(bsz)
    out = torch.empty(bsz, HV, DV, device=DEV, dtype=DTYPE)

    def run() -> None:
        step(gated_delta_decode, x, p, conv, ssm, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles the kernels) outside the capture
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(3):
        fresh = new_inputs(bsz)
        for name in ("mixed", "b", "a", "slots"):
            x[name].copy_(fresh[name])
        conv_e, ssm_e = conv.clone(), ssm.clone()
        o_e = step(gated_delta_decode, x, p, conv_e, ssm_e)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, o_e) and torch.equal(conv, conv_e) and torch.equal(ssm, ssm_e)
