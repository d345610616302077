"""Triton dense skinny GEMM (`ft.kernels.dense`) against the fp32 product, under the interpreter on CPU;
the dispatcher's choice between the kernel and F.linear; determinism and rows independent of M."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import ft.kernels.dense.kernel as details
from ft.kernels.dense import dense_linear, dense_linear_ref, uses_dense_kernel
from ft.kernels.dense.kernel import default_config, dense_linear_triton

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# y is the fp32 sum rounded once to the output dtype: within half a unit in the last place of the
# exact product (2**-8 relative in bf16, 2**-11 in fp16), plus fp32 sum-order error; 1 ulp allowed.
RTOL = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}

# (M, N, K): M in 1, 3, 8 (and 11, 16: two row tiles of x); N in 1, 5, 64; K in 16, 64, 2048
# (the whole K in one tile) and 80 (one tile, masked past K). fp32 and fp16 on all, bf16 on a few.
SHAPES = [(m, n, k) for m in (1, 3, 8) for n in (1, 5, 64) for k in (16, 64)] + [
    (1, 64, 2048), (3, 5, 2048), (8, 64, 2048), (8, 1, 2048), (11, 5, 64), (16, 64, 64), (16, 3, 2048), (3, 7, 80),
]
CASES = [(*s, dt) for dt in (torch.float32, torch.float16) for s in SHAPES] + [
    (*s, torch.bfloat16) for s in SHAPES if s[2] == 2048 or s[:2] in ((3, 5), (8, 64))
]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 7919 + m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 2).to(dtype)  # rows of varied size
    return x, w


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[0])
    exact = x.double() @ w.double().T
    scale = (x.double().abs() @ w.double().abs().T)  # sum |x w|: bounds the fp32 sum-order error
    err = (y.double() - exact).abs()
    bound = RTOL[x.dtype] * exact.abs() + 1e-6 * scale + 1e-30
    assert (err <= bound).all(), f"max err {err.max().item():.3e}, worst excess {(err - bound).max().item():.3e}"
    ref = dense_linear_ref(x, w)
    assert ((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item() < 4 * RTOL[x.dtype]


@pytest.mark.parametrize(("m", "n", "k", "dtype"), CASES, ids=[f"M{m}-N{n}-K{k}-{DTYPE_NAMES[d]}" for m, n, k, d in CASES])
def test_dense_linear_triton_matches_ref(m, n, k, dtype):
    x, w = _inputs(m, n, k, dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = dense_linear_triton(x, w, out=out)
    assert y is out
    _check(y, x, w)


# K loops (BLOCK_K below K, the next W tile prefetched), K not a multiple of BLOCK_K (a remainder that is a
# power of two as a tile of its own: 80 = 2 x 32 + 16, 272, 160 (Flash-Next's 2,560 = 2,048 + 512 in small);
# another one masked: 88 = 2 x 32 + 24), more rows per program than M, several warps and rows of W per program.
CONFIGS = [
    (3, 7, 96, {"BLOCK_M": 4, "BLOCK_N": 2, "BLOCK_K": 32, "num_warps": 1}),
    (3, 7, 80, {"BLOCK_M": 2, "BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1}),
    (3, 7, 88, {"BLOCK_M": 2, "BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1}),
    (8, 5, 160, {"BLOCK_M": 8, "BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 4}),
    (5, 9, 272, {"BLOCK_M": 16, "BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 2}),
    (1, 3, 48, {"BLOCK_M": 1, "BLOCK_N": 1, "BLOCK_K": 16, "num_warps": 1}),
    (8, 64, 2048, {"BLOCK_M": 8, "BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize(("m", "n", "k", "config"), CONFIGS, ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-BK{c[3]['BLOCK_K']}" for c in CONFIGS])
def test_dense_linear_triton_configs(m, n, k, config, dtype):
    x, w = _inputs(m, n, k, dtype, seed=1)
    _check(dense_linear_triton(x, w, config=config), x, w)


def test_strided_rows_and_out():
    """x and out with row strides (slices of wider buffers), w's rows apart in a wider buffer."""
    x_buf, w_buf = torch.randn(6, 96), torch.randn(5, 80)
    x, w = x_buf[1:, 16:80], w_buf[:, 8:72]
    assert x.stride() == (96, 1) and w.stride() == (80, 1)
    out_buf = torch.full((5, 9), float("nan"))
    y = dense_linear_triton(x, w, out=out_buf[:, 2:7])
    assert torch.equal(y, out_buf[:, 2:7]) and out_buf[:, :2].isnan().all() and out_buf[:, 7:].isnan().all()
    _check(y, x, w)
    # along K with a stride: copied to contiguous first
    _check(dense_linear_triton(x_buf[:, ::2][:, :32], w_buf[:, :64:2]), x_buf[:, ::2][:, :32], w_buf[:, :64:2])


def test_deterministic_and_rows_independent_of_m():
    x, w = _inputs(16, 37, 2048, torch.float32, seed=2)
    y = dense_linear_triton(x, w)
    assert torch.equal(dense_linear_triton(x, w), y)
    for m in (1, 2, 3, 5, 8, 9, 15):
        assert torch.equal(dense_linear_triton(x[:m], w), y[:m]), m
    assert torch.equal(dense_linear_triton(x[6:11], w), y[6:11])
    # BLOCK_K and num_warps, which set the sum order, depend on K and the dtype only
    for dtype in (torch.float32, torch.bfloat16):
        cfgs = [default_config(m, n, 2048, dtype) for m in range(1, 17) for n in (1, 64, 512, 513, 12288)]
        assert len({(c["BLOCK_K"], c["num_warps"]) for c in cfgs}) == 1


def test_k_tiling_takes_a_power_of_two_remainder_as_a_tile():
    from ft.kernels.dense.kernel import k_tiling

    assert k_tiling(2560, 2048) == {"EVEN_K": True, "ONE_TILE": False, "TAIL_K": 512}  # Flash-Next's hidden size
    assert k_tiling(2048, 2048) == {"EVEN_K": True, "ONE_TILE": True, "TAIL_K": 0}
    assert k_tiling(4096, 2048) == {"EVEN_K": True, "ONE_TILE": False, "TAIL_K": 0}
    assert k_tiling(2088, 2048) == {"EVEN_K": False, "ONE_TILE": False, "TAIL_K": 0}  # 40: masked
    assert k_tiling(80, 128) == {"EVEN_K": False, "ONE_TILE": True, "TAIL_K": 0}  # one tile, masked


def test_default_config():
    bf16 = torch.bfloat16
    assert default_config(1, 512, 2048, bf16) == {"BLOCK_M": 1, "BLOCK_N": 1, "BLOCK_K": 2048, "num_warps": 4}
    assert default_config(8, 512, 2048, bf16) == {"BLOCK_M": 8, "BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 4}
    assert default_config(8, 64, 2048, bf16)["BLOCK_N"] == 1  # 64 programs, not fewer
    assert default_config(16, 512, 2048, bf16)["BLOCK_M"] == 8  # two row tiles of x
    assert default_config(1, 512, 2048, torch.float32)["BLOCK_K"] == 1024  # 4 KB of a row per tile
    assert default_config(1, 512, 8192, bf16)["BLOCK_K"] == 2048


def test_empty_and_errors():
    x, w = torch.randn(3, 32), torch.randn(4, 32)
    assert dense_linear_triton(x, w[:0]).shape == (3, 0)
    assert dense_linear_triton(x[:0], w).shape == (0, 4)
    assert torch.equal(dense_linear_triton(x[:, :0], w[:, :0], out=torch.full((3, 4), float("nan"))), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="one dtype"):
        dense_linear_triton(x, w.half())
    with pytest.raises(ValueError, match="one dtype"):
        dense_linear_triton(x.double(), w.double())
    with pytest.raises(ValueError, match="do not match"):
        dense_linear_triton(x, torch.randn(4, 48))
    with pytest.raises(ValueError, match="out must be"):
        dense_linear_triton(x, w, out=torch.empty(3, 5))
    with pytest.raises(ValueError, match="out must be"):
        dense_linear_triton(x, w, out=torch.empty(4, 3).T)  # not unit stride along N


def _spy(monkeypatch) -> list:
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    calls = []
    real = details.dense_linear_triton
    monkeypatch.setattr(details, "dense_linear_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize(("m", "dtype"), [(1, torch.float32), (16, torch.float16), (5, torch.bfloat16)])
def test_dispatcher_runs_the_kernel(monkeypatch, m, dtype):
    calls = _spy(monkeypatch)
    x, w = _inputs(m, 24, 64, dtype, seed=3)
    assert uses_dense_kernel(x, w)
    y = dense_linear(x, w)
    assert calls and torch.equal(y, dense_linear_triton(x, w))
    out = torch.full((m, 24), float("nan"), dtype=dtype)
    assert dense_linear(x, w, out=out) is out and torch.equal(out, y)
    x_rows = torch.randn(m, 128).to(dtype)[:, 32:96]  # any row stride
    assert uses_dense_kernel(x_rows, w)


@pytest.mark.parametrize("m", [17, 64])
def test_dispatcher_takes_up_to_the_option_s_rows(monkeypatch, m):
    """`DenseOptions.max_m`: past 16 rows F.linear by default; with 64 the kernel, whose rows equal the same rows
    computed alone (a row's sum order does not follow M), and F.linear again past 64."""
    from ft.kernels.options import use_kernel_options, variant

    calls = _spy(monkeypatch)
    x, w = _inputs(m, 24, 64, torch.float16, seed=5)
    assert not uses_dense_kernel(x, w)
    with use_kernel_options(variant(**{"dense.max_m": 64})):
        assert uses_dense_kernel(x, w) and not uses_dense_kernel(torch.randn(65, 64).half(), w)
        y = dense_linear(x, w)
    assert calls and torch.equal(y[-3:], dense_linear_triton(x[-3:], w))
    assert torch.allclose(y.float(), dense_linear_ref(x, w).float(), rtol=1e-2, atol=1e-2)


def _fallback_cases():
    x, w = torch.randn(4, 64), torch.randn(6, 64)
    return {
        "M0": (x[:0], w),
        "M17": (torch.randn(17, 64), w),
        "K24": (torch.randn(4, 24), torch.randn(6, 24)),
        "K0": (x[:, :0], w[:, :0]),
        "fp64": (x.double(), w.double()),
        "w-column-major": (x, torch.randn(64, 6).T),
        "x-strided-K": (torch.randn(64, 4).T, w),
        "x-3d": (torch.randn(2, 3, 64), w),
        "w-1d": (x, torch.randn(64)),
    }


@pytest.mark.parametrize("case", list(_fallback_cases()))
def test_dispatcher_falls_back_to_f_linear(monkeypatch, case):
    calls = _spy(monkeypatch)
    x, w = _fallback_cases()[case]
    assert not uses_dense_kernel(x, w)
    y = dense_linear(x, w)
    assert not calls and torch.equal(y, F.linear(x, w))
    out = torch.full(y.shape, float("nan"), dtype=y.dtype)
    assert dense_linear(x, w, out=out) is out and torch.equal(out, y)


def test_dispatcher_fallbacks_without_triton_or_with_odd_out(monkeypatch):
    calls = _spy(monkeypatch)
    x, w = torch.randn(3, 64), torch.randn(5, 64)
    with pytest.raises(RuntimeError):  # mixed dtypes: F.linear's own error
        dense_linear(x, w.half())
    out = torch.full((5, 3), float("nan")).T  # not unit stride along N: F.linear, then a copy
    assert dense_linear(x, w, out=out) is out and torch.equal(out, F.linear(x, w)) and not calls
    monkeypatch.delenv("FT_TRITON_INTERPRET_TEST")  # CPU tensors outside interpreter tests: the reference path
    assert not uses_dense_kernel(x, w)
    assert torch.equal(dense_linear(x, w), F.linear(x, w)) and not calls
