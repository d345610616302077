"""NVFP4 weights (NVIDIA ModelOpt layout): the format, and torch reference dequantization and
linear.

Format, per weight W [N, K] with K % 16 == 0:

* ``packed`` uint8 [N, K/2]: one 4-bit E2M1 code per element, element ``2j`` in the LOW nibble
  and element ``2j + 1`` in the HIGH nibble of byte ``j``. Code bit 3 is the sign; bits 0..2
  index the magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6) (see `E2M1_VALUES`).
* ``scale`` float8_e4m3fn [N, K/16]: one scale per block of 16 consecutive elements of a row.
* ``scale_2`` float32 0-dim: the per-tensor scale (ModelOpt's ``weight_scale_2``).

``W[n, k] ~= e2m1(code[n, k]) * float(scale[n, k // 16]) * scale_2``.

The quantizer (ModelOpt's algorithm, bit for bit) is an offline tool: `ft.tools.nvfp4_quantize`.
"""

from __future__ import annotations

import torch

__all__ = [
    "BLOCK_SIZE", "E2M1_BOUNDS", "E2M1_MAX", "E2M1_VALUES", "E4M3_MAX", "as_scalar_f32", "dequantize_nvfp4",
    "dequantize_nvfp4_rows", "device_table", "nvfp4_linear_ref",
]

BLOCK_SIZE = 16
"""Elements per block scale (NVFP4 ``group_size``)."""

E2M1_MAX = 6.0
"""Largest E2M1 magnitude."""

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
"""The value of each E2M1 code 0..15 (float32 [16]); code 8 is negative zero."""

E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
"""Midpoints between consecutive E2M1 magnitudes (float32 [7])."""


_TABLES_ON_DEVICE: dict[tuple[int, torch.device], torch.Tensor] = {}


def device_table(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A module constant on `device`, copied there once."""
    if t.device == device:
        return t
    key = (id(t), device)
    cached = _TABLES_ON_DEVICE.get(key)
    if cached is None:
        cached = _TABLES_ON_DEVICE[key] = t.to(device)
    return cached


def as_scalar_f32(v: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(v, device=device)
    if t.numel() != 1:
        raise ValueError(f"expected a scalar, got a tensor of shape {tuple(t.shape)}")
    return t.reshape(()).to(device=device, dtype=torch.float32)


_BYTES = torch.arange(256, dtype=torch.int64)
_PAIR_VALUES = torch.stack((E2M1_VALUES[_BYTES & 0x0F], E2M1_VALUES[_BYTES >> 4]), dim=-1)
"""float32 [256, 2]: the (low nibble, high nibble) values of each packed byte."""
_PAIR_WORDS = _PAIR_VALUES.contiguous().view(torch.int64).reshape(256)
"""`_PAIR_VALUES` a byte as one int64 (its two float32 values' bits, in memory order)."""


def _element_values(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> float32 [..., K]: each byte's two E2M1 values, low nibble first. The pair
    table is read as one 64-bit word a byte (`index_select` of scalars over int32 codes: ~8x faster on
    the CPU than indexing the [256, 2] table with int64 codes, the same bits)."""
    words = device_table(_PAIR_WORDS, packed.device).index_select(0, packed.reshape(-1).to(torch.int32))
    return words.view(torch.float32).view(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_nvfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    scale_2: torch.Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """NVFP4 -> dense weight [N, K] in ``dtype``.

    Args:
        packed: uint8 [N, K/2], element 2j in the low nibble of byte j.
        scale: float8_e4m3fn (or any float dtype) [N, K/16] block scales.
        scale_2: the per-tensor scale, a one-element tensor or a float.
        dtype: the output dtype.

    Value = e2m1(code) * (float32(scale) * scale_2), computed in float32 (the product of the two
    scales is rounded to float32 first, as in ModelOpt's ``NVFP4QTensor.dequantize``), then cast.
    """
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    n, half_k = packed.shape
    k = half_k * 2
    if k % BLOCK_SIZE != 0 or tuple(scale.shape) != (n, k // BLOCK_SIZE):
        raise ValueError(
            f"scale must be [N, K/16] = [{n}, {k // BLOCK_SIZE}] for packed {tuple(packed.shape)}, "
            f"got {tuple(scale.shape)} (K = {k} must be a multiple of {BLOCK_SIZE})"
        )
    device = packed.device
    block = scale.to(torch.float32) * as_scalar_f32(scale_2, device)
    out = _element_values(packed).view(n, k // BLOCK_SIZE, BLOCK_SIZE).mul_(block.unsqueeze(-1))
    return out.view(n, k).to(dtype)


def dequantize_nvfp4_rows(
    packed: torch.Tensor, scale: torch.Tensor, row_scale_2: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Batched NVFP4 -> dense with a global scale per row: packed [..., N, K/2], scale [..., N, K/16],
    row_scale_2 [..., N] float32 -> [..., N, K]. Same values as `dequantize_nvfp4` row by row."""
    *lead, n, half_k = packed.shape
    k = half_k * 2
    block = scale.to(torch.float32) * row_scale_2.to(torch.float32).unsqueeze(-1)  # [..., N, K/16]
    out = _element_values(packed).view(*lead, n, k // BLOCK_SIZE, BLOCK_SIZE).mul_(block.unsqueeze(-1))
    return out.view(*lead, n, k).to(dtype)


def nvfp4_linear_ref(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | float
) -> torch.Tensor:
    """y = x @ dequantize(W).T: x [M, K], W NVFP4 [N, K] -> y [M, N] in x's dtype.

    The matmul runs in float32 (x upcast, W dequantized to float32); the result is cast to
    x's dtype.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if x.shape[1] != packed.shape[1] * 2:
        raise ValueError(f"x has K = {x.shape[1]} but the weight has K = {packed.shape[1] * 2}")
    w = dequantize_nvfp4(packed, scale, scale_2, torch.float32)
    return (x.to(torch.float32) @ w.T).to(x.dtype)
