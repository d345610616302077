"""Programmatic dependent launch (`ft.kernels.pdl`) stays off where it cannot run: on the CPU (and in
Triton's interpreter) no launch gets the option or the constexpr, whatever the switch says; the
kernels' sm_90 compile with it on is tests/compile_kernels_sm90.py's (the wait must be in the PTX),
the device's bitwise check tests/gpu/test_decode_graphs_cuda.py's."""

from __future__ import annotations

import torch

import ft.kernels.pdl as pdl


def test_no_pdl_off_cuda_even_when_asked():
    from ft.kernels.options import kernel_options, use_kernel_options, variant

    assert kernel_options().launch.pdl is False  # off by default until measured on the device
    assert pdl.pdl_args(torch.device("cpu")) == {}
    with use_kernel_options(variant("pdl")):
        assert kernel_options().launch.pdl
        assert pdl.pdl_args(torch.device("cpu")) == {} and not pdl.pdl_on(torch.device("cpu"))
    assert kernel_options().launch.pdl is False
