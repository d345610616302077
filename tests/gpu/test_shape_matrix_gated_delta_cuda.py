"""The Gated DeltaNet chunked prefill (`chunk_gated_delta_rule_varlen_triton`, both launches) compiled
for the GPU over the shapes a Qwen3-Next-family checkpoint may bring, against the torch reference
(`chunk_gated_delta_rule_varlen_ref` in fp32 on the same inputs). Issue 37: a model with key and value
head dims of 32 lost its CUDA context here (the prep kernel's 32-wide tiles miscompiled).

How the subset was picked (not the product of every dimension): every value of every dimension
appears at least once in each dtype where it matters, and the risky pairs appear together:
- head dims {32, 64, 128, 256} equal, and unequal both ways (32/64, 64/128, 128/64, 256/128);
- value heads {4, 32, 48} with key heads dividing them (GQA 1, 2, 3, 4, 8 and 16 -> 48: the seeds'
  model has 16 key and 48 value heads of 128);
- lengths at the 64-token chunk boundaries (1, 63, 64, 65), around a real prefill chunk (4,095,
  4,096, 4,097: a multiple of 64 leaves the prep kernel's spare program), and several sequences
  packed (1, 63, 64, 65, 130) from states at scattered slots;
- the smallest dims with the most heads and the longest lengths, the largest dims (256: the most
  registers) with both a short and a long run, and the state pass's BLOCK_V narrowing (few programs:
  one sequence and 4 heads) as well as its full width (48 heads);
- bf16 (tensor-core dots: where the miscompile was) and fp32 (exact products) on different shapes.
21 cases; one compile per distinct (dims, dtype, block) combination.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ft.kernels.gated_delta import chunk_gated_delta_rule_varlen_ref
from ft.kernels.gated_delta.chunk_kernel import chunk_gated_delta_rule_varlen_triton

pytestmark = pytest.mark.gpu

DEV = "cuda"
SLOTS, LAYERS, LAYER = 12, 3, 1
PACKED = (1, 63, 64, 65, 130)
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
"""Relative RMS of o and of the final states. fp32: exact products, only the summation order differs
(measured ~5e-7 at 4,096 tokens). bf16: the dot operands and the stored intermediates (w, u, A) round
to bf16, a few roundings of 2**-8 in sequence (measured 4e-3 at 32 and 128 head dims)."""

# (Hk, Hv, Dk, Dv, lengths, dtype)
BF16, FP32 = torch.bfloat16, torch.float32
CASES = [
    (2, 4, 32, 32, PACKED, BF16),
    (4, 4, 32, 32, (64,), BF16),
    (16, 48, 32, 32, (4097,), BF16),
    (2, 4, 64, 64, (63,), BF16),
    (8, 32, 64, 64, (4096,), BF16),
    (16, 48, 128, 128, (4095,), BF16),
    (16, 32, 128, 128, PACKED, BF16),
    (2, 4, 256, 256, (65,), BF16),
    (8, 32, 256, 256, (4097,), BF16),
    (4, 4, 64, 128, (64,), BF16),
    (16, 48, 128, 64, PACKED, BF16),
    (2, 4, 32, 64, (1,), BF16),
    (2, 32, 256, 128, (4096,), BF16),
    (4, 4, 16, 16, (130,), BF16),
    (2, 4, 32, 32, PACKED, FP32),
    (16, 48, 64, 64, (4097,), FP32),
    (4, 32, 128, 128, (64,), FP32),
    (2, 4, 256, 256, PACKED, FP32),
    (2, 4, 128, 64, (65,), FP32),
    (4, 4, 32, 64, (4096,), FP32),
    (16, 48, 128, 128, (1, 4095), FP32),
]


def case_id(hk, hv, dk, dv, lengths, dtype) -> str:
    t = "+".join(map(str, lengths)) if len(lengths) <= 2 else f"packed{len(lengths)}"
    return f"Hk{hk}-Hv{hv}-Dk{dk}-Dv{dv}-T{t}-{'bf16' if dtype == BF16 else 'fp32'}"


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS difference; NaN anywhere in `out` (an unwritten poisoned element) gives nan."""
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_prefill(lengths, hk, hv, dk, dv, dtype, seed):
    """One packed prefill as the model makes it: q, k [T, Hk, Dk], v [T, Hv, Dv] strided views of one
    [T, C] conv output (after SiLU), g [T, Hv] fp32 log decays over two decades across the heads,
    beta [T, Hv] in dtype, cu_seqlens [B+1] int32, slots [B] scattered, a state pool [S, L, Hv, Dk, Dv]
    that is NaN except at (slots, LAYER)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    t, kd = sum(lengths), hk * dk
    y = F.silu(torch.randn(t, 2 * kd + hv * dv, device=DEV, generator=gen) * 2).to(dtype)
    q, k, v = y[:, :kd].view(t, hk, dk), y[:, kd:2 * kd].view(t, hk, dk), y[:, 2 * kd:].view(t, hv, dv)
    g = -F.softplus(torch.randn(t, hv, device=DEV, generator=gen)) * torch.logspace(-2, 0, hv, device=DEV)
    beta = torch.rand(t, hv, device=DEV, generator=gen).to(dtype)
    cu = torch.tensor((0, *lengths), device=DEV).cumsum(0).to(torch.int32)
    slots = torch.randperm(SLOTS, device=DEV, generator=gen)[: len(lengths)]
    pool = torch.full((SLOTS, LAYERS, hv, dk, dv), float("nan"), device=DEV)
    pool[slots, LAYER] = torch.randn(len(lengths), hv, dk, dv, device=DEV, generator=gen) * 0.3
    return (q, k, v, g, beta), cu, slots, pool


@pytest.mark.parametrize(("hk", "hv", "dk", "dv", "lengths", "dtype"), CASES, ids=[case_id(*c) for c in CASES])
def test_chunked_prefill_matches_reference(hk, hv, dk, dv, lengths, dtype):
    args, cu, slots, pool = make_prefill(lengths, hk, hv, dk, dv, dtype, seed=dk * 7 + dv + len(lengths))
    q, k, v, g, beta = args
    pool_ref = pool.clone()
    o_ref = chunk_gated_delta_rule_varlen_ref(q.float(), k.float(), v.float(), g, beta.float(), pool_ref[:, LAYER],
                                              cu, slots)
    out = torch.full(v.shape, float("nan"), dtype=dtype, device=DEV)
    o = chunk_gated_delta_rule_varlen_triton(q, k, v, g, beta, pool[:, LAYER], cu, slots, out=out)
    torch.cuda.synchronize()
    assert o is out
    for b, n in enumerate(lengths):  # each sequence on its own: a wrong offset or slot shows in one
        sl = slice(int(cu[b]), int(cu[b + 1]))
        assert rel_rms(o[sl], o_ref[sl]) < TOL[dtype], f"o of sequence {b} ({n} tokens)"
        slot = int(slots[b])
        assert rel_rms(pool[slot, LAYER], pool_ref[slot, LAYER]) < TOL[dtype], f"state of sequence {b}"
    region = torch.zeros(SLOTS, LAYERS, dtype=torch.bool, device=DEV)
    region[slots, LAYER] = True
    assert pool[~region].isnan().all()  # other slots and layers neither read nor written
