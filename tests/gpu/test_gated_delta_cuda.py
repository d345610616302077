"""The Gated DeltaNet kernels compiled for the GPU at the flagship's shapes (Qwen3-Next-80B-A3B:
16 key heads and 32 value heads of 128, conv width 4, C = 8192, bf16; states as layer 1 of a
three-layer mamba pool), against the torch references on the GPU: the decode step, and the step
captured in a CUDA graph, replayed with new inputs and slots, equal to eager bit for bit; the
prefill's packed conv and chunked delta rule over 4,096 tokens in 3 sequences."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ft.kernels.conv1d import causal_conv1d_varlen, causal_conv1d_varlen_ref
from ft.kernels.conv1d.kernel import causal_conv1d_varlen_triton
from ft.kernels.gated_delta import (
    chunk_gated_delta_rule_ref,
    chunk_gated_delta_rule_varlen,
    gated_delta_decode,
    gated_delta_decode_ref,
)
from ft.kernels.gated_delta.chunk_kernel import chunk_gated_delta_rule_varlen_triton
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


PREFILL_LENGTHS = (2, 1535, 2559)
"""4,096 tokens in 3 sequences: one shorter than W-1 (its new conv state keeps old columns), the others
neither multiples of 64 (the delta rule's chunk) nor of 32 (the conv's token tile)."""
TOL_Y = 4e-3
"""Relative RMS of the packed conv's y: it rounds where the reference does (the sum to the weight's
dtype, SiLU, x's dtype), so only a bf16 rounding of an fp32 sum taken in another order differs."""
TOL_O_PREFILL = 1e-2
"""Relative RMS of the chunked delta rule's o against the fp32 reference on the same bf16 inputs (o
before its rounding to bf16): the kernels round to bf16 what they store (w, u, A) and their dot
operands (normalised q and k, T, the state), each a relative 2**-9 per element, a few in sequence;
printed by the test (-s) as measured."""
TOL_SSM_PREFILL = 1e-2
"""Relative RMS of the final fp32 states (same sources)."""


def packed_batch(lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens [B+1] int32, slots [B] int64, distinct, at random) on the GPU."""
    cu = torch.tensor((0, *lengths), device=DEV).cumsum(0).to(torch.int32)
    return cu, torch.randperm(SLOTS, device=DEV)[: len(lengths)]


def test_conv_varlen_prefill():
    torch.manual_seed(3)
    cu, slots = packed_batch(PREFILL_LENGTHS)
    t = sum(PREFILL_LENGTHS)
    conv, _ = make_pools()
    weight = make_params()["weight"]
    x = (torch.randn(t, C + 512, device=DEV) * 2).to(DTYPE)[:, :C]  # a strided view, as the model's
    conv0, conv_ref = conv.clone(), conv.clone()
    y_ref = causal_conv1d_varlen_ref(x, conv_ref[:, LAYER], weight, cu, slots)
    out = torch.full((t, C), float("nan"), device=DEV, dtype=DTYPE)
    y = causal_conv1d_varlen_triton(x, conv[:, LAYER], weight, cu, slots, out=out)
    print({"y": rel_rms(y, y_ref)})
    assert y is out and rel_rms(y, y_ref) < TOL_Y
    assert not torch.equal(conv_ref, conv0)  # the reference did write new states
    assert torch.equal(conv, conv_ref)  # they are copies: bit-exact; other slots and layers untouched
    conv_d = conv0.clone()  # the dispatcher takes this kernel on CUDA
    assert torch.equal(causal_conv1d_varlen(x, conv_d[:, LAYER], weight, cu, slots), y) and torch.equal(conv_d, conv)


def prefill_inputs(t: int, seed: int) -> dict:
    """q, k, v as views of a conv output [T, C] (bf16, after SiLU), g over three decades of decay rate
    across the heads (the slow heads carry the state across many chunks), beta = sigmoid(b) in bf16."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    y = F.silu(torch.randn(t, C, device=DEV, generator=gen) * 2).to(DTYPE)
    kd = HK * DK
    rate = torch.logspace(-3, 0, HV, device=DEV)  # per value head
    g = -F.softplus(torch.randn(t, HV, device=DEV, generator=gen)) * rate
    b = torch.randn(t, HV, device=DEV, generator=gen).to(DTYPE)
    return {"q": y[:, :kd].view(t, HK, DK), "k": y[:, kd:2 * kd].view(t, HK, DK),
            "v": y[:, 2 * kd:].view(t, HV, DV), "g": g, "beta": b.sigmoid()}


def test_chunked_delta_rule_prefill():
    torch.manual_seed(4)
    cu, slots = packed_batch(PREFILL_LENGTHS)
    t = sum(PREFILL_LENGTHS)
    x = prefill_inputs(t, seed=5)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    _, ssm = make_pools()
    ssm0, ssm_ref = ssm.clone(), ssm.clone()
    o_ref = torch.empty(t, HV, DV, device=DEV)  # fp32: the reference's o before any rounding to bf16
    for i, slot in enumerate(slots.tolist()):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        o_i, ssm_ref[slot, LAYER] = chunk_gated_delta_rule_ref(*(a[None, sl] for a in args),
                                                                ssm_ref[slot:slot + 1, LAYER])
        o_ref[sl] = o_i[0]
    out = torch.full((t, HV, DV), float("nan"), device=DEV, dtype=DTYPE)
    o = chunk_gated_delta_rule_varlen_triton(*args, ssm[:, LAYER], cu, slots, out=out)
    region = torch.zeros(SLOTS, LAYERS, dtype=torch.bool, device=DEV)
    region[slots, LAYER] = True
    errors = {"o": rel_rms(o, o_ref), "ssm": rel_rms(ssm[region], ssm_ref[region]),
              "o per sequence": [rel_rms(o[cu[i]:cu[i + 1]], o_ref[cu[i]:cu[i + 1]]) for i in range(len(slots))]}
    print(errors)
    assert o is out and errors["o"] < TOL_O_PREFILL and errors["ssm"] < TOL_SSM_PREFILL
    assert max(errors["o per sequence"]) < TOL_O_PREFILL  # a wrong offset or slot shows in one sequence
    assert torch.equal(ssm[~region], ssm0[~region])  # other slots and layers untouched
    # the dispatcher takes the same two launches on CUDA: bit-equal (and so the kernels are deterministic)
    ssm_d = ssm0.clone()
    assert torch.equal(chunk_gated_delta_rule_varlen(*args, ssm_d[:, LAYER], cu, slots), o)
    assert torch.equal(ssm_d, ssm)
