"""The dense skinny GEMM (`ft.kernels.dense`) compiled for the GPU at the decode shapes (MoE router
512 x 2048, in_proj_ba 64 x 2048, a 1-row gate 1 x 2048, and 513 rows: a partial last tile) for
M = 1..16, bf16, against the fp64 product; bitwise: run to run, rows independent of M, in a CUDA
graph; the dispatcher's choice on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ft.kernels.dense import dense_linear, dense_linear_ref, uses_dense_kernel
from ft.kernels.dense.kernel import dense_linear_triton

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16 = torch.bfloat16
K = 2048
N_CASES = (1, 64, 512, 513)
RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5}
"""Per element, relative to the exact product: y is an fp32 sum rounded once (half a unit in the
last place: 2**-8 in bf16), plus the fp32 sum-order error (bounded below by 1e-6 * sum |x w|)."""


def inputs(m: int, n: int, k: int = K, dtype: torch.dtype = BF16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed * 100_003 + m * 1000 + n)
    x = torch.randn(m, k, device=DEV, generator=gen).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=gen) * 0.05).to(dtype)
    return x, w


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[0]) and not y.isnan().any()
    exact = x.double() @ w.double().T
    bound = RTOL[x.dtype] * exact.abs() + 1e-6 * (x.double().abs() @ w.double().abs().T)
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), f"max err {err.max().item():.3e}, worst excess {(err - bound).max().item():.3e}"
    ref = dense_linear_ref(x, w)
    # y and the reference round the same fp32 sums, summed in another order: where they differ, by one unit
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() <= 2.0**-7


@pytest.mark.parametrize("n", N_CASES, ids=[f"N{n}" for n in N_CASES])
@pytest.mark.parametrize("m", range(1, 17), ids=[f"M{m}" for m in range(1, 17)])
def test_dense_matches_ref_bf16(m, n):
    x, w = inputs(m, n)
    out = torch.full((m, n), float("nan"), device=DEV, dtype=BF16)
    y = dense_linear_triton(x, w, out=out)
    assert y is out
    check(y, x, w)
    assert torch.equal(dense_linear(x, w), y)  # the dispatcher runs this kernel on CUDA


@pytest.mark.parametrize(("m", "n", "k", "dtype"), [
    (1, 512, 2048, torch.float16), (8, 513, 2048, torch.float16), (3, 512, 2048, torch.float32),
    (8, 64, 2048, torch.float32), (4, 2048, 4096, BF16), (8, 1024, 2064, BF16), (16, 12288, 2048, BF16),
    (2, 96, 512, BF16), (5, 64, 64, BF16),
], ids=lambda v: str(v).replace("torch.", "") if isinstance(v, torch.dtype) else str(v))
def test_dense_other_shapes_and_dtypes(m, n, k, dtype):
    """fp16 and fp32; K loops (4096: two tiles, 2064: the last one masked), large N, small K."""
    x, w = inputs(m, n, k, dtype, seed=1)
    check(dense_linear_triton(x, w, out=torch.full((m, n), float("nan"), device=DEV, dtype=dtype)), x, w)


SWEEP_CONFIGS = [
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw}
    for bm, bn, bk, nw in [(1, 1, 2048, 1), (2, 2, 2048, 2), (4, 4, 2048, 2), (8, 2, 2048, 4), (8, 8, 1024, 8),
                           (16, 4, 2048, 8), (4, 1, 1024, 4), (2, 4, 512, 1)]
]


@pytest.mark.parametrize("config", SWEEP_CONFIGS, ids=lambda c: "-".join(f"{k[6:] if k.startswith('BLOCK') else 'w'}{v}" for k, v in c.items()))
@pytest.mark.parametrize("m", (1, 5, 16))
def test_dense_configs(m, config):
    """Block configurations of the kind bench/dense_gemv.py --sweep times are correct too."""
    x, w = inputs(m, 513, seed=2)
    check(dense_linear_triton(x, w, config=config), x, w)


@pytest.mark.parametrize("n", (64, 512, 513))
def test_dense_bitwise_deterministic_and_rows_independent_of_m(n):
    x, w = inputs(16, n, seed=3)
    y = dense_linear_triton(x, w)
    for _ in range(3):
        assert torch.equal(dense_linear_triton(x, w), y)
    for m in range(1, 16):
        assert torch.equal(dense_linear_triton(x[:m], w), y[:m]), f"rows of M={m} differ from M=16"
    assert torch.equal(dense_linear_triton(x[5:12], w), y[5:12])
    x_wide = torch.zeros(16, K + 64, device=DEV, dtype=BF16)
    x_wide[:, 64:] = x
    assert torch.equal(dense_linear_triton(x_wide[:, 64:], w), y)  # x rows with a row stride


def test_dense_strided_out_and_cuda_graph():
    m, n = 8, 512
    x, w = inputs(m, n, seed=4)
    want = dense_linear_triton(x, w)
    buf = torch.full((m, n + 16), float("nan"), device=DEV, dtype=BF16)
    assert torch.equal(dense_linear(x, w, out=buf[:, 8:8 + n]), want)
    assert buf[:, :8].isnan().all() and buf[:, 8 + n:].isnan().all()
    out = torch.empty(m, n, device=DEV, dtype=BF16)
    dense_linear(x, w, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dense_linear(x, w, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_dense_dispatcher_fallbacks_on_cuda():
    x, w = inputs(17, 64, seed=5)
    assert not uses_dense_kernel(x, w)
    assert torch.equal(dense_linear(x, w), F.linear(x, w))  # M above 16: cuBLAS
    x8 = x[:8]
    assert uses_dense_kernel(x8, w) and torch.equal(dense_linear(x8, w), dense_linear_triton(x8, w))
    w_t = w.T.contiguous().T  # column-major: F.linear
    assert not uses_dense_kernel(x8, w_t) and torch.equal(dense_linear(x8, w_t), F.linear(x8, w_t))
