"""The NVFP4 tiles' L2 prefetch (`Nvfp4Options.dot_prefetch_l2`: each program asks L2 for its weight and scale rows
before its K loop) on the GPU: a hint, so y is bit for bit the tile's without it, at both models' decode shapes, with
K whole and split, bf16 x and the fp16 rows; inside a CUDA graph too; and it is taken where it is asked for."""

from __future__ import annotations

import pytest
import torch

import ft.kernels.nvfp4.kernel as nv
from ft.kernels.nvfp4.kernel import nvfp4_linear_triton
from ft.kernels.options import use_kernel_options, variant
from ft.model.qwen3_8_flash_next import FlashNextModel
from gpu.test_kernels_cuda import random_nvfp4

pytestmark = pytest.mark.gpu

DEV = "cuda"
SHAPES = {"fn_in_proj_qkvz": (16384, 2560), "fn_out_proj": (2560, 6144), "in_proj_qkvz": (12288, 2048),
          "out_proj": (2048, 4096), "odd_rows": (1000, 2048)}


@pytest.mark.parametrize("fp16_rows", [False, True], ids=["bf16-x", "fp16-rows"])
@pytest.mark.parametrize("m", [3, 8, 16, 32, 64])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_the_prefetch_leaves_y_as_it_was(shape, m, fp16_rows, monkeypatch):
    n, k = SHAPES[shape]
    torch.manual_seed(n + k + m)
    packed, scale, scale_2 = random_nvfp4(n, k)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    base = dict(FlashNextModel.kernel_defaults) if fp16_rows else {}
    with use_kernel_options(variant(**base)):
        y = nvfp4_linear_triton(x, packed, scale, scale_2, path="dot")
    seen = []
    real = nv._nvfp4_dot_kernel
    monkeypatch.setattr(nv, "_nvfp4_dot_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (lambda *a, **kw: seen.append(kw["PREFETCH"]) or real[grid](*a, **kw))})())
    with use_kernel_options(variant("nvfp4-dot-prefetch-l2", **base)):
        y_pf = nvfp4_linear_triton(x, packed, scale, scale_2, path="dot")
        g = torch.cuda.CUDAGraph()
        out = torch.empty_like(y)
        with torch.cuda.graph(g):
            nvfp4_linear_triton(x, packed, scale, scale_2, path="dot", out=out)
        g.replay()
        torch.cuda.synchronize()
    assert seen and all(seen)
    assert torch.equal(y_pf, y) and torch.equal(out, y)
