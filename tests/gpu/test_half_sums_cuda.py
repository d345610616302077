"""The fp16 block sums (`Nvfp4Options.half_sums`, on by default) on the GPU: the inline PTX
of `pair_half_sum` against its Triton stand-in and the exact sums, the decode MoE (their one user, from two
tokens) at both models' shapes against the reference, and an x row past `HALF_SUM_LIMIT` (scaled by a power of
two) finite and as close."""

from __future__ import annotations

import pytest
import torch

from ft.kernels.moe import SlotWeights, moe_decode_ref
from ft.kernels.moe.decode_kernel import moe_decode_triton
from ft.kernels.nvfp4.decode import HALF_SUM_LIMIT
from ft.kernels.options import use_kernel_options, variant

pytestmark = pytest.mark.gpu

DEV = "cuda"
HALF = variant(**{"nvfp4.half_sums": True})  # (the default, named)
NO_HALF = variant("nvfp4-no-half-sums")


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_nvfp4(n: int, k: int, lead: tuple = ()):
    """Any code byte, block scales 2**U{-3..3}, scale_2 0.01 (as tests/gpu/test_kernels_cuda.py)."""
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=DEV)
    scale = torch.exp2(torch.randint(-3, 4, (*lead, n, k // 16), device=DEV).float()).to(torch.float8_e4m3fn)
    return packed, scale, (torch.full((*lead, 3), 0.01, device=DEV) if lead else torch.tensor(0.01, device=DEV))


def moe_case(hidden: int, inter: int, batch: int):
    """A decode MoE block's inputs at a model's shapes: 64 random experts (so that top-10 reads each one by
    several tokens), a shared expert, bf16 x: (x, slots, weights, pool, shared)."""
    experts, top_k = 64, 10
    w13, s13, g = random_nvfp4(2 * inter, hidden, (experts,))
    w2, s2, _ = random_nvfp4(hidden, inter, (experts,))
    pool = SlotWeights(w13, w2, s13, s2, g)
    shared = SlotWeights(*(t[:1].clone() for t in pool))
    slots = torch.stack([torch.randperm(experts, device=DEV)[:top_k] for _ in range(batch)])
    wts = torch.cat([torch.softmax(torch.randn(batch, top_k, device=DEV), -1), torch.rand(batch, 1, device=DEV)],
                    1).bfloat16()
    return torch.randn(batch, hidden, device=DEV, dtype=torch.bfloat16), slots, wts, pool, shared


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=["bf16-x", "fp16-x"])
def test_pair_half_sum_ptx_against_stand_in_and_exact_sums(x_dtype):
    """Each block's PTX sum (fma.rn.f16x2) within fp16's rounding of its running sums (2**-11 a step, 8
    steps) of the exact sum, relative to the sum of |products|; so is the stand-in's."""
    from half_sum_probe import block_values, half_sums_in_torch, run_probe

    gen = torch.Generator(device=DEV).manual_seed(1)
    n = 2048
    words = torch.randint(-2**31, 2**31, (2 * n,), generator=gen, dtype=torch.int64, device=DEV).to(torch.int32)
    x = (torch.randn(16 * n, generator=gen, device=DEV) * 8).to(x_dtype).half()
    vals, xs = block_values(words).double(), x.reshape(n, 16).double()
    exact, size = (vals * xs).sum(1), (vals * xs).abs().sum(1) + 1e-30
    ptx, stand_in = run_probe(words, x, asm=True), run_probe(words, x, asm=False)
    assert ((ptx.double() - exact).abs() / size).max().item() < 8 * 2**-11
    assert ((stand_in.double() - exact).abs() / size).max().item() < 8 * 2**-11
    # the compiled stand-in against its torch form (which rounds each fp16 sum through fp32: a rare tie may land
    # the other way than the GPU's single rounding; with an fp16 x the compiler may fuse a product and its sum)
    torch_form = half_sums_in_torch(words.cpu(), x.cpu()).to(DEV).double()
    assert ((stand_in.double() - torch_form).abs() / size).max().item() < 8 * 2**-11


@pytest.mark.parametrize(("hidden", "inter", "batch"), [(2048, 512, 2), (2048, 512, 8), (2560, 640, 2),
                                                        (2560, 640, 8)], ids=["80b-b2", "80b-b8", "fn-b2", "fn-b8"])
def test_moe_decode_half_sums_at_model_shapes(hidden, inter, batch):
    x, slots, wts, pool, shared = moe_case(hidden, inter, batch)
    ref = moe_decode_ref(x, slots, wts, pool, shared)
    with use_kernel_options(NO_HALF):  # (the default takes the fp16 sums from two tokens)
        base = moe_decode_triton(x, slots, wts, pool, shared)
    big = x.clone()
    big[0, 5], big[-1, 9] = 1e6, -HALF_SUM_LIMIT
    with use_kernel_options(HALF):
        y = moe_decode_triton(x, slots, wts, pool, shared)
        y_big = moe_decode_triton(big, slots, wts, pool, shared)
    # (the reference's matmuls round in bf16 as the kernels' fp32-sum form nearly does: base's error ~1e-5-1e-7;
    # the fp16 sums move the bf16 roundings of the activation and of y, ~1.2e-3, session 45)
    assert rel_rms(y, ref) < 2e-2 and rel_rms(y, ref) < 1.5 * rel_rms(base, ref) + 3e-3
    assert y_big.isfinite().all() and rel_rms(y_big, moe_decode_ref(big, slots, wts, pool, shared)) < 2e-2
