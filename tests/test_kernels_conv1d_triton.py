"""The packed causal conv1d of prefill (`causal_conv1d_varlen`): the Triton kernel against the reference
per sequence under the interpreter (fp32, fp16; small shapes). The states are layer 1 of a
three-layer pool (strided views) that is NaN everywhere but the batch's slots, in random order: nothing
else may be read or written; y is NaN-poisoned before the kernel writes it."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.conv1d import causal_conv1d_ref, causal_conv1d_varlen, causal_conv1d_varlen_ref
from ft.kernels.conv1d import kernel as details
from ft.kernels.options import use_kernel_options, variant
from triton_flags import spy_launches

TOL_Y = {torch.float32: 1e-6, torch.float16: 2e-4}
"""Relative RMS of y: fp32 up to summation order; fp16 where an fp32 sum taken in another order than
torch's conv rounds to fp16 the other way (an occasional last place). No bf16: the interpreter
truncates fp32 -> bf16 instead of rounding."""
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
LAYERS, LAYER, SLOTS = 3, 1, 12

# (C, W, lengths): sequences shorter than W-1 (1, 2 at W 4), of exactly W-1, of 0 tokens, spanning
# several token tiles (BLOCK_T 16) and not multiples of them; one channel block (C 40) or several with a
# partial last one (C 200); widths 4, 3 and 2; up to 9 sequences (4 steps of the binary search)
CASES = [
    (40, 4, (1, 2, 3, 17, 40, 5)),
    (200, 4, (33, 1, 0, 16, 2)),
    (24, 3, (7, 1, 2, 31, 64, 1, 9, 3, 20)),
    (64, 2, (1, 15, 1)),
]
CASE_IDS = [f"C{c}-W{w}-B{len(lens)}" for c, w, lens in CASES]


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS difference; NaN anywhere in `out` (e.g. an unwritten poisoned output) gives nan."""
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def make_batch(c: int, width: int, lengths: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    """-> (x [T, C] a strided view, weight [C, W], cu_seqlens [B+1] int32, slots [B] int64, conv pool
    [S, L, C, W-1] NaN but at (slots, LAYER), region [S, L] bool: where state is)."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    x = (torch.randn(t, c + 24, generator=gen) * 2).to(dtype)[:, :c]  # as the model's view of a projection
    weight = (torch.randn(c, width, generator=gen) * 0.4).to(dtype)
    cu = torch.tensor((0, *lengths)).cumsum(0).to(torch.int32)
    slots = torch.randperm(SLOTS, generator=gen)[: len(lengths)]
    conv = torch.full((SLOTS, LAYERS, c, width - 1), float("nan"), dtype=dtype)
    conv[slots, LAYER] = (torch.randn(len(lengths), c, width - 1, generator=gen) * 2).to(dtype)
    region = torch.zeros(SLOTS, LAYERS, dtype=torch.bool)
    region[slots, LAYER] = True
    return x, weight, cu, slots, conv, region


def test_varlen_reference_is_the_per_sequence_reference():
    """The packed reference is `causal_conv1d_ref` on each sequence with its state (bitwise)."""
    x, weight, cu, slots, conv, _ = make_batch(40, 4, (1, 2, 9, 0, 5), torch.float32, seed=1)
    conv_v = conv.clone()
    y = causal_conv1d_varlen_ref(x, conv_v[:, LAYER], weight, cu, slots)
    for b, slot in enumerate(slots.tolist()):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if hi == lo:
            assert torch.equal(conv_v[slot, LAYER], conv[slot, LAYER])  # no tokens: the state stays
            continue
        y_b, new = causal_conv1d_ref(x[None, lo:hi], conv[slot:slot + 1, LAYER], weight)
        assert torch.equal(y[lo:hi], y_b[0]) and torch.equal(conv_v[slot, LAYER], new[0])
    assert not torch.equal(conv_v[slots[0], LAYER], conv[slots[0], LAYER])


KERNELS = {"tiles": ("conv1d-tiles",), "rows": ()}
"""The packed conv's two kernels: rows walked with the window in registers (`Conv1dOptions.rows`, the default), at
small tiles here so that programs span several tiles of a sequence, and tiles of tokens by channels, each input
loaded once a tap (variant "conv1d-tiles", and every window wider than 4)."""
ROWS_SMALL = variant(**{"conv1d.rows_launch": (("BLOCK_T", 8), ("BLOCK_C", 32))})


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNELS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(("c", "width", "lengths"), CASES, ids=CASE_IDS)
def test_triton_matches_reference(c, width, lengths, dtype, kernel, monkeypatch):
    x, weight, cu, slots, conv, region = make_batch(c, width, lengths, dtype, seed=c + width)
    if width == 3:
        cu, slots = cu.long(), slots.int()  # int64 offsets and int32 slots too
    conv_ref, conv_t = conv.clone(), conv.clone()
    y_ref = causal_conv1d_varlen_ref(x, conv_ref[:, LAYER], weight, cu, slots)
    out = torch.full((sum(lengths), c), float("nan"), dtype=dtype)
    name = "_conv_varlen_rows_kernel" if kernel == "rows" else "_conv_varlen_kernel"
    calls = spy_launches(monkeypatch, details, name)
    with use_kernel_options(ROWS_SMALL if kernel == "rows" else variant(*KERNELS[kernel])):
        y = details.causal_conv1d_varlen_triton(x, conv_t[:, LAYER], weight, cu, slots, out=out)
    assert calls  # the kernel named ran
    assert y is out and rel_rms(y, y_ref) < TOL_Y[dtype]
    assert torch.equal(conv_t[region], conv_ref[region])  # the new states are copies: bit-exact
    assert conv_t[~region].isnan().all()  # other slots and layers neither read (NaN would spread) nor written
    assert not torch.equal(conv_ref[region], conv[region])  # the states did change (the check above can fail)


EVEN_CASES = [(128, 4, (1, 2, 17, 0, 40)), (40, 3, (5, 18, 1))]
"""C a multiple of BLOCK_C (128: whole channel blocks, EVEN_C) and not (40: a partial block)."""


# (the kernel, its options here, its BLOCK_C under them)
EVEN_KERNELS = {"tiles": ("_conv_varlen_kernel", variant("conv1d-tiles"), 64),
                "rows": ("_conv_varlen_rows_kernel", ROWS_SMALL, 32)}


@pytest.mark.parametrize("kernel", EVEN_KERNELS, ids=EVEN_KERNELS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(("c", "width", "lengths"), EVEN_CASES, ids=[f"C{c}-W{w}" for c, w, _ in EVEN_CASES])
def test_even_c_flag(monkeypatch, c, width, lengths, dtype, kernel):
    """The wrapper sets EVEN_C = (C % BLOCK_C == 0); the kernel with EVEN_C forced off (masks against C)
    gives the same y and states bitwise, and both match the reference."""
    name, options, block_c = EVEN_KERNELS[kernel]
    x, weight, cu, slots, conv, region = make_batch(c, width, lengths, dtype, seed=c)
    conv_ref = conv.clone()
    y_ref = causal_conv1d_varlen_ref(x, conv_ref[:, LAYER], weight, cu, slots)
    results = []
    for overrides in ({}, {"EVEN_C": False}):
        with monkeypatch.context() as m, use_kernel_options(options):
            calls = spy_launches(m, details, name, **overrides)
            conv_t = conv.clone()
            out = torch.full((sum(lengths), c), float("nan"), dtype=dtype)
            y = details.causal_conv1d_varlen_triton(x, conv_t[:, LAYER], weight, cu, slots, out=out)
            results.append((y, conv_t))
        assert [call["EVEN_C"] for call in calls] == [c % block_c == 0]
    (y, conv_t), (y_masked, conv_masked) = results
    assert rel_rms(y, y_ref) < TOL_Y[dtype] and torch.equal(conv_t[region], conv_ref[region])
    assert conv_t[~region].isnan().all()
    assert torch.equal(y, y_masked) and torch.equal(conv_t.nan_to_num(), conv_masked.nan_to_num())


def test_dispatcher_and_checks(monkeypatch):
    x, weight, cu, slots, conv, _ = make_batch(40, 4, (2, 20), torch.float32)
    calls = []
    real = details.causal_conv1d_varlen_triton
    monkeypatch.setattr(details, "causal_conv1d_varlen_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.delenv("FT_TRITON_INTERPRET_TEST", raising=False)
    conv_ref, conv_d = conv.clone(), conv.clone()
    y_ref = causal_conv1d_varlen_ref(x, conv_ref[:, LAYER], weight, cu, slots)
    y = causal_conv1d_varlen(x, conv_d[:, LAYER], weight, cu, slots)  # the CPU without the switch: the reference
    assert not calls and torch.equal(y, y_ref) and torch.equal(conv_d.nan_to_num(), conv_ref.nan_to_num())
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    conv_d = conv.clone()
    y = causal_conv1d_varlen(x, conv_d[:, LAYER], weight, cu, slots)
    assert calls == [1] and rel_rms(y, y_ref) < TOL_Y[torch.float32]
    state = conv[:, LAYER]
    with pytest.raises(ValueError, match="weight"):
        real(x, state, weight[1:], cu, slots)
    with pytest.raises(ValueError, match="conv_state"):
        real(x, state[:, :, 1:], weight, cu, slots)
    with pytest.raises(ValueError, match="cu_seqlens"):
        real(x, state, weight, cu.float(), slots)
    with pytest.raises(ValueError, match="slots"):
        real(x, state, weight, cu, slots[:1])
    with pytest.raises(ValueError, match="out"):
        real(x, state, weight, cu, slots, out=torch.empty(22, 8))
