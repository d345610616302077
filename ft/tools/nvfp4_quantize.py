"""NVFP4 weight quantization, NVIDIA ModelOpt's algorithm bit for bit (an offline tool: the
engine only dequantizes; the format is described in `ft.kernels.nvfp4.reference`).

Format, per weight W [N, K] with K % 16 == 0:

* ``packed`` uint8 [N, K/2]: one 4-bit E2M1 code per element, element ``2j`` in the LOW nibble
  and element ``2j + 1`` in the HIGH nibble of byte ``j``. Code bit 3 is the sign; bits 0..2
  index the magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6) (see `E2M1_VALUES`).
* ``scale`` float8_e4m3fn [N, K/16]: one scale per block of 16 consecutive elements of a row.
* ``scale_2`` float32 0-dim: the per-tensor scale (ModelOpt's ``weight_scale_2``).

``W[n, k] ~= e2m1(code[n, k]) * float(scale[n, k // 16]) * scale_2``.

`quantize_nvfp4` reproduces ModelOpt's ``NVFP4QTensor.quantize`` (nvidia-modelopt 0.47,
``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``) bit for bit, op for op in float32:

1. ``scale_2 = amax(|W|).float() / 2688.0`` (2688 = 6 * 448), or ``global_amax.float() / 2688.0``
   (see "scale_2 division" below for how that division rounds).
2. ``s = block_amax.float() / (6.0 * scale_2)``; ``s[s == 0] = 1.0``;
   ``s = s.clamp(2**-9, 448).to(float8_e4m3fn)`` (round to nearest, ties to even).
3. ``x = W.float() / (s.float() * scale_2)`` (the product is rounded to float32 first).
4. E2M1 rounding of ``x``: round to the nearest E2M1 magnitude, ties to the EVEN code; the ties
   |x| = 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to the values 0, 1, 1, 2, 2, 4, 4 (codes 0, 2, 2,
   4, 4, 6, 6), and any |x| > 5 gives 6 (code 7): values above 6 saturate. The sign bit is set iff ``x < 0``: -0.0 gives code 0x0, while a
   small negative value that rounds to zero gives 0x8 (negative zero). ModelOpt's ``_cast_fp4``
   does this as ``searchsorted(bounds=[.25, .75, 1.25, 1.75, 2.5, 3.5, 5], |x|)`` plus one where
   ``|x|`` equals 0.75, 1.75 or 3.5; this module computes the same codes with comparisons.

scale_2 division. ModelOpt divides a float32 tensor by the Python number 2688.0, and PyTorch
rounds that differently per device: on CPU it is a correctly rounded division, on CUDA it is a
multiplication by the float32 reciprocal ``fl32(1/2688)`` (PyTorch's ``div_true_kernel_cuda``
does this for a CPU-scalar divisor). The two differ by one ulp for about one amax in five, and
that ulp can change block scales and codes. Every ModelOpt checkpoint made on a GPU has the
reciprocal form, so that is the default here (``scale_2_division="reciprocal"``);
``scale_2_division="exact"`` gives what ModelOpt computes on a CPU. Either way this module's
result does not depend on the device it runs on (the scalar is a tensor operand here).

One deliberate difference: ModelOpt turns an all-zero tensor (amax 0, so scale_2 = 0) into NaN
block scales and codes 0x7. Here an all-zero tensor gives codes 0, block scales 1.0 and
``scale_2 = 0``, which dequantizes to exact zeros; so does a tensor so small that scale_2
underflows float32 (amax below ~4e-42).
"""

from __future__ import annotations

import torch

from ft.kernels.nvfp4.reference import BLOCK_SIZE, E2M1_MAX, E4M3_MAX, device_table, as_scalar_f32

__all__ = ["quantize_nvfp4"]

# (bound, tie rounds up): a magnitude m moves one code up past bound b when m > b, or when
# m >= b for the bounds whose upper neighbour has the even code (0.75, 1.75, 3.5).
_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_SCALE_MIN = 2.0**-9  # smallest positive float8_e4m3fn (subnormal)
_SCALE_2_DIVISIONS = ("reciprocal", "exact")
_6_448 = torch.tensor(E2M1_MAX * E4M3_MAX, dtype=torch.float32)  # 2688, exact
_INV_6_448 = torch.tensor(1.0, dtype=torch.float32) / _6_448  # fl32(1/2688), as CUDA's div uses


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 tensor (already divided by its scales) -> uint8 E2M1 codes 0..15, same shape.

    Same result as ModelOpt's ``searchsorted(E2M1_BOUNDS, |x|) + (|x| in {0.75, 1.75, 3.5})``
    for every input, NaN included (NaN -> 7, like searchsorted). Counted down from 7 with
    ``<=`` / ``<`` comparisons, which are false for NaN; cheaper than searchsorted on CPU.
    """
    mag = x.abs()
    codes = torch.full(x.shape, 7, dtype=torch.uint8, device=x.device)
    for bound, tie_up in _STEPS:
        below = (mag < bound) if tie_up else (mag <= bound)
        codes -= below.view(torch.uint8)
    codes |= (x < 0).view(torch.uint8) << 3
    return codes


def quantize_nvfp4(
    w: torch.Tensor,
    global_amax: torch.Tensor | float | None = None,
    *,
    scale_2_division: str = "reciprocal",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a weight to NVFP4 exactly as ModelOpt does (see the module docstring).

    Args:
        w: [N, K] float32, bfloat16 or float16, K % 16 == 0.
        global_amax: optional scalar (tensor or float) used instead of ``amax(|w|)`` for
            ``weight_scale_2``; ModelOpt uses the max over a group of fused projections (q/k/v,
            gate/up) so that they share one ``weight_scale_2``. It should be >= amax(|w|).
        scale_2_division: "reciprocal" (default): ``amax * fl32(1/2688)``, as ModelOpt computes
            on CUDA; "exact": ``fl32(amax / 2688)``, as ModelOpt computes on CPU.

    Returns:
        (packed uint8 [N, K/2] with element 2j in the low nibble of byte j,
         scale float8_e4m3fn [N, K/16],
         weight_scale_2 float32 0-dim tensor), all on w's device.

    Raises:
        ValueError: w is not 2-D, not a float16/bfloat16/float32 tensor, K % 16 != 0, or
            weight_scale_2 is 0 while w is not all zeros, or scale_2_division is unknown.
    """
    if scale_2_division not in _SCALE_2_DIVISIONS:
        raise ValueError(f"scale_2_division must be 'reciprocal' or 'exact', got {scale_2_division!r}")
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"quantize_nvfp4 needs a 2-D tensor [N, K], got shape {tuple(getattr(w, 'shape', ()))}")
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_nvfp4 needs float32, bfloat16 or float16, got {w.dtype}")
    n, k = w.shape
    if k % BLOCK_SIZE != 0:
        raise ValueError(f"quantize_nvfp4 needs K % {BLOCK_SIZE} == 0, got K = {k}")
    device = w.device
    if n == 0 or k == 0:
        return (
            torch.empty((n, k // 2), dtype=torch.uint8, device=device),
            torch.empty((n, k // BLOCK_SIZE), dtype=torch.float8_e4m3fn, device=device),
            torch.zeros((), dtype=torch.float32, device=device),
        )

    blocks = w.reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    # amax in w's own dtype (exact: a max of values), then float32, like ModelOpt's reduce_amax.
    if global_amax is None:
        amax = torch.maximum(w.max().abs(), w.min().abs()).float()
    else:
        amax = as_scalar_f32(global_amax, device)
    if scale_2_division == "reciprocal":
        scale_2 = amax * device_table(_INV_6_448, device)
    else:
        scale_2 = amax / device_table(_6_448, device)

    if scale_2 == 0:
        # amax 0 with a nonzero weight: a wrong global_amax. amax > 0 whose scale_2 underflows
        # float32 (every |w| < ~4e-42): below what NVFP4 can represent, quantized to zeros.
        if amax == 0 and bool((w != 0).any()):
            raise ValueError("weight_scale_2 is 0 (global_amax 0) but the weight is not all zeros")
        return (
            torch.zeros((n, k // 2), dtype=torch.uint8, device=device),
            torch.ones((n, k // BLOCK_SIZE), dtype=torch.float32, device=device).to(torch.float8_e4m3fn),
            scale_2,
        )

    block_amax = torch.maximum(blocks.amax(dim=-1).abs(), blocks.amin(dim=-1).abs()).float()
    block_scale = block_amax / (E2M1_MAX * scale_2)
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    scale = block_scale.clamp(min=_SCALE_MIN, max=E4M3_MAX).to(torch.float8_e4m3fn)

    divisor = scale.to(torch.float32) * scale_2  # rounded to float32 before the division
    x = blocks.to(torch.float32) / divisor.unsqueeze(-1)
    codes = _e2m1_codes(x).reshape(n, k)
    packed = (codes[:, 1::2] << 4) | codes[:, 0::2]
    return packed.contiguous(), scale, scale_2
