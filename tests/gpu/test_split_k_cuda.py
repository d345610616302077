"""The split-K ``tl.dot`` tile (`Nvfp4Options.dot_split_k`, variants "nvfp4-dot-split-k-2" / "-4") on the GPU at
the 80B's decode shapes past 16 rows, and the 16-row tile's (`dot_split_k_small_m`: 4 by default,
"nvfp4-dot-split-k-small-m-2") at 3-16 rows on the thin-grid shapes it takes (out_proj, Flash-Next's out_proj /
o_proj): against the reference, the same bits from run to run and inside a CUDA graph (the tile's last program
sums the partials in split order, whichever program arrives last), and the tickets' counters zero after every
launch."""

from __future__ import annotations

import pytest
import torch

from ft.kernels.nvfp4 import nvfp4_linear_ref
from ft.kernels.nvfp4.kernel import dot_launch_config, nvfp4_linear_triton
from ft.kernels.tickets import ticket_counters
from ft.kernels.options import use_kernel_options, variant

pytestmark = pytest.mark.gpu

DEV = "cuda"
SHAPES = {"in_proj_qkvz": (12288, 2048), "attn_q": (8192, 2048), "out_proj": (2048, 4096), "expert_down": (2048, 512)}


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_nvfp4(n: int, k: int):
    """Any code byte, block scales 2**U{-3..3}, scale_2 0.01 (as tests/gpu/test_kernels_cuda.py)."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV)
    scale = torch.exp2(torch.randint(-3, 4, (n, k // 16), device=DEV).float()).to(torch.float8_e4m3fn)
    return packed, scale, torch.tensor(0.01, device=DEV)


SMALL_M_SHAPES = {"out_proj": (2048, 4096), "fn_out_proj": (2560, 6144)}


@pytest.mark.parametrize("splits", ["nvfp4-dot-split-k-2", "nvfp4-dot-split-k-4"])
@pytest.mark.parametrize("m", [17, 32, 48, 64])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_split_k_against_the_reference_and_itself(shape, m, splits):
    check_split(*SHAPES[shape], m, splits, unsplit="nvfp4-dot-no-split-k")


@pytest.mark.parametrize("splits", ["nvfp4-dot-split-k-small-m-2", None], ids=["split-2", "default-split-4"])
@pytest.mark.parametrize("m", [3, 8, 16])
@pytest.mark.parametrize("shape", list(SMALL_M_SHAPES), ids=list(SMALL_M_SHAPES))
def test_small_m_split_k_against_the_reference_and_itself(shape, m, splits):
    check_split(*SMALL_M_SHAPES[shape], m, splits, unsplit="nvfp4-dot-no-split-k-small-m")


def check_split(n: int, k: int, m: int, splits: str | None, unsplit: str) -> None:
    """The variant's y (None: the defaults') against the reference (within twice the error of the unsplit kernel,
    variant `unsplit`), bit for bit the same in three more launches and in three replays of a CUDA
    graph, the counters zero after each."""
    torch.manual_seed(m)
    packed, scale, s2 = random_nvfp4(n, k)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    ref = nvfp4_linear_ref(x, packed, scale, s2)
    with use_kernel_options(variant(unsplit)):
        assert dot_launch_config(x, packed)["SPLIT_K"] == 1
        plain = nvfp4_linear_triton(x, packed, scale, s2)
    with use_kernel_options(variant(*[splits] if splits else [])):
        assert dot_launch_config(x, packed)["SPLIT_K"] > 1  # (the variant splits this shape)
        y = nvfp4_linear_triton(x, packed, scale, s2)
        again = [nvfp4_linear_triton(x, packed, scale, s2) for _ in range(3)]
        torch.cuda.synchronize()
        assert not ticket_counters(x.device, 1).any()
        out = torch.empty_like(y)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            nvfp4_linear_triton(x, packed, scale, s2, out=out)
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, y)
    assert rel_rms(y, ref) < 1e-2 and rel_rms(y, ref) < 2 * rel_rms(plain, ref) + 1e-3
    assert all(torch.equal(a, y) for a in again) and not ticket_counters(x.device, 1).any()
