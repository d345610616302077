"""Gated DeltaNet's decode step: the reference against the model's decode math (bitwise), and the
Triton kernels against the reference under the interpreter (fp32, fp16; small shapes). The states
are layer 1 of a three-layer pool (strided views) that is NaN everywhere but the batch's slots, in
random order: nothing else may be read or written."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.gated_delta import gated_delta_decode, gated_delta_decode_ref
from ft.kernels.gated_delta import kernel as details
from ft.model.layers.gated_deltanet import GatedDeltaNet
from ft.model.layers.linear import Linear

TOL_O = {torch.float32: 1e-6, torch.float16: 2e-4}
"""Relative RMS of o: fp32 up to summation order; fp16 where the conv output y rounds the other way
(seen: 2e-7 and 3e-6). No bf16 here: the interpreter truncates fp32 -> bf16 instead of rounding."""
TOL_SSM = TOL_O
"""Relative RMS of the updated fp32 states (same sources of difference as o)."""
TOL_CONV = 0.0
"""The conv state is a shifted copy: bit-exact."""
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
LAYERS, LAYER, SLOTS = 3, 1, 7

# (B, Hk, Hv, Dk, Dv, W, padding rows): groups of 1 to 3 value heads per key head, several BLOCK_V
# blocks (Dv 64), dims that are not powers of two, conv widths 4 and 3
CASES = [
    (3, 2, 4, 16, 32, 4, 0),
    (2, 1, 2, 32, 16, 4, 0),
    (4, 4, 8, 64, 64, 4, 0),
    (3, 2, 6, 24, 40, 3, 1),
]
CASE_IDS = [f"B{b}-Hk{hk}-Hv{hv}-Dk{dk}-Dv{dv}-W{w}" + ("-pad" if p else "") for b, hk, hv, dk, dv, w, p in CASES]


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS difference; NaN anywhere in `out` (e.g. an unwritten poisoned output) gives nan."""
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def make_step(bsz, hk, hv, dk, dv, width, pad, dtype, seed=0):
    """Inputs of one decode step: (args for the op without the states, conv pool [S, L, C, W-1],
    ssm pool [S, L, Hv, Dk, Dv], region [S, L] bool: the (slot, layer) pairs that hold state)."""
    gen = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dv
    slots = torch.randperm(SLOTS, generator=gen)[:bsz]
    slots[:pad] = -1
    ba = randn(bsz, 2 * hv, gen=gen, dtype=dtype)  # b and a as the model's views: rows of 2 * Hv
    args = {
        "mixed": randn(bsz, c, gen=gen, dtype=dtype, scale=2.0), "b": ba[:, :hv], "a": ba[:, hv:],
        "weight": randn(c, width, gen=gen, dtype=dtype, scale=0.4),
        "a_log": (torch.rand(hv, generator=gen) * 15 + 1).log().to(dtype),
        "dt_bias": randn(hv, gen=gen, dtype=dtype, scale=0.5), "slots": slots,
    }
    conv = torch.full((SLOTS, LAYERS, c, width - 1), float("nan"), dtype=dtype)
    ssm = torch.full((SLOTS, LAYERS, hv, dk, dv), float("nan"))
    used = slots[slots >= 0]
    conv[used, LAYER] = randn(len(used), c, width - 1, gen=gen, dtype=dtype, scale=2.0)
    ssm[used, LAYER] = randn(len(used), hv, dk, dv, gen=gen, dtype=torch.float32, scale=0.3)
    region = torch.zeros(SLOTS, LAYERS, dtype=torch.bool)
    region[used, LAYER] = True
    return args, conv, ssm, region


def run(fn, args, conv, ssm, **kw):
    """fn on layer LAYER's views of copies of the pools -> (o, conv pool, ssm pool)."""
    conv, ssm = conv.clone(), ssm.clone()
    o = fn(args["mixed"], args["b"], args["a"], conv[:, LAYER], ssm[:, LAYER], args["weight"], args["a_log"],
           args["dt_bias"], args["slots"], **kw)
    return o, conv, ssm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_reference_is_the_model_decode_math(dtype):
    bsz, hk, hv, dk, dv, width = 3, 2, 4, 16, 32, 4
    args, conv, ssm, _ = make_step(bsz, hk, hv, dk, dv, width, 0, dtype, seed=1)
    # the projections do not take part in `_mix` (the conv, gates and delta rule): any shapes that fit
    qkvz, ba = Linear(torch.zeros(2 * hk * dk + 2 * hv * dv, 8, dtype=dtype)), Linear(torch.zeros(2 * hv, 8, dtype=dtype))
    layer = GatedDeltaNet(qkvz, ba, args["weight"][:, None, :], None, torch.ones(dv, dtype=dtype), args["a_log"],
                          args["dt_bias"], hk, hv, dk, dv, 1e-6)
    slots, conv_m, ssm_m = args["slots"], conv.clone(), ssm.clone()
    conv_pool, ssm_pool = conv_m[:, LAYER], ssm_m[:, LAYER]
    # GatedDeltaNet.__call__'s decode branch
    o_m, conv_new, ssm_new = layer._mix(args["mixed"][:, None], args["b"][:, None], args["a"][:, None],
                                        conv_pool[slots], ssm_pool[slots])
    conv_pool[slots], ssm_pool[slots] = conv_new, ssm_new
    o, conv_r, ssm_r = run(gated_delta_decode_ref, args, conv, ssm)
    assert o.dtype == dtype and torch.equal(o, o_m[:, 0])
    assert torch.equal(conv_r.nan_to_num(), conv_m.nan_to_num()) and torch.equal(ssm_r.nan_to_num(), ssm_m.nan_to_num())
    assert not torch.equal(conv_r.nan_to_num(), conv.nan_to_num())  # the step did update the states


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(("bsz", "hk", "hv", "dk", "dv", "width", "pad"), CASES, ids=CASE_IDS)
def test_triton_matches_reference(bsz, hk, hv, dk, dv, width, pad, dtype):
    args, conv, ssm, region = make_step(bsz, hk, hv, dk, dv, width, pad, dtype, seed=dk + dv)
    if pad:
        args["slots"] = args["slots"].int()  # int32 slots too
    o_ref, conv_ref, ssm_ref = run(gated_delta_decode_ref, args, conv, ssm)
    out = torch.full((bsz, hv, dv), float("nan"), dtype=dtype)
    o, conv_t, ssm_t = run(details.gated_delta_decode_triton, args, conv, ssm, out=out)
    assert o is out and rel_rms(o[pad:], o_ref[pad:]) < TOL_O[dtype]
    assert torch.equal(o[:pad], torch.zeros_like(o[:pad]))  # padding rows give zeros
    assert rel_rms(conv_t[region], conv_ref[region]) <= TOL_CONV
    assert rel_rms(ssm_t[region], ssm_ref[region]) < TOL_SSM[dtype]
    assert conv_t[~region].isnan().all() and ssm_t[~region].isnan().all()  # other slots and layers untouched


def test_dispatcher_and_checks(monkeypatch):
    args, conv, ssm, _ = make_step(2, 1, 2, 16, 16, 4, 0, torch.float32)
    calls = []
    real = details.gated_delta_decode_triton
    monkeypatch.setattr(details, "gated_delta_decode_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.delenv("FT_TRITON_INTERPRET_TEST", raising=False)
    ref = run(gated_delta_decode_ref, args, conv, ssm)
    got = run(gated_delta_decode, args, conv, ssm)  # the CPU without the test switch: the reference, bitwise
    assert not calls and all(torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(got, ref))
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    o, _, _ = run(gated_delta_decode, args, conv, ssm, out=torch.empty(2, 2, 16))
    assert calls == [1] and rel_rms(o, ref[0]) < TOL_O[torch.float32]
    with pytest.raises(ValueError, match="C = "):
        run(real, {**args, "mixed": args["mixed"][:, 1:], "weight": args["weight"][1:]}, conv[:, :, 1:], ssm)
    with pytest.raises(ValueError, match="slots"):
        run(real, {**args, "slots": args["slots"].float()}, conv, ssm)
    with pytest.raises(ValueError, match="out"):
        run(real, args, conv, ssm, out=torch.empty(2, 2, 8))
