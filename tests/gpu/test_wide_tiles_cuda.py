"""The NVFP4 ``tl.dot`` tiles' widths by option on the GPU (`Nvfp4Options.dot_small_m_tile` at 3-16 rows,
`dot_mid_m_tile` at 17-64): at both models' decode shapes, the launch takes the option's tile and y stays as close
to the reference as the default tile's (bf16 x, and fp16 rows as Flash-Next takes them at these rows)."""

from __future__ import annotations

import pytest
import torch

from ft.kernels.nvfp4 import nvfp4_linear_ref
from ft.kernels.nvfp4 import kernel as nv
from ft.kernels.nvfp4.kernel import dot_launch_config, nvfp4_linear_triton
from ft.kernels.options import use_kernel_options, variant
from gpu.test_split_k_cuda import random_nvfp4, rel_rms

pytestmark = pytest.mark.gpu

DEV = "cuda"
SHAPES = {"in_proj_qkvz": (12288, 2048), "attn_q": (8192, 2048), "fn_qkvz": (16384, 2560), "fn_attn_qkv": (13312, 2560)}
SMALL_TILES = [(128, 128, 4, 3), (64, 256, 4, 3), (128, 64, 4, 4)]
MID_TILES = [(64, 128, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3)]


def check_tile(option: str, tile: tuple, shape: str, m: int, f16_rows: bool) -> None:
    n, k = SHAPES[shape]
    torch.manual_seed(m + n)
    packed, scale, s2 = random_nvfp4(n, k)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    ref = nvfp4_linear_ref(x, packed, scale, s2)
    rows = {"nvfp4.dot_f16_x_max_m": 64} if f16_rows else {}
    with use_kernel_options(variant(**rows)):
        plain = nvfp4_linear_triton(x, packed, scale, s2)
    with use_kernel_options(variant(**rows, **{option: tile})):
        cfg = dot_launch_config(x, packed)
        y = nvfp4_linear_triton(x, packed, scale, s2)
    if option.endswith("small_m_tile"):  # (these shapes' grids are never thin enough to split K at 16 rows)
        taken = cfg["SPLIT_K"] == 1
    else:  # the option gives way where its grid would be thin, as the defaults' wide tile does
        taken = -(-m // (32 if m <= 32 else 64)) * -(-n // tile[0]) >= nv.MID_M_MIN_PROGRAMS
    assert taken == ((cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], cfg["num_stages"]) == tile)
    assert rel_rms(y, ref) < 1e-2 and rel_rms(y, ref) < 2 * rel_rms(plain, ref) + 1e-3


CASES = [("nvfp4.dot_small_m_tile", tile, m) for tile in SMALL_TILES for m in (3, 8, 16)] + \
    [("nvfp4.dot_mid_m_tile", tile, m) for tile in MID_TILES for m in (17, 32, 64)]
"""(option, tile, rows of x): the 16-row tile's widths at 3-16 rows, the mid-M tiles' at 17-64."""


@pytest.mark.parametrize("f16_rows", [False, True], ids=["bf16-x", "fp16-rows"])
@pytest.mark.parametrize("option, tile, m", CASES, ids=[f"{o.split('.')[1]}-{t}-M{m}" for o, t, m in CASES])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_a_width_option_at_the_decode_shapes(shape, option, tile, m, f16_rows):
    check_tile(option, tile, shape, m, f16_rows)
