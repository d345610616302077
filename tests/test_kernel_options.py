"""Kernel options as data (`ft.kernels.options`): named variants change exactly the fields they
name, unknown names and fields are refused, a block of options is put back on exit (an error
included), the dispatchers read the options in force, and no benchmark picks a kernel path by
overwriting a module global of `ft.kernels`."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from ft.kernels import options
from ft.kernels.options import DEFAULTS, VARIANTS, kernel_options, use_kernel_options, variant


def _fields(opts: options.KernelOptions) -> dict[str, object]:
    return {f"{g.name}.{f.name}": getattr(getattr(opts, g.name), f.name)
            for g in dataclasses.fields(opts) for f in dataclasses.fields(getattr(opts, g.name))}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_variant_changes_exactly_its_fields(name):
    before, after = _fields(DEFAULTS), _fields(variant(name))
    changed = {k for k in before if before[k] != after[k]}
    assert changed == set(VARIANTS[name]), name
    assert all(after[k] == v for k, v in VARIANTS[name].items())


def test_variants_compose_and_unknown_names_are_refused():
    both = variant("moe-bytes", "pdl", **{"moe.grouped_max_tokens": 8})
    assert both.moe == options.MoeOptions(grouped_words=False, grouped_max_tokens=8) and both.launch.pdl
    assert DEFAULTS.moe.grouped_words and not DEFAULTS.launch.pdl  # the defaults untouched (frozen)
    with pytest.raises(ValueError, match="no variant 'fast'"):
        variant("fast")
    with pytest.raises(ValueError, match="no option 'moe.grouped'"):
        variant(**{"moe.grouped": True})
    with pytest.raises(ValueError, match="no option 'nothing.here'"):
        DEFAULTS.with_(**{"nothing.here": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULTS.moe.grouped_words = False  # type: ignore[misc]


def test_a_models_choices_fill_only_the_fields_left_to_it():
    """`model_defaults`: a model's ("operation.field", value) pairs apply to fields that are None in force (the
    model's to choose), not over a value in force (a variant's); the same options object for the same options in
    force (cached: each forward asks); an unknown field is refused."""
    choices = (("nvfp4.dot_f16_x_max_m", 16), ("moe.grouped_max_tokens", 8))
    assert DEFAULTS.nvfp4.dot_f16_x_max_m is None
    got = options.model_defaults(choices)
    assert got.nvfp4.dot_f16_x_max_m == 16 and got.moe.grouped_max_tokens == DEFAULTS.moe.grouped_max_tokens
    assert options.model_defaults(choices) is got
    with use_kernel_options(variant("nvfp4-dot-bf16-x")):
        assert options.model_defaults(choices).nvfp4.dot_f16_x_max_m == 0
    with pytest.raises(ValueError, match="no option"):
        options.model_defaults((("nvfp4.nothing", None),))


def test_a_block_puts_the_options_back_even_on_an_error():
    assert kernel_options() is DEFAULTS
    with pytest.raises(RuntimeError):
        with use_kernel_options(variant("pdl")):
            assert kernel_options().launch.pdl
            raise RuntimeError("boom")
    assert kernel_options() is DEFAULTS


def test_the_dispatchers_read_the_options_in_force():
    """The grouped MoE's pass length (its workspace bound) and the NVFP4 GEMV's path follow the
    options when called, with nothing re-imported."""
    from ft.kernels.moe import moe_workspace_bytes
    from ft.kernels.nvfp4.kernel import _path

    full = moe_workspace_bytes(8192, 10, 2048, 512)
    with use_kernel_options(variant(**{"moe.grouped_max_tokens": 1024})):
        assert moe_workspace_bytes(8192, 10, 2048, 512) < full
    from ft.kernels.attention.split import decode_attention_splits

    assert decode_attention_splits(1, 2, 131072) == 128  # max_splits
    with use_kernel_options(variant(**{"decode_attention.max_splits": 64})):
        assert decode_attention_splits(1, 2, 131072) == 64
    assert _path(4, 2048, 2048) == "gemv"  # the whole-K GEMV at M 3..8 on these shapes
    with use_kernel_options(variant("nvfp4-tile-small-m")):
        assert _path(4, 2048, 2048) == "dot"
    from ft.kernels.moe.grouped_kernel import GROUPED_CONFIG, GROUPED_CONFIG_SHORT, grouped_config_for

    assert (grouped_config_for(1024), grouped_config_for(8192)) == (GROUPED_CONFIG_SHORT, GROUPED_CONFIG)
    tile = (64, 64, 64, 4, 4)
    with use_kernel_options(variant(**{"moe.grouped_tile": tile})):  # a sweep's one tile for every pass
        assert grouped_config_for(1024) == grouped_config_for(8192) == tile
    from ft.kernels.conv1d.kernel import conv_varlen_config
    from ft.kernels.gated_delta.chunk_kernel import prep_config, state_config

    conv, prep, state = conv_varlen_config(8192, 4), prep_config(128, 128, torch.bfloat16), \
        state_config(1, 32, 128, 128, torch.bfloat16)
    with use_kernel_options(variant(**{"conv1d.varlen_launch": (("BLOCK_C", 128), ("num_warps", 8)),
                                       "gated_delta.prep_launch": (("num_stages", 1),),
                                       "gated_delta.state_launch": (("BLOCK_V", 16), ("num_warps", 4))})):
        assert conv_varlen_config(8192, 4) == {**conv, "BLOCK_C": 128, "num_warps": 8}
        assert prep_config(128, 128, torch.bfloat16) == {**prep, "num_stages": 1}
        changed = state_config(1, 32, 128, 128, torch.bfloat16)
        assert (changed["BLOCK_V"], changed["num_warps"], changed["EVEN_V"]) == (16, 4, True) != \
            (state["BLOCK_V"], state["num_warps"], state["EVEN_V"])
    assert conv_varlen_config(8192, 4) == conv  # put back


def test_no_benchmark_overwrites_a_kernel_global():
    bench = Path(__file__).resolve().parents[1] / "bench"
    found = []
    for path in sorted(bench.glob("*.py")):
        text = path.read_text()
        aliases = dict(re.findall(r"^\s*import (ft\.kernels\.[\w.]+) as (\w+)", text, re.M))
        aliases.update({alias: mod for mod, alias in re.findall(r"^\s*from (ft\.kernels[\w.]*) import (\w+)", text, re.M)})
        names = set(aliases.values()) | {alias for alias in re.findall(r"import ft\.kernels\.[\w.]+ as (\w+)", text)}
        for alias, attr in re.findall(r"^\s*(\w+)\.(\w+)\s*=[^=]", text, re.M):  # constants and functions alike
            if alias in names:
                found.append(f"{path.name}: {alias}.{attr}")
    assert not found, found


def test_pdl_stays_off_on_the_cpu_whatever_the_options():
    """On the CPU the options pick nothing CUDA-only: PDL stays off whatever the options say."""
    from ft.kernels.pdl import pdl_on

    with use_kernel_options(variant("pdl")):
        assert not pdl_on(torch.device("cpu"))
