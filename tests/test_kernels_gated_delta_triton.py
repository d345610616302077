"""Gated DeltaNet's decode step: the reference against the model's decode math (bitwise), and the
Triton kernels against the reference under the interpreter (fp32, fp16; small shapes). Its prefill:
the chunked kernels over packed sequences against the recurrent reference per sequence, the packed
reference, the dispatchers and the layer's prefill branch. The states are layer 1 of a three-layer
pool (strided views) that is NaN everywhere but the batch's slots, in random order: nothing else may
be read or written."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

triton = pytest.importorskip("triton")

from ft.kernels.gated_delta import (
    chunk_gated_delta_rule_ref,
    chunk_gated_delta_rule_varlen,
    chunk_gated_delta_rule_varlen_ref,
    gated_delta_decode,
    gated_delta_decode_ref,
    gated_delta_rule,
    recurrent_gated_delta_rule_ref,
)
from ft.kernels.gated_delta import chunk_kernel as chunk_details
from ft.kernels.gated_delta import kernel as details
from ft.model.layers.gated_deltanet import GatedDeltaNet
from ft.model.layers.linear import Linear
from triton_flags import spy_launches

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


def test_the_decode_launch_option_takes_its_tile(monkeypatch):
    """`GatedDeltaOptions.decode_launch` (a sweep's BLOCK_V and warps) reaches the recurrent kernel's launch
    and gives the same o and states as the rule's tile (the state tile's columns split differently)."""
    from ft.kernels.options import use_kernel_options, variant

    bsz, hk, hv, dk, dv, width, pad = CASES[0]
    args, conv, ssm, region = make_step(bsz, hk, hv, dk, dv, width, pad, torch.float32, seed=5)
    want = run(details.gated_delta_decode_triton, args, conv, ssm)
    calls = spy_launches(monkeypatch, details, "_delta_decode_kernel")
    tile = (("BLOCK_V", 8), ("num_warps", 1))
    with use_kernel_options(variant(**{"gated_delta.decode_launch": tile})):
        got = run(details.gated_delta_decode_triton, args, conv, ssm)
    assert calls[-1]["BLOCK_V"] == 8 and calls[-1]["num_warps"] == 1
    for a, b in zip(got, want):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


BA_WIDTHS = [(0, 24), (3, 40), (1, 7 * 16)]
"""(case index, hidden width H): H not a power of two (a masked tile), and a batch with a padding row."""


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(("case", "h"), BA_WIDTHS, ids=[f"{CASE_IDS[c]}-H{h}" for c, h in BA_WIDTHS])
def test_in_proj_ba_inside_the_conv_launch(monkeypatch, case, h, dtype):
    """`ba_proj` (in_proj_ba's GEMV done by extra programs of the conv launch) against b, a from
    `dense_linear` given to the same kernels: o and the states to the last bits of fp32 (the GEMV's sums
    run in another order), padding rows zero; the dispatcher takes the same path in the interpreter and
    the references' path (b, a by `dense_linear`) elsewhere, with the same results."""
    from ft.kernels.dense import dense_linear

    bsz, hk, hv, dk, dv, width, pad = CASES[case]
    args, conv, ssm, region = make_step(bsz, hk, hv, dk, dv, width, pad, dtype, seed=h)
    gen = torch.Generator().manual_seed(h + 1)
    x, w_ba = randn(bsz, h, gen=gen, dtype=dtype), randn(2 * hv, h, gen=gen, dtype=dtype, scale=h ** -0.5)
    ba = dense_linear(x, w_ba)
    want = run(details.gated_delta_decode_triton, {**args, "b": ba[:, :hv], "a": ba[:, hv:]}, conv, ssm)
    no_ba = {**args, "b": None, "a": None}
    conv_calls = spy_launches(monkeypatch, details, "_conv_decode_kernel")
    delta_calls = spy_launches(monkeypatch, details, "_delta_decode_kernel")
    got = run(details.gated_delta_decode_triton, no_ba, conv, ssm, ba_proj=(x, w_ba))
    assert len(conv_calls) == len(delta_calls) == 1 and conv_calls[0]["BA"]
    assert rel_rms(got[0][pad:], want[0][pad:]) < TOL_O[dtype] and not got[0][:pad].any()
    assert rel_rms(got[1][region], want[1][region]) <= TOL_O[dtype]
    assert rel_rms(got[2][region], want[2][region]) < TOL_SSM[dtype]
    assert got[1][~region].isnan().all() and got[2][~region].isnan().all()
    ref = run(gated_delta_decode, no_ba, conv, ssm, ba_proj=(x, w_ba))  # FT_TRITON_INTERPRET_TEST unset: references
    assert rel_rms(ref[0][pad:], want[0][pad:]) < 2 * TOL_O[dtype]  # reference against kernels: fp16 y rounds apart
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    disp = run(gated_delta_decode, no_ba, conv, ssm, ba_proj=(x, w_ba))
    assert torch.equal(disp[0], got[0]) and torch.equal(disp[2].nan_to_num(), got[2].nan_to_num())
    from ft.kernels.options import use_kernel_options, variant

    with use_kernel_options(variant("gated-delta-ba-own-launch")):  # b, a by their own GEMV launch
        own = run(gated_delta_decode, no_ba, conv, ssm, ba_proj=(x, w_ba))
    assert not conv_calls[-1].get("BA", False) and rel_rms(own[0][pad:], got[0][pad:]) < TOL_O[dtype]
    with pytest.raises(ValueError, match="ba_proj"):
        run(details.gated_delta_decode_triton, args, conv, ssm, ba_proj=(x, w_ba))  # b and a given too


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


# --- prefill: the chunked delta rule over packed sequences (chunk_kernel) ---------------------------

TOL_CHUNK = {torch.float32: 1e-5, torch.float16: 2e-3}
"""Relative RMS of o and of the final states against the recurrent reference (fp32). fp32: summation
order only (measured ~1e-6; the chunked form reassociates the recurrence). fp16: the kernels store w,
u and A in fp16 and round their dot operands (normalised q and k, T, the state) to it, each a relative
2**-11 per element, a few in sequence, and o itself rounds to fp16 (measured ~5e-4)."""
PACKED = (1, 5, 63, 64, 65, 130)
"""Lengths of one packed batch: one token, shorter than a chunk, one less than a chunk, exactly one,
one more, two chunks and a bit (each sequence's chunks start at its own first token)."""

# (Hk, Hv, Dk, Dv): GQA groups of 2 (1 -> 2, 2 -> 4 key to value heads) and none, dims that are not
# powers of two, Dk > Dv and Dk < Dv, and 32/32 (issue 37: a model of these dims crashed on the H200)
CHUNK_CASES = [(1, 2, 16, 32), (2, 4, 24, 40), (2, 2, 32, 16), (2, 4, 32, 32)]
CHUNK_IDS = [f"Hk{hk}-Hv{hv}-Dk{dk}-Dv{dv}" for hk, hv, dk, dv in CHUNK_CASES]


def make_prefill(lengths, hk, hv, dk, dv, dtype, seed=0):
    """Inputs of one packed prefill: (q, k [T, Hk, Dk], v [T, Hv, Dv] as strided views of one [T, C]
    tensor, as the model's conv output; g [T, Hv] fp32 over two decades of decay rate across the heads;
    beta [T, Hv] in dtype; cu_seqlens [B+1] int32; slots [B] int64 scattered; ssm pool
    [S, L, Hv, Dk, Dv] NaN but at (slots, LAYER), where the states are random; region [S, L] bool)."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    kd = hk * dk
    y = torch.nn.functional.silu(torch.randn(t, 2 * kd + hv * dv, generator=gen) * 2).to(dtype)
    q, k, v = y[:, :kd].view(t, hk, dk), y[:, kd:2 * kd].view(t, hk, dk), y[:, 2 * kd:].view(t, hv, dv)
    g = -torch.nn.functional.softplus(torch.randn(t, hv, generator=gen)) * torch.logspace(-2, 0, hv)
    beta = torch.rand(t, hv, generator=gen).to(dtype)
    cu = torch.tensor((0, *lengths)).cumsum(0).to(torch.int32)
    slots = torch.randperm(SLOTS, generator=gen)[: len(lengths)]
    ssm = torch.full((SLOTS, LAYERS, hv, dk, dv), float("nan"))
    ssm[slots, LAYER] = torch.randn(len(lengths), hv, dk, dv, generator=gen) * 0.3
    region = torch.zeros(SLOTS, LAYERS, dtype=torch.bool)
    region[slots, LAYER] = True
    return (q, k, v, g, beta), cu, slots, ssm, region


def recurrent_per_sequence(args, cu, slots, ssm):
    """The recurrent reference on each sequence from its slot's state -> (o [T, Hv, Dv] fp32, the pool
    with the final states written)."""
    ssm = ssm.clone()
    o = torch.zeros(args[2].shape)
    for b, slot in enumerate(slots.tolist()):
        sl = slice(int(cu[b]), int(cu[b + 1]))
        if sl.stop > sl.start:
            o_b, ssm[slot, LAYER] = recurrent_gated_delta_rule_ref(*(a[None, sl] for a in args),
                                                                   ssm[slot:slot + 1, LAYER])
            o[sl] = o_b[0]
    return o, ssm


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(("hk", "hv", "dk", "dv"), CHUNK_CASES, ids=CHUNK_IDS)
def test_chunked_prefill_matches_recurrent(hk, hv, dk, dv, dtype):
    args, cu, slots, ssm, region = make_prefill(PACKED, hk, hv, dk, dv, dtype, seed=dk + dv)
    o_ref, ssm_ref = recurrent_per_sequence(args, cu, slots, ssm)
    out = torch.full(args[2].shape, float("nan"), dtype=dtype)
    ssm_t = ssm.clone()
    o = chunk_details.chunk_gated_delta_rule_varlen_triton(*args, ssm_t[:, LAYER], cu, slots, out=out)
    assert o is out and o.dtype == dtype
    for b in range(len(PACKED)):  # each sequence on its own: a wrong offset or slot shows in one
        sl = slice(int(cu[b]), int(cu[b + 1]))
        assert rel_rms(o[sl], o_ref[sl]) < TOL_CHUNK[dtype], f"sequence {b} ({PACKED[b]} tokens)"
        slot = int(slots[b])
        assert rel_rms(ssm_t[slot, LAYER], ssm_ref[slot, LAYER]) < TOL_CHUNK[dtype], f"state of sequence {b}"
    assert ssm_t[~region].isnan().all()  # other slots and layers neither read nor written


EVEN_CASES = [(1, 2, 64, 64, (True, True), (True, True)), (1, 2, 24, 32, (False, False), (False, True)),
              (2, 2, 32, 40, (False, False), (True, False))]
"""(Hk, Hv, Dk, Dv, the prep kernel's (EVEN_K, EVEN_V), the state pass's): the prep kernel's blocks are
at least PREP_MIN_BLOCK (64) wide, so only head dims of 64 and up fill them; the state pass's BLOCK_K is
Dk's power of two and its BLOCK_V narrows to 16 on this small grid (Dv 40: not a multiple)."""


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(("hk", "hv", "dk", "dv", "prep_even", "state_even"), EVEN_CASES,
                         ids=[f"Dk{c[2]}-Dv{c[3]}" for c in EVEN_CASES])
def test_chunked_prefill_even_flags(monkeypatch, hk, hv, dk, dv, prep_even, state_even, dtype):
    """Both chunk kernels get EVEN_K and EVEN_V from their configs; with both forced off (masks against
    Dk and Dv) o and the states are the same bitwise, and both match the recurrent reference."""
    args, cu, slots, ssm, region = make_prefill(PACKED, hk, hv, dk, dv, dtype, seed=dk + dv + 1)
    o_ref, ssm_ref = recurrent_per_sequence(args, cu, slots, ssm)
    results = []
    for overrides in ({}, {"EVEN_K": False, "EVEN_V": False}):
        with monkeypatch.context() as m:
            calls = [spy_launches(m, chunk_details, name, **overrides)
                     for name in ("_chunk_prep_kernel", "_chunk_state_kernel")]
            ssm_t = ssm.clone()
            results.append((chunk_details.chunk_gated_delta_rule_varlen_triton(*args, ssm_t[:, LAYER], cu, slots),
                            ssm_t))
        assert [(c["EVEN_K"], c["EVEN_V"]) for c in calls[0] + calls[1]] == [prep_even, state_even]
    (o, ssm_t), (o_masked, ssm_masked) = results
    assert rel_rms(o, o_ref) < TOL_CHUNK[dtype] and rel_rms(ssm_t[region], ssm_ref[region]) < TOL_CHUNK[dtype]
    assert ssm_t[~region].isnan().all()
    assert torch.equal(o, o_masked) and torch.equal(ssm_t.nan_to_num(), ssm_masked.nan_to_num())


def test_prep_blocks_are_at_least_64_wide():
    """Head dims under PREP_MIN_BLOCK take 64-wide masked blocks in the prep kernel (narrower ones
    miscompiled on the H200: an out-of-range shared address; the device shape matrix runs them)."""
    for dk, dv in ((16, 16), (32, 32), (32, 64), (64, 32), (48, 96), (128, 128), (256, 256)):
        cfg = chunk_details.prep_config(dk, dv, torch.bfloat16)
        assert cfg["BLOCK_K"] == max(64, triton.next_power_of_2(dk)), (dk, dv)
        assert cfg["BLOCK_V"] == max(64, triton.next_power_of_2(dv)), (dk, dv)
        assert (cfg["EVEN_K"], cfg["EVEN_V"]) == (dk == cfg["BLOCK_K"], dv == cfg["BLOCK_V"])


def test_chunked_prefill_odd_batches():
    """A sequence of 0 tokens keeps its state; int64 offsets and int32 slots; one sequence alone."""
    args, cu, slots, ssm, region = make_prefill((3, 0, 70), 1, 2, 16, 16, torch.float32, seed=7)
    o_ref, ssm_ref = recurrent_per_sequence(args, cu, slots, ssm)
    ssm_t = ssm.clone()
    o = chunk_details.chunk_gated_delta_rule_varlen_triton(*args, ssm_t[:, LAYER], cu.long(), slots.int())
    assert rel_rms(o, o_ref) < TOL_CHUNK[torch.float32]
    assert rel_rms(ssm_t[region], ssm_ref[region]) < TOL_CHUNK[torch.float32]
    assert torch.equal(ssm_t[slots[1], LAYER], ssm[slots[1], LAYER])
    args, cu, slots, ssm, _ = make_prefill((129,), 2, 4, 16, 16, torch.float32, seed=8)
    o_ref, ssm_ref = recurrent_per_sequence(args, cu, slots, ssm)
    o = chunk_details.chunk_gated_delta_rule_varlen_triton(*args, ssm[:, LAYER], cu, slots)
    assert rel_rms(o, o_ref) < TOL_CHUNK[torch.float32]
    assert rel_rms(ssm[slots[0], LAYER], ssm_ref[slots[0], LAYER]) < TOL_CHUNK[torch.float32]


def test_varlen_reference_and_dispatchers(monkeypatch):
    """The packed reference is the per-sequence rule (recurrent for one token, chunked for more: what the
    model ran), bitwise; the dispatchers take the references on the CPU without the test switch, the
    kernels with it; `gated_delta_rule` ([B, T] batches) through the kernels returns fresh states."""
    args, cu, slots, ssm, region = make_prefill((1, 9, 70), 2, 4, 16, 16, torch.float32, seed=9)
    ssm_ref = ssm.clone()
    o_ref = chunk_gated_delta_rule_varlen_ref(*args, ssm_ref[:, LAYER], cu, slots)
    for b, slot in enumerate(slots.tolist()):
        sl = slice(int(cu[b]), int(cu[b + 1]))
        rule = recurrent_gated_delta_rule_ref if sl.stop - sl.start == 1 else chunk_gated_delta_rule_ref
        o_b, s_b = rule(*(a[None, sl] for a in args), ssm[slot:slot + 1, LAYER])
        assert torch.equal(o_ref[sl], o_b[0]) and torch.equal(ssm_ref[slot, LAYER], s_b[0])
    calls = []
    real = chunk_details.chunk_gated_delta_rule_varlen_triton
    monkeypatch.setattr(chunk_details, "chunk_gated_delta_rule_varlen_triton",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.delenv("FT_TRITON_INTERPRET_TEST", raising=False)
    ssm_d = ssm.clone()
    o = chunk_gated_delta_rule_varlen(*args, ssm_d[:, LAYER], cu, slots)
    assert not calls and torch.equal(o, o_ref) and torch.equal(ssm_d.nan_to_num(), ssm_ref.nan_to_num())
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    ssm_d = ssm.clone()
    o = chunk_gated_delta_rule_varlen(*args, ssm_d[:, LAYER], cu, slots)
    assert calls == [1] and rel_rms(o, o_ref) < TOL_CHUNK[torch.float32]
    assert rel_rms(ssm_d[region], ssm_ref[region]) < TOL_CHUNK[torch.float32]
    # [B, T] batches: two sequences of 70 tokens
    q, k, v, g, beta = (a.reshape(2, 70, *a.shape[1:]) for a in make_prefill((140,), 2, 4, 16, 16, torch.float32)[0])
    state = torch.randn(2, 4, 16, 16)
    state0 = state.clone()
    o_r, s_r = recurrent_gated_delta_rule_ref(q, k, v, g, beta, state)
    o_t, s_t = gated_delta_rule(q, k, v, g, beta, state)
    assert calls == [1, 1] and torch.equal(state, state0)  # the kernels' path leaves the state alone
    assert rel_rms(o_t, o_r) < TOL_CHUNK[torch.float32] and rel_rms(s_t, s_r) < TOL_CHUNK[torch.float32]
    with pytest.raises(ValueError, match="Hk"):
        real(args[0][:, :, :8].reshape(-1, 4, 4), args[1][:, :, :8].reshape(-1, 4, 4)[:, :3], *args[2:],
             ssm[:, LAYER], cu, slots)
    with pytest.raises(ValueError, match="ssm_state"):
        real(*args, ssm[:, LAYER, :, :8], cu, slots)
    with pytest.raises(ValueError, match="g and beta"):
        real(*args[:3], args[3][:, :2], args[4], ssm[:, LAYER], cu, slots)
    with pytest.raises(ValueError, match="cu_seqlens"):
        real(*args, ssm[:, LAYER], cu[None], slots)


def make_layer(hk, hv, dk, dv, width, dtype, gen):
    """A GatedDeltaNet with random weights (hidden 32; in the checkpoint's per-key-head row order)."""
    hidden = 32
    c = 2 * hk * dk + hv * dv
    lin = lambda rows, cols, s: Linear((torch.randn(rows, cols, generator=gen) * s).to(dtype))  # noqa: E731
    return GatedDeltaNet(
        lin(c + hv * dv, hidden, 0.3), lin(2 * hv, hidden, 0.3), (torch.randn(c, 1, width, generator=gen) * 0.4).to(dtype),
        lin(hidden, hv * dv, 0.1), (1 + 0.1 * torch.randn(dv, generator=gen)).to(dtype),
        (torch.rand(hv, generator=gen) * 15 + 1).log().to(dtype), (torch.randn(hv, generator=gen) * 0.5).to(dtype),
        hk, hv, dk, dv, 1e-6)


def test_layer_prefill(monkeypatch):
    """The layer's prefill branch: on the references' path the same as the per-sequence `_mix` it ran
    before (the conv states bitwise, as they are copies of inputs; y and the recurrent states to
    fp32 rounding: torch's vectorized exp / sigmoid / softplus round an element differently in a
    vector body and in a loop's scalar tail, so a packed batch and its slices can differ in the last
    bit, and did on an AVX-512 machine); on the kernels' path (one packed conv, the chunked rule)
    close to it."""
    from ft.model.forward_batch import ForwardBatch, SeqSlice

    hk, hv, dk, dv, width = 2, 4, 16, 16, 4
    gen = torch.Generator().manual_seed(11)
    layer = make_layer(hk, hv, dk, dv, width, torch.float32, gen)
    lengths, slots = (2, 66, 7), (5, 0, 3)
    t = sum(lengths)
    x = torch.randn(t, 32, generator=gen)
    c = 2 * hk * dk + hv * dv
    conv = torch.randn(SLOTS, LAYERS, c, width - 1, generator=gen)
    ssm = torch.randn(SLOTS, LAYERS, hv, dk, dv, generator=gen) * 0.3
    batch = ForwardBatch(input_ids=torch.zeros(t, dtype=torch.long), positions=torch.zeros(t, dtype=torch.long),
                         seqs=[SeqSlice(0, n, torch.zeros(1, dtype=torch.long), s) for n, s in zip(lengths, slots)])
    assert batch.cu_seqlens.tolist() == [0, 2, 68, 75] and batch.cu_seqlens.dtype == torch.int32

    def forward(conv_pool, ssm_pool):
        return layer(x, batch, conv_pool[:, LAYER], ssm_pool[:, LAYER])

    # before: the loop over sequences, each through `_mix` (what the prefill branch ran)
    conv_b, ssm_b = conv.clone(), ssm.clone()
    mixed, z, b, a = layer._project(x)
    outs, offset = [], 0
    for n, s in zip(lengths, slots):
        sl = slice(offset, offset + n)
        o_i, conv_b[s, LAYER], ssm_b[s, LAYER] = (r[0] for r in layer._mix(
            mixed[None, sl], b[None, sl], a[None, sl], conv_b[s:s + 1, LAYER], ssm_b[s:s + 1, LAYER]))
        outs.append(o_i)
        offset += n
    from ft.kernels.norm import gated_rms_norm

    o = gated_rms_norm(torch.cat(outs).reshape(t, hv, dv), z, layer.norm_weight, layer.eps)
    y_before = layer.out_proj(o.reshape(t, -1))
    monkeypatch.delenv("FT_TRITON_INTERPRET_TEST", raising=False)
    conv_r, ssm_r = conv.clone(), ssm.clone()
    y_ref = forward(conv_r, ssm_r)
    assert torch.equal(conv_r, conv_b)
    assert rel_rms(y_ref, y_before) < 1e-6 and rel_rms(ssm_r, ssm_b) < 1e-6
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    conv_t, ssm_t = conv.clone(), ssm.clone()
    y = forward(conv_t, ssm_t)
    assert rel_rms(y, y_ref) < 1e-5 and rel_rms(ssm_t, ssm_r) < 1e-5
    assert torch.equal(conv_t, conv_r)
