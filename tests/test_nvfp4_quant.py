"""NVFP4 quantization (ft.kernels.nvfp4) against ModelOpt's algorithm, bit for bit.

Three independent checks of `quantize_nvfp4`:
1. a deliberately simple scalar re-statement of ModelOpt's ``NVFP4QTensor.quantize`` (one element
   at a time, numpy float32 arithmetic, its own float8 e4m3 rounding from the bit layout);
2. hand-computed codes and scales for the edge cases (ties at every E2M1 midpoint, saturation,
   zero blocks, fp8 rounding and clamping of block scales, negative zero);
3. nvidia-modelopt itself (``NVFP4QTensor``), which runs on CPU.

weight_scale_2 = amax / 2688 is rounded two ways: "reciprocal" (amax * fl32(1/2688), what
ModelOpt computes on CUDA and the default) and "exact" (what ModelOpt computes on CPU). Both are
checked against the reference; the ModelOpt comparison here runs on CPU, so it uses "exact".
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ft.kernels.nvfp4 import E2M1_VALUES, dequantize_nvfp4, nvfp4_linear, nvfp4_linear_ref
from ft.tools.nvfp4_quantize import quantize_nvfp4

# ---------------------------------------------------------------------------------------------
# scalar reference, written from ModelOpt's source semantics (not from ft.kernels.nvfp4)

F32 = np.float32
E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _fp8_e4m3fn_table() -> list[float]:
    """Positive finite float8_e4m3fn values, indexed by their 7-bit code (0x7F is NaN)."""
    vals = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals


FP8_TABLE = _fp8_e4m3fn_table()


def ref_fp8(v: float) -> float:
    """Round a non-negative value in [2^-9, 448] to float8_e4m3fn: nearest, ties to even code."""
    best = min(range(len(FP8_TABLE)), key=lambda c: (abs(FP8_TABLE[c] - v), c % 2))
    return FP8_TABLE[best]


def ref_e2m1_code(x: np.float32) -> int:
    """Nearest E2M1 magnitude, ties to the even code, saturating at 6; sign bit iff x < 0."""
    mag = abs(float(x))
    if mag > 6.0:
        code = 7
    else:
        code = min(range(8), key=lambda c: (abs(E2M1_MAGNITUDES[c] - mag), c % 2))
    return code | (8 if x < 0 else 0)


def ref_quantize(w: torch.Tensor, global_amax: float | None = None, division: str = "reciprocal"):
    """(codes int [N, K], block scales float [N, K/16], scale_2 np.float32), one element at a time."""
    a = w.float().numpy()  # bf16/fp16 -> float32 is exact
    n, k = a.shape
    amax = F32(np.abs(a).max()) if global_amax is None else F32(global_amax)
    if division == "reciprocal":
        s2 = F32(amax * F32(F32(1.0) / F32(2688.0)))
    else:
        s2 = F32(amax / F32(2688.0))
    codes = np.zeros((n, k), dtype=np.int64)
    scales = np.ones((n, k // 16), dtype=np.float64)
    if s2 == 0:  # all-zero tensor: FreeToken's rule (ModelOpt would produce NaN here)
        return codes, scales, s2
    for i in range(n):
        for b in range(k // 16):
            block = a[i, b * 16 : (b + 1) * 16]
            bs = F32(F32(np.abs(block).max()) / F32(F32(6.0) * s2))
            if bs == 0:
                bs = F32(1.0)
            bs = min(max(float(bs), 2.0**-9), 448.0)
            scale = ref_fp8(bs)
            scales[i, b] = scale
            divisor = F32(F32(scale) * s2)
            for j in range(16):
                codes[i, b * 16 + j] = ref_e2m1_code(F32(block[j] / divisor))
    return codes, scales, s2


def unpack(packed: torch.Tensor) -> np.ndarray:
    p = packed.numpy().astype(np.int64)
    out = np.empty((p.shape[0], p.shape[1] * 2), dtype=np.int64)
    out[:, 0::2] = p & 0xF
    out[:, 1::2] = p >> 4
    return out


def assert_matches_ref(w: torch.Tensor, global_amax: float | None = None, division: str | None = None) -> None:
    if division is None:  # both
        assert_matches_ref(w, global_amax, "reciprocal")
        assert_matches_ref(w, global_amax, "exact")
        return
    ga = None if global_amax is None else torch.tensor(global_amax)
    packed, scale, s2 = quantize_nvfp4(w, ga, scale_2_division=division)
    if division == "reciprocal":
        p0, s0, s20 = quantize_nvfp4(w, ga)  # the default
        assert torch.equal(p0, packed) and torch.equal(s0.view(torch.uint8), scale.view(torch.uint8))
        assert torch.equal(s20, s2)
    codes, scales, rs2 = ref_quantize(w, global_amax, division)
    assert packed.dtype == torch.uint8 and packed.shape == (w.shape[0], w.shape[1] // 2)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (w.shape[0], w.shape[1] // 16)
    assert s2.dtype == torch.float32 and s2.dim() == 0
    assert s2.item() == float(rs2)
    np.testing.assert_array_equal(scale.float().numpy(), scales)
    np.testing.assert_array_equal(unpack(packed), codes)


# ---------------------------------------------------------------------------------------------
# the reference itself


def test_e2m1_table():
    assert E2M1_VALUES.dtype == torch.float32 and E2M1_VALUES.shape == (16,)
    assert E2M1_VALUES[:8].tolist() == E2M1_MAGNITUDES
    assert E2M1_VALUES[8:].tolist() == [-v for v in E2M1_MAGNITUDES]
    assert torch.signbit(E2M1_VALUES[8])


def test_reference_fp8_matches_torch_cast():
    # the scalar fp8 rounding (from the bit layout) agrees with torch's cast on grid points,
    # midpoints and random values
    pts = sorted(set(FP8_TABLE[1:]))
    mids = [(a + b) / 2 for a, b in zip(pts[:-1], pts[1:], strict=True)]
    rnd = (torch.rand(300, dtype=torch.float64) * 448).clamp(min=2**-9).tolist()
    for v in pts + mids + rnd:
        v32 = float(F32(v))
        assert ref_fp8(v32) == torch.tensor(v32).to(torch.float8_e4m3fn).float().item(), v32


# ---------------------------------------------------------------------------------------------
# hand-computed edge cases


def _edge_tensor() -> torch.Tensor:
    """[2, 96]: amax 2688, so weight_scale_2 == 1.0 exactly and block scales are plain numbers."""
    w = torch.zeros(2, 96)
    # row 0, block 0: the seven midpoints, 6 and their negatives; scale 6/6 = 1
    w[0, 0:16] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5,
                               -6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5])
    # row 0, block 1: exact grid values, near-midpoint values, -0.0 and a small negative
    w[0, 16:32] = torch.tensor([0.0, -0.0, 0.1, -0.1, 0.5, 1, 1.5, 2,
                                3, 4, 0.2499, 0.2501, 0.7499, 5.0001, 4.9999, 6])
    # row 0, block 2: all zeros -> scale 1.0, codes 0
    # row 0, block 3: block amax 6.375 -> 6.375/6 = 1.0625, an fp8 tie between 1.0 and 1.125 that
    # rounds to even (1.0): 6.375 and 5.5 then saturate to 6
    w[0, 48:52] = torch.tensor([6.375, -6.375, 5.5, 5.0])
    # row 0, block 4: block scale 1.1 rounds to the fp8 value 1.125
    w[0, 64:67] = torch.tensor([6.6, 0.84375, -0.84375])  # 0.84375 / 1.125 = 0.75 exactly
    # row 0, block 5: a block scale 3 * 2^-9 (an fp8 subnormal, exact)
    w[0, 80:82] = torch.tensor([6 * 3 * 2.0**-9, -3 * 3 * 2.0**-9])
    # row 1, block 0: the tensor amax 2688 -> scale 448 (the fp8 maximum)
    w[1, 0:4] = torch.tensor([2688.0, -1344.0, 112.0, 336.0])  # /448: 6, -3, 0.25, 0.75
    # row 1, block 1: block scale 2^-12, below the fp8 minimum 2^-9: clamped to 2^-9
    w[1, 16:19] = torch.tensor([6 * 2.0**-12, -6 * 2.0**-12, 2.0**-12])  # /2^-9: .75, -.75, .125
    return w


def test_edge_cases_hand_computed():
    w = _edge_tensor()
    packed, scale, s2 = quantize_nvfp4(w)
    assert s2.item() == 1.0
    codes = unpack(packed)
    assert codes[0, 0:16].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 15, 8, 10, 10, 12, 12, 14, 14]
    assert codes[0, 16:32].tolist() == [0, 0, 0, 8, 1, 2, 3, 4, 5, 6, 0, 1, 1, 7, 6, 7]
    assert codes[0, 32:48].tolist() == [0] * 16
    assert codes[0, 48:52].tolist() == [7, 15, 7, 6]
    assert codes[0, 64:67].tolist() == [7, 2, 10]  # 6.6 / 1.125 = 5.87 -> 6; 0.75 tie -> 1.0
    assert codes[0, 80:82].tolist() == [7, 13]  # 6 and -3 in units of the scale 3 * 2^-9
    assert codes[1, 0:4].tolist() == [7, 13, 0, 2]
    assert codes[1, 16:19].tolist() == [2, 10, 0]
    assert scale.float()[0].tolist() == [1.0, 1.0, 1.0, 1.0, 1.125, 3 * 2.0**-9]
    assert scale.float()[1].tolist() == [448.0, 2.0**-9, 1.0, 1.0, 1.0, 1.0]
    assert_matches_ref(w)


def test_ties_round_to_even_code_both_signs_every_scale():
    # every midpoint and grid value, both signs, in blocks of scale 2^e (exact in fp8)
    vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    expected = [0, 2, 2, 4, 4, 6, 6, 7]
    rows = []
    for e in range(-8, 8):
        rows.append(torch.cat([vals, -vals]) * 2.0**e)
    w = torch.stack(rows)
    # amax = 6 * 2^7 = 768 -> s2 = 768/2688 (not a power of two); the reference covers that
    assert_matches_ref(w)
    # with s2 == 1 (global amax 2688) every block scale is exactly 2^e * 6 / 6 = 2^e
    packed, scale, _ = quantize_nvfp4(w, torch.tensor(2688.0))
    codes = unpack(packed)
    for r, e in enumerate(range(-8, 8)):
        assert scale.float()[r, 0].item() == 2.0**e
        assert codes[r].tolist() == expected + [c | 8 for c in expected]


def test_block_amax_maps_to_code_7_and_15():
    torch.manual_seed(1)
    w = torch.randn(16, 64)
    packed, scale, s2 = quantize_nvfp4(w)
    codes = unpack(packed).reshape(16, 4, 16)
    blocks = w.reshape(16, 4, 16)
    idx = blocks.abs().argmax(-1, keepdim=True)
    at_max = np.take_along_axis(codes, idx.numpy(), -1).squeeze(-1)
    sign = np.take_along_axis(blocks.numpy(), idx.numpy(), -1).squeeze(-1) < 0
    # with a normal fp8 block scale (relative rounding error <= 1/16) the block amax divided by
    # its scale is in [6/1.0625, 6 * 1.0625], which always rounds (or saturates) to 6
    assert (at_max == np.where(sign, 15, 7)).all()
    assert_matches_ref(w)


def test_all_zero_tensor_and_zero_blocks():
    w = torch.zeros(4, 32, dtype=torch.bfloat16)
    packed, scale, s2 = quantize_nvfp4(w)
    assert torch.equal(packed, torch.zeros(4, 16, dtype=torch.uint8))
    assert (scale.float() == 1.0).all()
    assert s2.item() == 0.0
    d = dequantize_nvfp4(packed, scale, s2)
    assert torch.equal(d, torch.zeros(4, 32)) and not d.isnan().any()
    # negative zeros too
    packed, scale, s2 = quantize_nvfp4(-w.float())
    assert torch.equal(packed, torch.zeros(4, 16, dtype=torch.uint8))
    # a global_amax of 0 for a nonzero weight is an error, not NaN
    with pytest.raises(ValueError):
        quantize_nvfp4(torch.ones(1, 16), torch.tensor(0.0))
    # amax > 0 but scale_2 underflows float32 (found by the property test): zeros, as the reference says
    tiny = torch.zeros(2, 16)
    tiny[1, 15] = 1.401298464324817e-45
    assert_matches_ref(tiny)
    packed, _, s2 = quantize_nvfp4(tiny)
    assert s2.item() == 0.0 and not packed.any()


def test_packing_order_even_element_low_nibble():
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1] = 6.0, 1.0  # codes 7 and 2
    packed, _, _ = quantize_nvfp4(w)
    assert packed[0, 0].item() == 0x27
    assert packed[0, 1:].tolist() == [0] * 7
    w2 = torch.zeros(1, 16)
    w2[0, 14], w2[0, 15] = -6.0, 0.5  # codes 15 and 1 in byte 7
    packed, _, _ = quantize_nvfp4(w2)
    assert packed[0, 7].item() == 0x1F


def test_shape_and_dtype_errors():
    for k in (8, 17, 24, 100):
        with pytest.raises(ValueError, match="16"):
            quantize_nvfp4(torch.randn(4, k))
    with pytest.raises(ValueError):
        quantize_nvfp4(torch.randn(64))
    with pytest.raises(ValueError):
        quantize_nvfp4(torch.randn(2, 4, 16))
    with pytest.raises(ValueError):
        quantize_nvfp4(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale_2_division"):
        quantize_nvfp4(torch.ones(4, 16), scale_2_division="fast")


def test_scale_2_divisions():
    # reciprocal: amax * fl32(1/2688) (ModelOpt on CUDA); exact: fl32(amax / 2688) (on CPU)
    g = torch.Generator().manual_seed(2)
    amaxes = torch.rand(2000, generator=g) * 100
    differ = 0
    for a in amaxes[:200].tolist():
        w = torch.zeros(1, 16)
        w[0, 0] = a
        r = quantize_nvfp4(w)[2].item()
        e = quantize_nvfp4(w, scale_2_division="exact")[2].item()
        assert r == float(F32(F32(a) * (F32(1) / F32(2688))))
        assert e == float(F32(F32(a) / F32(2688)))
        differ += r != e
    assert differ > 10  # they really differ, about one amax in five
    # the same global amax gives the same weight_scale_2 whatever the weight
    w = torch.randn(4, 32, generator=g)
    assert quantize_nvfp4(w, 10.0)[2].item() == quantize_nvfp4(-w, torch.tensor(10.0))[2].item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_matches_reference(dtype):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(6, 64, generator=g) * torch.exp(2 * torch.randn(6, 64, generator=g))
    w[1, 16:32] = 0  # a zero block
    w[2, :16] *= 1e-6  # a block whose scale is clamped to 2^-9
    w = w.to(dtype)
    assert_matches_ref(w)
    assert_matches_ref(w, global_amax=float(w.float().abs().max()) * 1.5)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from([0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -5.0, 448.0]),
            st.floats(-1e4, 1e4, allow_nan=False, width=32),
        ),
        min_size=32,
        max_size=32,
    )
)
def test_property_matches_reference(values):
    assert_matches_ref(torch.tensor(values, dtype=torch.float32).reshape(2, 16))


# ---------------------------------------------------------------------------------------------
# dequantize and linear


def test_dequantize_error_bounds():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g)
    packed, scale, s2 = quantize_nvfp4(w)
    d = dequantize_nvfp4(packed, scale, s2)
    assert d.shape == w.shape and d.dtype == torch.float32
    eff = (scale.float() * s2).repeat_interleave(16, dim=1)  # the step unit of each element
    # every element is on the E2M1 grid of its block ...
    grid = torch.tensor(E2M1_MAGNITUDES)
    assert ((d.abs() / eff).unsqueeze(-1) == grid).any(-1).all()
    # ... and is its nearest grid point (round to nearest; saturation above 6)
    x = (w / eff).abs().clamp(max=6.0)
    nearest = (x.unsqueeze(-1) - grid).abs().min(-1).values
    assert torch.allclose((d.abs() / eff - x).abs(), nearest, atol=1e-6)
    # error per element: half the largest step (1) plus any overshoot of a scale rounded down
    overshoot = (w.abs().reshape(64, 16, 16).amax(-1).repeat_interleave(16, 1) - 6 * eff).clamp(min=0)
    assert ((d - w).abs() <= eff + overshoot + 1e-7).all()
    rel = ((d - w).norm() / w.norm()).item()
    assert rel < 0.12
    # bf16 output is the float32 result cast
    assert torch.equal(dequantize_nvfp4(packed, scale, s2, torch.bfloat16), d.to(torch.bfloat16))
    # scale_2 as a float works the same
    assert torch.equal(dequantize_nvfp4(packed, scale, float(s2)), d)


def test_dequantize_formula_exact():
    # value = e2m1 * (float(scale) * scale_2), the scales' product rounded to float32 first
    g = torch.Generator().manual_seed(4)
    w = torch.randn(8, 32, generator=g)
    packed, scale, s2 = quantize_nvfp4(w)
    codes = torch.from_numpy(unpack(packed))
    expect = E2M1_VALUES[codes] * (scale.float() * s2).repeat_interleave(16, dim=1)
    assert torch.equal(dequantize_nvfp4(packed, scale, s2), expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_ref_and_dispatcher(dtype):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 48, generator=g)
    x = torch.randn(5, 48, generator=g).to(dtype)
    packed, scale, s2 = quantize_nvfp4(w)
    y = nvfp4_linear_ref(x, packed, scale, s2)
    assert y.dtype == dtype and y.shape == (5, 24)
    expect = (x.float() @ dequantize_nvfp4(packed, scale, s2).T).to(dtype)
    assert torch.equal(y, expect)
    assert torch.equal(nvfp4_linear(x, packed, scale, s2), y)
    with pytest.raises(ValueError):
        nvfp4_linear_ref(torch.randn(5, 32), packed, scale, s2)


# ---------------------------------------------------------------------------------------------
# nvidia-modelopt itself


@pytest.fixture(scope="module")
def modelopt_nvfp4():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization.qtensor.nvfp4_tensor as mod
    return mod.NVFP4QTensor


def _modelopt_quantize(cls, w: torch.Tensor, global_amax: torch.Tensor | None = None):
    """ModelOpt on CPU: its weight_scale_2 division is the "exact" one."""
    s2 = None if global_amax is None else global_amax.float() / (6.0 * 448.0)
    q, scale, scale_2 = cls.quantize(w.clone(), 16, weights_scaling_factor_2=s2)
    return q._quantized_data, scale, scale_2.reshape(())


def _cases():
    g = torch.Generator().manual_seed(11)
    for i in range(60):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        n = int(torch.randint(1, 24, (), generator=g))
        k = 16 * int(torch.randint(1, 10, (), generator=g))
        w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, k, generator=g) * (i % 4))
        if i % 5 == 1:
            w[:, :16] = 0
        if i % 7 == 2:
            w[0, :16] *= 1e-6
        if i % 6 == 3:
            ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, 0.1, -0.1, -0.25, -0.75, -1.25, -5, -6, -0.0])
            exps = torch.randint(-6, 6, (n, k // 16), generator=g).repeat_interleave(16, 1)
            w = ties.repeat(n, k // 16) * 2.0**exps
        if dtype == torch.float16:
            w = w.clamp(-6e4, 6e4)
        w = w.to(dtype)
        if w.abs().max() == 0:
            w[0, 0] = 1  # ModelOpt turns an all-zero tensor into NaN (see test_all_zero_tensor...)
        yield w, (w.float().abs().max() * 1.3 if i % 4 == 3 else None)
    yield _edge_tensor(), None


def test_bit_exact_with_modelopt(modelopt_nvfp4):
    for w, ga in _cases():
        p_ref, s_ref, s2_ref = _modelopt_quantize(modelopt_nvfp4, w, ga)
        packed, scale, s2 = quantize_nvfp4(w, ga, scale_2_division="exact")
        assert torch.equal(packed, p_ref)
        assert torch.equal(scale.view(torch.uint8), s_ref.view(torch.uint8))
        assert torch.equal(s2, s2_ref)
        # and given the same weight_scale_2, the default mode is ModelOpt's too (this is the
        # CUDA case: ModelOpt on a GPU computes that weight_scale_2; checked there on an H200)
        packed, scale, s2 = quantize_nvfp4(w, ga)
        p_ref, s_ref, _ = _modelopt_quantize_s2(modelopt_nvfp4, w, s2)
        assert torch.equal(packed, p_ref)
        assert torch.equal(scale.view(torch.uint8), s_ref.view(torch.uint8))


def _modelopt_quantize_s2(cls, w, s2):
    q, scale, scale_2 = cls.quantize(w.clone(), 16, weights_scaling_factor_2=s2.clone())
    return q._quantized_data, scale, scale_2


def test_dequantize_matches_modelopt(modelopt_nvfp4):
    g = torch.Generator().manual_seed(12)
    w = torch.randn(16, 64, generator=g, dtype=torch.float32).to(torch.bfloat16)
    q, scale, s2 = modelopt_nvfp4.quantize(w.clone(), 16)
    expect = q.dequantize(dtype=torch.float32, scale=scale, double_scale=s2, block_sizes={-1: 16})
    assert torch.equal(dequantize_nvfp4(q._quantized_data, scale, s2), expect)
