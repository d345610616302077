"""The NVFP4 tile's fp16 form for bf16 models (`Nvfp4Options.dot_f16_x_max_m`, Qwen3.8-Flash-Next's choice, 64 rows)
on the GPU at both models' decode shapes: `f16_rows` bit for bit its torch reference; y against the reference; y bit for
bit the fp16 tile's on x made fp16 (the inline PTX of `e2m1_halves_f16_scaled` against `e2m1_halves_f16`'s, the
same products scaled by powers of two); a row past fp16's range as close."""

from __future__ import annotations

import pytest
import torch

from ft.kernels.nvfp4 import nvfp4_linear_ref
from ft.kernels.nvfp4.f16_rows import f16_rows, f16_rows_ref
from ft.kernels.nvfp4.kernel import nvfp4_linear_triton
from ft.kernels.options import use_kernel_options, variant
from ft.model.qwen3_8_flash_next import FlashNextModel
from gpu.test_kernels_cuda import random_nvfp4, rel_rms

pytestmark = pytest.mark.gpu

DEV = "cuda"
SHAPES = {"fn_in_proj_qkvz": (16384, 2560), "fn_out_proj": (2560, 6144), "in_proj_qkvz": (12288, 2048),
          "out_proj": (2048, 4096)}

FLASH_NEXT_F16_ROWS = dict(FlashNextModel.kernel_defaults)
"""The fp16 rows as Qwen3.8-Flash-Next chooses them (`Nvfp4Options.dot_f16_x_max_m`)."""


def test_f16_rows_match_the_reference_on_the_gpu():
    x = torch.randn(16, 6144, device=DEV)
    x[1] *= 3e6
    x[2] *= 1e-9
    x[3] = 0
    x = x.to(torch.bfloat16)
    y, s = f16_rows(x)
    y_ref, s_ref = f16_rows_ref(x.cpu())
    assert torch.equal(y.cpu(), y_ref) and torch.equal(s.cpu(), s_ref)


@pytest.mark.parametrize("m", [3, 8, 16, 32, 48, 64])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_the_fp16_tile_of_a_bf16_model_matches(shape, m):
    n, k = SHAPES[shape]
    torch.manual_seed(n + k + m)
    packed, scale, scale_2 = random_nvfp4(n, k)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    ref = nvfp4_linear_ref(x.float(), packed, scale, scale_2)
    with use_kernel_options(variant(**FLASH_NEXT_F16_ROWS)):
        y = nvfp4_linear_triton(x, packed, scale, scale_2, path="dot")
        y16 = torch.empty_like(y)
        nvfp4_linear_triton(x.half(), packed, scale, scale_2, path="dot", out=y16)
        assert torch.equal(y, y16)
        assert rel_rms(y, ref) < 1e-2
        huge = x.clone()
        huge[0] *= 1e6
        y_huge = nvfp4_linear_triton(huge, packed, scale, scale_2, path="dot")
        assert torch.isfinite(y_huge).all()
        assert rel_rms(y_huge, nvfp4_linear_ref(huge.float(), packed, scale, scale_2)) < 1e-2
    with use_kernel_options(variant("nvfp4-dot-bf16-x")):
        plain = nvfp4_linear_triton(x, packed, scale, scale_2, path="dot")
    assert rel_rms(plain, ref) < 1e-2
