"""The L2 prefetch hints (`ft.kernels.prefetch`) on the GPU: hints, so the results are bit for bit those without them.
The NVFP4 tiles' (`Nvfp4Options.dot_prefetch_l2`: each program asks for its weight and scale rows before its K loop)
at both models' decode shapes, K whole and split, bf16 x and the fp16 rows, in a CUDA graph too, and taken where
asked for; the decode MoE's gate/up look-ahead (`MoeOptions.decode_prefetch_ahead`) at Qwen3.8-Flash-Next's expert
shape (two whole-K tiles) and the 80B's, with the shared expert, slots past the pool's first and padding rows."""

from __future__ import annotations

import pytest
import torch

import ft.kernels.nvfp4.kernel as nv
from ft.kernels.nvfp4.kernel import nvfp4_linear_triton
from ft.kernels.moe import SlotWeights
from ft.kernels.moe.decode_kernel import moe_decode_triton
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


@pytest.mark.parametrize("batch", [2, 8, 32])
@pytest.mark.parametrize("hidden, inter", [(2560, 640), (2048, 512)], ids=["flash-next", "80b"])
def test_the_moe_look_ahead_leaves_y_as_it_was(hidden, inter, batch, monkeypatch):
    torch.manual_seed(hidden + batch)
    slots, top_k = 96, 10
    w13, s13, _ = random_nvfp4(2 * inter, hidden, (slots,))
    w2, s2w, _ = random_nvfp4(hidden, inter, (slots,))
    pool = SlotWeights(w13, w2, s13, s2w, torch.empty(slots, 3, device=DEV).uniform_(0.005, 0.02))
    shared = SlotWeights(*(t[:1].clone() for t in pool))
    x = torch.randn(batch, hidden, device=DEV, dtype=torch.bfloat16)
    topk = torch.stack([torch.randperm(slots, device=DEV)[:top_k] for _ in range(batch)]).to(torch.int32)
    topk[0, :3] = -1  # (pairs without a slot: skipped, nothing asked for)
    weights = torch.cat([torch.softmax(torch.randn(batch, top_k, device=DEV), -1),
                         torch.rand(batch, 1, device=DEV)], dim=1).to(torch.bfloat16)
    live = torch.arange(batch, device=DEV)
    live[-1] = -1  # a padding row
    y = moe_decode_triton(x, topk, weights, pool, shared, live=live)
    import ft.kernels.moe.decode_kernel as md

    seen = {}
    for name in ("_moe_decode_gate_up_kernel", "_moe_decode_down_pairs_kernel"):
        monkeypatch.setattr(md, name, _spy(getattr(md, name), seen.setdefault(name, [])))
    with use_kernel_options(variant("moe-decode-prefetch-ahead", "moe-decode-down-prefetch-ahead")):
        y_ahead = moe_decode_triton(x, topk, weights, pool, shared, live=live)
    assert all(s and all(a > 0 for a in s) for s in seen.values())
    assert torch.equal(y_ahead, y)


def _spy(kernel, seen: list):
    """A stand-in for a Triton kernel that records each launch's AHEAD, then launches it."""
    return type("Spy", (), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: seen.append(kw["AHEAD"]) or kernel[grid](*a, **kw))})()
