"""The NVFP4 prefill linear through a dense GEMM (`ft.kernels.nvfp4.dequant_kernel`) under the
interpreter on CPU: the decode pass against the reference bit for bit, the linear against
`nvfp4_linear_ref`, and the dispatcher's choice by M and by the host scale."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

import ft.kernels.nvfp4 as nvfp4
from ft.kernels.nvfp4 import dequantize_nvfp4, nvfp4_linear, nvfp4_linear_ref
from ft.kernels.nvfp4.dequant_kernel import dequantize_nvfp4_triton, nvfp4_linear_dequant_mm
from ft.model.layers.linear import Linear, NVFP4Weight
from ft.tools.nvfp4_quantize import quantize_nvfp4


def _weight(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return quantize_nvfp4(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3)


@pytest.mark.parametrize(("n", "k"), [(33, 272), (64, 512), (8, 16)], ids=["ragged-k", "even-k", "one-block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_decode_pass_is_the_reference_bit_for_bit(n, k, dtype):
    packed, scale, _ = _weight(n, k, n * k)
    out = torch.full((n, k), float("nan"), dtype=dtype)
    got = dequantize_nvfp4_triton(packed, scale, dtype, out=out)
    assert got is out
    assert torch.equal(got, dequantize_nvfp4(packed, scale, 1.0, dtype))


def test_linear_matches_reference():
    packed, scale, scale_2 = _weight(40, 96, 1)
    x = torch.randn(24, 96, generator=torch.Generator().manual_seed(2))
    y = nvfp4_linear_dequant_mm(x, packed, scale, float(scale_2))
    ref = nvfp4_linear_ref(x, packed, scale, scale_2)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-5


def test_bad_inputs_raise():
    packed, scale, _ = _weight(16, 32, 3)
    with pytest.raises(ValueError):
        dequantize_nvfp4_triton(packed, scale[:, :1], torch.float32)
    with pytest.raises(ValueError):
        dequantize_nvfp4_triton(packed, scale.float(), torch.float32)
    with pytest.raises(ValueError):
        dequantize_nvfp4_triton(packed, scale, torch.float32, out=torch.empty(16, 16))


def test_dispatcher_takes_the_gemm_path_for_long_x_with_a_host_scale(monkeypatch):
    import ft.kernels.nvfp4.dequant_kernel as details

    calls = []
    real = details.nvfp4_linear_dequant_mm
    monkeypatch.setattr(details, "nvfp4_linear_dequant_mm", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    monkeypatch.setattr(nvfp4, "DEQUANT_MM_MIN_M", 8)
    packed, scale, scale_2 = _weight(16, 64, 4)
    gen = torch.Generator().manual_seed(5)
    long_x, short_x = torch.randn(8, 64, generator=gen), torch.randn(7, 64, generator=gen)
    for x, host in ((long_x, float(scale_2)), (short_x, float(scale_2)), (long_x, None)):
        y = nvfp4_linear(x, packed, scale, scale_2, host)
        ref = nvfp4_linear_ref(x, packed, scale, scale_2)
        assert ((y - ref).norm() / ref.norm()).item() < 1e-5
    assert calls == [8]  # only the long x with the host scale
    # the model's Linear passes the host value it read when the weight was made
    w = NVFP4Weight(packed, scale, scale_2)
    assert w.scale_2_host == float(scale_2)
    y = Linear(w)(long_x[None])
    assert calls == [8, 8] and y.shape == (1, 8, 16)
