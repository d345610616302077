"""Triton skinny GEMM for dense weights at decode batch sizes (details module of `ft.kernels.dense`).

y = x @ W^T with x [M, K] (M small: 1..16 in decode), W [N, K] fp32/bf16/fp16, fp32 products and
sums, y rounded once to x's dtype. Meant for the small projections of the decode step (MoE router
512 x 2048, in_proj_ba 64 x 2048, a 1-row gate 1 x 2048) where cuBLAS takes ~5 us in a CUDA graph
for 4 KB - 2 MB of weights: those are bound by launch, DRAM latency and the number of SMs that
read, not by FLOPs, so the design is about reading W from HBM once, from many SMs, in one launch.

One launch, grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)); a program owns BLOCK_N rows of W and
BLOCK_M rows of x, and takes the whole K:

* W rows are read as tiles [1, BLOCK_N, BLOCK_K] and x rows as [BLOCK_M, 1, BLOCK_K] (16-byte
  vectors along K, every thread of the program along K); with K <= BLOCK_K (K = 2048 in bf16 by
  default: 4 KB a row) everything a program reads is one load per tile, all in flight at once: one
  DRAM round trip per program. With a K loop the next W tile is loaded before the current one is
  used (a register double buffer written out here, not left to the compiler's pipeliner), so W's
  DRAM latency is paid about once.
* The product is the broadcast [BLOCK_M, BLOCK_N, BLOCK_K] of the two tiles, summed over K with
  ``tl.sum`` (in-thread, then across lanes and warps); no ``tl.dot``: the tensor cores want N tiles
  of 16 rows, too few programs for N = 64 or 512. The tiles are loaded with 3-D pointers so that
  the loads' vectorized layout is the product's: written as 2-D tiles broadcast with
  ``[:, None, :]``, the sm_90 build moved every row through shared memory (STS, BAR, LDSM per row).
* No split-K: a split needs a second reduction, either a second launch (~2 us, what this kernel is
  for) or atomics (results that change run to run). Small N instead gets BLOCK_N = 1 (N programs
  of one row: 64 for in_proj_ba, 512 for the router); N = 1 is one program reading 4 KB,
  latency-bound either way.
* Every program reads all of its x rows (from L2: x was just written), so the L2 -> SM traffic is
  W's bytes times about M * (1 / BLOCK_M + 1 / BLOCK_N); BLOCK_M and BLOCK_N grow with M
  (`default_config`) while leaving >= 128 programs along N. M above BLOCK_M (8 by default) takes
  more programs along the grid's second axis (each re-reads its W rows, from L2) instead of more
  registers.
* Rows of x past M and of W past N read the last valid row (in-bounds loads, no predication) and
  are not stored. Past the BLOCK_K tiles, a remainder of K that is a power of two is a tile of its
  own, unmasked (`k_tiling`: Qwen3.8-Flash-Next's K = 2,560 is 2,048 + 512); any other remainder is
  masked to 0, which costs a load per element.

Cost (sm_90 SASS compiled offline, bf16, K = 2048, 4 warps; not yet timed on the GPU): at M = 1 a
program is ~150 instructions per thread: 4 LDG.128 issued together, 16 products summed as a tree,
5 lane shuffles and one barrier. Each output costs the same at any M (16 products per thread, 7
shuffles), so at M = 8 with BLOCK_N = 4 (32 outputs, ~1650 instructions per thread) the SM side may
bound the router rather than HBM: hence the block sizes and num_warps are a config for
bench/dense_gemv.py --sweep. Products in fp32: bf16 / fp16 packed math would accumulate in 16 bits.

Determinism: no atomics and a fixed reduction order, so the same inputs give the same bits. The
sum order of one output is set by how K is split over registers, lanes and warps: by BLOCK_K,
num_warps and the vector width (dtype and 16-byte alignment of x and W), not by BLOCK_M or BLOCK_N
(rows of x and W sit in each thread's registers) as long as BLOCK_K covers all threads of the
program (BLOCK_K >= 32 * num_warps * 16 bytes / element size: with the defaults, K >= 256 in
bf16 / fp16 and K >= 128 in fp32).
`default_config` picks BLOCK_K and num_warps from K and the dtype only, so a row's result does not
depend on M or on the other rows of x (tests/gpu/test_dense_cuda.py checks it bitwise); an explicit
`config` with another BLOCK_K or num_warps may change the last bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait

__all__ = ["default_config", "dense_linear_triton", "gemv_block", "k_tiling"]

TILE_BYTES = 4096
"""Largest K tile of one W row, in bytes: K = 2048 in bf16/fp16 (1024 in fp32) in one tile."""

BLOCK_M_MAX = 8
"""Default rows of x per program; more rows take more programs (grid axis 1)."""


@triton.jit
def _load_k(p_t, k0, o_k, K, EVEN_K: tl.constexpr):
    """The tile at p_t + k0 (p_t: [A, B, BLOCK_K] pointers at columns o_k); columns at or past K read 0."""
    if EVEN_K:
        return tl.load(p_t + k0)
    return tl.load(p_t + k0, mask=(k0 + o_k < K)[None, None, :], other=0.0)


@triton.jit
def _tile_sum(b_x, b_w):
    """x tile [BM, 1, BK] and W tile [1, BN, BK] -> sum_k x[m, k] * W[n, k] in fp32, [BM, BN]."""
    return tl.sum(b_x.to(tl.float32) * b_w.to(tl.float32), axis=2)


@triton.jit
def gemv_block(p_x, p_w, M, N, K, stride_xm, stride_wn, i_m, i_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ONE_TILE: tl.constexpr, PDL: tl.constexpr,
               TAIL_K: tl.constexpr = 0):
    """The block (i_m, i_n) of x @ W^T: fp32 [BLOCK_M, BLOCK_N] sums over the whole K (this module's
    loads and sum order; rows past M / N read the last valid row). TAIL_K > 0 (`k_tiling`): the last
    TAIL_K columns are a tile of their own, summed after the BLOCK_K tiles, none of them masked."""
    # PDL (`ft.kernels.pdl`): the first weight tile is loaded before the wait (W is a layer's
    # weight: no kernel of the step writes it), x after it
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    # rows past M / N read the last valid row: in bounds, no predicated loads; they are not stored.
    # 3-D pointer tiles: the loads' layout is the product's (no shared-memory layout conversion)
    r_x = tl.minimum(o_m, M - 1).to(tl.int64)[:, None, None] * stride_xm
    r_w = tl.minimum(o_n, N - 1).to(tl.int64)[None, :, None] * stride_wn
    p_xt = p_x + r_x + o_k[None, None, :]
    p_wt = p_w + r_w + o_k[None, None, :]
    b_w = _load_k(p_wt, 0, o_k, K, EVEN_K)
    k_end = K
    if TAIL_K > 0:  # its W tile in flight with the first one
        k_end = tl.multiple_of(K - TAIL_K, BLOCK_K)  # (`k_tiling`: TAIL_K = K % BLOCK_K; said so, its loads vectorize)
        o_t = k_end + tl.arange(0, TAIL_K)
        b_wt = tl.load(p_w + r_w + o_t[None, None, :])
    pdl_wait(PDL)
    pdl_release(PDL)
    if ONE_TILE:  # K <= BLOCK_K: W and x tiles in flight together, one reduction
        acc = _tile_sum(_load_k(p_xt, 0, o_k, K, EVEN_K), b_w)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_end - BLOCK_K, BLOCK_K):  # every tile but the last; the next one exists
            b_w_next = _load_k(p_wt, k0 + BLOCK_K, o_k, K, EVEN_K)  # in flight during this tile's math
            acc += _tile_sum(_load_k(p_xt, k0, o_k, K, EVEN_K), b_w)
            b_w = b_w_next
        k_last = tl.cdiv(k_end, BLOCK_K) * BLOCK_K - BLOCK_K
        acc += _tile_sum(_load_k(p_xt, k_last, o_k, K, EVEN_K), b_w)
    if TAIL_K > 0:
        acc += _tile_sum(tl.load(p_x + r_x + o_t[None, None, :]), b_wt)
    return acc


@triton.jit
def _dense_gemv_kernel(
    p_x, p_w, p_y,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, ONE_TILE: tl.constexpr, PDL: tl.constexpr = False, TAIL_K: tl.constexpr = 0,
):
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    acc = gemv_block(p_x, p_w, M, N, K, stride_xm, stride_wn, i_m, i_n, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, ONE_TILE,
                     PDL, TAIL_K)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    p_yt = p_y + o_m.to(tl.int64)[:, None] * stride_ym + o_n[None, :]
    tl.store(p_yt, acc.to(p_y.dtype.element_ty), mask=(o_m < M)[:, None] & (o_n < N)[None, :])


def _pow2_floor(v: int) -> int:
    return 1 << max(0, v.bit_length() - 1) if v >= 1 else 1


def default_config(m: int, n: int, k: int, dtype: torch.dtype) -> dict:
    """Block sizes and launch options for x [m, k] @ W [n, k]^T.

    BLOCK_K (the whole K up to `TILE_BYTES` a row) and num_warps (about two 16-byte vectors of a
    row per thread) depend on K and the dtype only, so the sum order, and a row's result, does not
    depend on M. BLOCK_M: up to `BLOCK_M_MAX` rows of x per program. BLOCK_N: about BLOCK_M / 2 rows
    of W per program (x's L2 reads at most ~2x W's), fewer where that leaves < 128 programs along N.
    Not yet swept on the H200 (bench/dense_gemv.py --sweep).
    """
    elem = dtype.itemsize
    block_k = max(16, min(triton.next_power_of_2(k), TILE_BYTES // elem))
    num_warps = max(1, min(8, block_k * elem // 1024))
    block_m = min(triton.next_power_of_2(max(m, 1)), BLOCK_M_MAX)
    block_n = max(1, min(block_m // 2, _pow2_floor(n // 128)))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": num_warps}


def k_tiling(k: int, block_k: int) -> dict:
    """The kernel's K-tiling constexprs for K = k: EVEN_K (no masks along K), ONE_TILE (no K loop), TAIL_K
    (a last tile of its own). Past one tile, a remainder that is a power of two is that tile (unmasked), so
    that every load stays a 16-byte vector: with a mask against the runtime K each element is a load of its
    own (Qwen3.8-Flash-Next's K = 2,560 = 2,048 + 512: 384 two-byte loads a thread and 368 bytes of spills at
    M = 8, against 24 vector loads and none with the tail tile; tests/compile_kernels_sm90.py --loads)."""
    tail = k % block_k if k > block_k else 0
    if tail and tail & (tail - 1) == 0:
        return {"EVEN_K": True, "ONE_TILE": False, "TAIL_K": tail}
    return {"EVEN_K": k % block_k == 0, "ONE_TILE": k <= block_k, "TAIL_K": 0}


def dense_linear_triton(
    x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor | None = None, config: dict | None = None
) -> torch.Tensor:
    """y = x @ w.T on Triton: x [M, K], w [N, K], both fp32, bf16 or fp16 (the same) -> y [M, N] in x's dtype.
    w must be a weight that no kernel before this one in the stream writes (with PDL it is read
    before the launch waits for that kernel).

    fp32 products and sums, one rounding to x's dtype. Any M, N, K >= 0 (meant for a decode batch's rows:
    the dispatcher's `DenseOptions.max_m`);
    x and w are made contiguous along K if they are not (a copy); any row strides.

    Args:
        out: optional [M, N] output in x's dtype, unit stride along N (any row stride); written entirely.
        config: BLOCK_M, BLOCK_N, BLOCK_K (powers of two) and launch options (num_warps), overriding
            `default_config` (benchmarks). Another BLOCK_K or num_warps changes the sum order.
    Raises:
        ValueError: on shapes, dtypes or an `out` the kernel does not take.
    """
    if x.dim() != 2 or w.dim() != 2 or x.dtype != w.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x [M, K] and w [N, K] must be fp32/bf16/fp16 of one dtype, got x {x.dtype} "
                         f"{tuple(x.shape)}, w {w.dtype} {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, w {tuple(w.shape)}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device or (m * n and out.stride(-1) != 1):
        raise ValueError(f"out must be [{m}, {n}] {x.dtype} on {x.device} with unit stride along N, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    cfg = dict(config or default_config(m, n, k, x.dtype))
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _dense_gemv_kernel[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                             **k_tiling(k, cfg["BLOCK_K"]), **cfg, **pdl_args(x.device))
    return out
