"""Programmatic dependent launch (`ft.kernels.pdl`) stays off where it cannot run: on the CPU (and in
Triton's interpreter) no launch gets the option or the constexpr, whatever the switch says; the
kernels' sm_90 compile with it on is tests/compile_kernels_sm90.py's (the wait must be in the PTX),
the device's bitwise check tests/gpu/test_decode_graphs_cuda.py's."""

from __future__ import annotations

import torch

import ft.kernels.pdl as pdl


def test_no_pdl_off_cuda_even_when_asked():
    from ft.kernels.options import kernel_options, use_kernel_options, variant

    assert kernel_options().launch.pdl is None  # by default: only inside the graphs of a model that chooses it
    assert pdl.pdl_args(torch.device("cpu")) == {}
    with use_kernel_options(variant("pdl")):
        assert kernel_options().launch.pdl
        assert pdl.pdl_args(torch.device("cpu")) == {} and not pdl.pdl_on(torch.device("cpu"))
    assert kernel_options().launch.pdl is None


def test_decode_graphs_capture_with_pdl_only_where_the_model_chooses_it():
    """`DecodeGraphs.capture_launch`: PDL in force around a capture when the model's graphs take it and
    `LaunchOptions.pdl` is None; a variant that says True or False wins; a model without it captures with
    the options as they are. The models say which (measured, `LaunchOptions`)."""
    from ft.engine.worker.decode_graphs import DecodeGraphs
    from ft.kernels.options import kernel_options, use_kernel_options, variant
    from ft.model.qwen3_8_flash_next import FlashNextModel
    from ft.model.qwen3_next import Qwen3NextModel

    assert FlashNextModel.decode_graph_pdl and not Qwen3NextModel.decode_graph_pdl
    for chooses, options, want in ((True, variant(), True), (True, variant("no-pdl"), False),
                                   (True, variant("pdl"), True), (False, variant(), None),
                                   (False, variant("pdl"), True), (False, variant("no-pdl"), False)):
        with use_kernel_options(options):
            with DecodeGraphs(8, pdl=chooses).capture_launch():
                assert kernel_options().launch.pdl is want, (chooses, options.launch)
            assert kernel_options() is options  # put back after the capture
    assert kernel_options().launch.pdl is None
