"""Triton chunked gated delta rule over a packed batch of sequences, forward only (details module of
`ft.kernels.gated_delta`): Gated DeltaNet's prefill. Same math as `chunk_gated_delta_rule_ref` per
sequence (chunks of CHUNK = 64 tokens, each sequence's chunks starting at its own first token).

Two launches, whatever the batch:

* `_chunk_prep_kernel`, programs over (chunk, value head), all chunks of all sequences in parallel.
  A chunk's tokens t = 0..n-1 (n <= 64; the rest masked: zero k, v, q, beta and g, which the
  reference's padding also has): q and k of the head's key head (h // (Hv / Hk)) L2-normalised in
  fp32, q scaled by Dk**-0.5; gc = the within-chunk cumulative sum of g (log decay from the chunk's
  start); D[i, j] = exp(gc_i - gc_j) for j <= i, else 0. Then the UT transform of the delta rule:
  with L = strictly-lower(diag(beta) K K^T * D), T = (I + L)^-1 (see `_unit_lower_inverse`),
      w = T (diag(beta e^gc) K)   [n, Dk]   (the reference's u_s)
      u = T (diag(beta) V)        [n, Dv]   (its u_v)
      A = (Q K^T) * D             [n, n]    (its qk, the diagonal included)
  stored per token ([T, Hv, Dk], [T, Hv, Dv], [T, Hv, 64] in the activation dtype) with gc ([T, Hv] fp32).
* `_chunk_state_kernel`, programs over (sequence, value head, block of BLOCK_V value dims): the state
  tile S [Dk, BLOCK_V] (fp32, read from the sequence's slot) in registers through the sequence's
  chunks in order; per chunk, with g_n = gc of its last token:
      U = u - w S                                  (the chunk's corrected values)
      o = (Q e^gc) S + A U                          (inter-chunk part + intra-chunk attention)
      S <- S e^(g_n) + (K e^(g_n - gc))^T U
  and S written back to the slot (in place: each program owns its tile of its slot).

Both kernels take EVEN_K (Dk == BLOCK_K) and EVEN_V (Dv a multiple of BLOCK_V: Dv == BLOCK_V in the
first kernel, whose BLOCK_V is the whole head dim), set by `prep_config` and `state_config` from the
shapes: then the [rows, Dk] and [rows, BLOCK_V] tiles are masked by their rows alone (`_tile_mask`),
so that their loads and stores vectorize (16 bytes per thread); a mask against the runtime Dk or Dv
makes every element a load of its own. Same values either way (no column is cut off when the flag is set).

Chunks per sequence: the first kernel's grid has `T // 64 + B` programs along its first axis;
sequence b owns ids from `cu[b] // 64 + b` on (one more than it can need: the spare ids exit at once),
found from the id by a binary search over cu_seqlens. No host sync, grids from shapes only.

Precision: the dots take their operands in the activation dtype (bf16 on the model's GPU path;
fp32 with exact "ieee" products when the activations are fp32) and accumulate in fp32; the solve for
T alone runs on fp32 operands (`GatedDeltaOptions.solve_precision`: tf32 on the GPU for 16-bit activations, "ieee" for
fp32), T then rounded to the activation dtype for the products w and u (which are stored in it
anyway); w, u and A are stored in the activation dtype; the state stays fp32 and is rounded to the
activation dtype only as a dot operand. So bf16 results differ from the fp32 references by a few
bf16 roundings (tests/gpu/test_gated_delta_cuda.py checks it); fp32 by summation order.

Measured on the H200 (bench/gated_delta_prefill.py; Hk 16, Hv 32, Dk = Dv = 128, bf16): o within a
relative RMS of 4.2e-3 of the fp32 reference, the states 3.7e-3 (the same with a tf32x3 or ieee
solve: bf16 storage dominates). Per layer: 4,096 tokens in 3 sequences 0.14 ms (prep) + 0.22 ms
(state pass); 16,384 in one sequence 0.50 + 0.95 (the state pass is a chain of 256 chunks on 128
programs); 16,384 in 16 sequences 0.51 + 0.68. The torch references per sequence took 13.2 ms
(conv included) for the 4,096 tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.backend import TRITON_DTYPES
from ft.kernels.conv1d.kernel import check_varlen, find_seq, search_iters
from ft.kernels.fit import fallback_stages, launch_fitting
from ft.kernels.options import kernel_options

__all__ = ["CHUNK", "MAX_DK", "PREP_MIN_BLOCK", "chunk_gated_delta_rule_varlen_triton", "prep_config", "state_config",
           "state_configs"]

CHUNK = 64
"""Tokens per chunk (the reference's chunk_size)."""
LOG2_CHUNK = 6
MAX_DK = 256
"""The largest key (and value) head dim taken: tiles [CHUNK, Dk] and [Dk, BLOCK_V] live in registers."""
TARGET_PROGRAMS = 128
"""The state kernel narrows BLOCK_V while its grid has fewer programs than this (an H200 has 132 SMs)."""
# the solve's dot precision for 16-bit activations: `ft.kernels.options.GatedDeltaOptions.solve_precision`

FP32_PREP_WARPS = 16
"""The prep kernel's warps for fp32 activations. Its exact ("ieee") fp32 products spill: per thread at
Dk = Dv = 128 (sm_90 cubin, offline) 58,984 bytes of stack at 4 warps, 26,160 at 8, 10,608 at 16. The
driver reserves stack for every thread an SM can hold, so 4 warps asked for ~16 GB of local memory and
the launch failed with out-of-memory on a busy H200 (issue 37); 16 warps ask for ~2.9 GB."""

PREP_MIN_BLOCK = 64
"""The prep kernel's smallest head-dim block. Narrower tiles miscompile: with Dv = 32 or 16 (BLOCK_V of
the same width, bf16, 4 warps) Triton 3.6 on the H200 emitted an out-of-range shared-memory address at
the u = T (beta V) product (compute-sanitizer memcheck: "Out-of-range shared or local address" in
`_chunk_prep_kernel`; the launch then fails with an illegal memory access and the CUDA context is
lost). Dv = 64 ran clean at the same Dk, so narrower head dims are padded to 64 columns and masked
(issue 37; bench/RESULTS.md, session 19)."""


@triton.jit
def _tile_mask(m_rows, o_cols, n_cols, EVEN: tl.constexpr):
    """The mask of a [rows, BLOCK] tile: rows where m_rows, columns o_cols < n_cols. EVEN (the caller
    knows that every o_cols < n_cols): the rows alone, broadcast along the columns, so that the
    compiler can vectorize the tile's loads and stores."""
    if EVEN:
        return m_rows[:, None]
    else:
        return m_rows[:, None] & (o_cols < n_cols)[None, :]


@triton.jit
def _l2norm_rows(b_x):
    """Rows of an fp32 tile [R, BLOCK] (masked lanes 0) times 1 / sqrt(sum(x^2) + 1e-6), as the reference
    (correctly rounded 1 / sqrt, as torch on the CPU)."""
    return b_x * tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.sum(b_x * b_x, axis=1) + 1e-6))[:, None]


@triton.jit
def _unit_lower_inverse(b_l, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """(I + L)^-1 of a strictly lower triangular fp32 tile L [CHUNK, CHUNK], by doubling the size of the
    inverted diagonal blocks: if T_s holds the inverses of I + L's diagonal blocks of size 2^s (zeros
    elsewhere), the diagonal blocks of size 2^(s+1), [[A, 0], [C, D]], have inverses
    [[A^-1, 0], [-D^-1 C A^-1, D^-1]], so T_(s+1) = T_s - T_s C_s T_s with C_s = the parts of L that
    lie in the lower-left quarters of the blocks of size 2^(s+1). Exact block substitution (no series),
    two dots per level; T_0 = I, so T_1 = I - C_0 needs none."""
    o_r = tl.arange(0, CHUNK)
    rows = o_r[:, None]
    cols = o_r[None, :]
    b_t = tl.where(rows == cols, 1.0, 0.0) - tl.where((rows >> 1) == (cols >> 1), b_l, 0.0)
    for s in tl.static_range(1, LOG2_CHUNK):
        m_c = ((rows >> (s + 1)) == (cols >> (s + 1))) & ((rows >> s) != (cols >> s))
        b_c = tl.where(m_c, b_l, 0.0)
        b_t = b_t - tl.dot(b_t, tl.dot(b_c, b_t, input_precision=PRECISION), input_precision=PRECISION)
    return b_t


@triton.jit(do_not_specialize=["p_cu", "B", "n_iters"])  # (`conv1d.kernel.VARLEN_UNSPECIALIZED`'s reasons)
def _chunk_prep_kernel(
    p_q, p_k, p_v, p_g, p_beta, p_cu, p_w, p_u, p_gc, p_a, B, n_iters, GROUP, DK, DV, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_wt, stride_wh, stride_ut, stride_uh, stride_gct, stride_at, stride_ah,
    CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr, SOLVE_PRECISION: tl.constexpr, EVEN_K: tl.constexpr = False,
    EVEN_V: tl.constexpr = False,
):
    """One chunk of one value head (the module's docstring). EVEN_K: DK == BLOCK_K, EVEN_V: DV == BLOCK_V
    (no mask along the head dims: `_tile_mask`)."""
    i_p = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = find_seq(p_cu, i_p, B, n_iters, CHUNK)
    start = tl.load(p_cu + i_b)
    end = tl.load(p_cu + i_b + 1)
    t0 = start + (i_p - (start // CHUNK + i_b)) * CHUNK
    if t0 >= end:  # a spare id of its sequence
        return
    dt = p_w.dtype.element_ty  # the activation dtype: dot operands and stored intermediates
    i_hk = i_h // GROUP
    o_r = tl.arange(0, CHUNK)
    rows = t0.to(tl.int64) + o_r
    m_r = rows < end
    o_k = tl.arange(0, BLOCK_K)
    o_v = tl.arange(0, BLOCK_V)
    m_rk = _tile_mask(m_r, o_k, DK, EVEN_K)
    m_rv = _tile_mask(m_r, o_v, DV, EVEN_V)
    b_g = tl.load(p_g + rows * stride_gt + i_h, mask=m_r, other=0.0).to(tl.float32)
    b_beta = tl.load(p_beta + rows * stride_bt + i_h, mask=m_r, other=0.0).to(tl.float32)
    b_gc = tl.cumsum(b_g, axis=0)
    tl.store(p_gc + rows * stride_gct + i_h, b_gc, mask=m_r)
    # NOTE: the steps are ordered so that few tiles are live at once (the [CHUNK, Dk] fp32 tiles die
    # early): this kernel is at the register limit
    m_lower = o_r[:, None] >= o_r[None, :]
    # exp of -inf above the diagonal: 0 there, and no overflow from gc_i - gc_j > 0
    b_decay = tl.exp(tl.where(m_lower, b_gc[:, None] - b_gc[None, :], float("-inf")))
    b_k = tl.load(p_k + rows[:, None] * stride_kt + i_hk * stride_kh + o_k[None, :], mask=m_rk, other=0.0)
    b_k = _l2norm_rows(b_k.to(tl.float32))
    b_kd = b_k.to(dt)
    b_kbg = (b_k * (b_beta * tl.exp(b_gc))[:, None]).to(dt)  # k beta e^gc, the right-hand side of w
    b_kk = tl.dot(b_kd, tl.trans(b_kd), input_precision=PRECISION)  # [CHUNK, CHUNK] fp32
    b_l = tl.where(o_r[:, None] > o_r[None, :], b_kk * b_decay * b_beta[:, None], 0.0)
    b_q = tl.load(p_q + rows[:, None] * stride_qt + i_hk * stride_qh + o_k[None, :], mask=m_rk, other=0.0)
    b_q = _l2norm_rows(b_q.to(tl.float32)) * scale
    b_a = tl.dot(b_q.to(dt), tl.trans(b_kd), input_precision=PRECISION) * b_decay
    tl.store(p_a + rows[:, None] * stride_at + i_h * stride_ah + o_r[None, :], b_a.to(dt), mask=m_r[:, None])
    b_t = _unit_lower_inverse(b_l, CHUNK, LOG2_CHUNK, SOLVE_PRECISION).to(dt)
    b_w = tl.dot(b_t, b_kbg, input_precision=PRECISION)
    tl.store(p_w + rows[:, None] * stride_wt + i_h * stride_wh + o_k[None, :], b_w.to(dt), mask=m_rk)
    b_v = tl.load(p_v + rows[:, None] * stride_vt + i_h * stride_vh + o_v[None, :], mask=m_rv, other=0.0)
    b_u = tl.dot(b_t, (b_v.to(tl.float32) * b_beta[:, None]).to(dt), input_precision=PRECISION)
    tl.store(p_u + rows[:, None] * stride_ut + i_h * stride_uh + o_v[None, :], b_u.to(dt), mask=m_rv)


@triton.jit(do_not_specialize=["p_cu", "p_slots"])  # (`conv1d.kernel.VARLEN_UNSPECIALIZED`'s reasons)
def _chunk_state_kernel(
    p_q, p_k, p_w, p_u, p_gc, p_a, p_ss, p_cu, p_slots, p_o, GROUP, DK, DV, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_wt, stride_wh, stride_ut, stride_uh, stride_gct,
    stride_at, stride_ah, stride_sss, stride_ssh, stride_ssk, stride_ssv, stride_ot, stride_oh,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr = False, EVEN_V: tl.constexpr = False,
):
    """One sequence's chunks in order for one value head and BLOCK_V value dims (the module's
    docstring). EVEN_K: DK == BLOCK_K, EVEN_V: DV % BLOCK_V == 0 (no mask along the head dims:
    `_tile_mask`)."""
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    dt = p_w.dtype.element_ty
    i_hk = i_h // GROUP
    start = tl.load(p_cu + i_b)
    end = tl.load(p_cu + i_b + 1)
    slot = tl.load(p_slots + i_b).to(tl.int64)
    o_r = tl.arange(0, CHUNK)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_k = o_k < DK
    m_kv = _tile_mask(m_k, o_v, DV, EVEN_V)  # the state tile's rows are Dk
    p_s = (p_ss + slot * stride_sss + i_h * stride_ssh + o_k[:, None] * stride_ssk + o_v[None, :] * stride_ssv)
    b_s = tl.load(p_s, mask=m_kv, other=0.0)  # [BLOCK_K, BLOCK_V] fp32
    for i_c in range(0, tl.cdiv(end - start, CHUNK)):
        t0 = start + i_c * CHUNK
        rows = t0.to(tl.int64) + o_r
        m_r = rows < end
        m_rk = _tile_mask(m_r, o_k, DK, EVEN_K)
        m_rv = _tile_mask(m_r, o_v, DV, EVEN_V)
        t_last = tl.minimum(t0 + CHUNK, end) - 1
        b_gc = tl.load(p_gc + rows * stride_gct + i_h, mask=m_r, other=0.0)
        b_gn = tl.load(p_gc + t_last.to(tl.int64) * stride_gct + i_h)
        b_sd = b_s.to(dt)
        b_wc = tl.load(p_w + rows[:, None] * stride_wt + i_h * stride_wh + o_k[None, :], mask=m_rk, other=0.0)
        b_uc = tl.load(p_u + rows[:, None] * stride_ut + i_h * stride_uh + o_v[None, :], mask=m_rv, other=0.0)
        b_un = b_uc.to(tl.float32) - tl.dot(b_wc, b_sd, input_precision=PRECISION)  # [CHUNK, BLOCK_V]
        b_und = b_un.to(dt)
        b_q = tl.load(p_q + rows[:, None] * stride_qt + i_hk * stride_qh + o_k[None, :], mask=m_rk, other=0.0)
        b_q = _l2norm_rows(b_q.to(tl.float32)) * (scale * tl.exp(b_gc))[:, None]
        b_ac = tl.load(p_a + rows[:, None] * stride_at + i_h * stride_ah + o_r[None, :], mask=m_r[:, None], other=0.0)
        b_o = tl.dot(b_q.to(dt), b_sd, input_precision=PRECISION)
        b_o = tl.dot(b_ac, b_und, acc=b_o, input_precision=PRECISION)
        tl.store(p_o + rows[:, None] * stride_ot + i_h * stride_oh + o_v[None, :], b_o.to(p_o.dtype.element_ty),
                 mask=m_rv)
        b_k = tl.load(p_k + rows[:, None] * stride_kt + i_hk * stride_kh + o_k[None, :], mask=m_rk, other=0.0)
        b_k = _l2norm_rows(b_k.to(tl.float32)) * tl.exp(b_gn - b_gc)[:, None]
        b_s = b_s * tl.exp(b_gn)
        b_s = tl.dot(tl.trans(b_k.to(dt)), b_und, acc=b_s, input_precision=PRECISION)
    tl.debug_barrier()  # NOTE: the state's load before its store in every thread (a small tile replicates elements)
    tl.store(p_s, b_s, mask=m_kv)


def _precisions(dtype: torch.dtype) -> tuple[str, str]:
    """(PRECISION, SOLVE_PRECISION): exact products for fp32 activations, else the options' tf32
    for the fp32 solve (16-bit operands are exact in either)."""
    return ("ieee", "ieee") if dtype == torch.float32 else ("ieee", kernel_options().gated_delta.solve_precision)


def prep_config(dk: int, dv: int, dtype: torch.dtype) -> dict:
    """Constexprs and launch options of `_chunk_prep_kernel`. 4 warps, 2 stages: measured on the H200
    (Dk = Dv = 128, bf16) 0.135 ms per 4,096 tokens against 0.245 with 8 warps, though 4 spill a few
    registers and 8 do not (bench/gated_delta_prefill.py). Blocks at least PREP_MIN_BLOCK wide (a head
    dim below it is masked). EVEN_K, EVEN_V: the head dims fill their blocks (no column masks)."""
    precision, solve = _precisions(dtype)
    block_k = max(PREP_MIN_BLOCK, triton.next_power_of_2(dk))
    block_v = max(PREP_MIN_BLOCK, triton.next_power_of_2(dv))
    return {"CHUNK": CHUNK, "LOG2_CHUNK": LOG2_CHUNK, "BLOCK_K": block_k, "BLOCK_V": block_v,
            "PRECISION": precision, "SOLVE_PRECISION": solve, "EVEN_K": dk == block_k, "EVEN_V": dv == block_v,
            "num_warps": FP32_PREP_WARPS if dtype == torch.float32 else 4, "num_stages": 2,
            **dict(kernel_options().gated_delta.prep_launch)}  # (a sweep's launch choices, if any)


def state_configs(batch: int, hv: int, dk: int, dv: int, dtype: torch.dtype) -> list[dict]:
    """`state_config`, then the configurations to fall back to where it needs more shared memory than
    a block may have (`ft.kernels.fit`): fewer stages, then BLOCK_V halved down to 16 with one stage.
    Measured offline (sm_90 cubins of triton 3.9, equal to what the H200's triton 3.6 reported): B 1,
    Hv 32, Dk 256, Dv 128, bf16 (BLOCK_V 32) 309 KiB at 3 stages, 200 at 2, 60 at 1; fp32 Dk = Dv = 128
    281 KiB at 3 stages, 56 at 1; the flagship's bf16 Dk = Dv = 128 fits at its preferred stages."""
    cfg = state_config(batch, hv, dk, dv, dtype)
    narrower, block_v = [], cfg["BLOCK_V"] // 2
    while block_v >= 16:
        narrower.append({"BLOCK_V": block_v, "EVEN_V": dv % block_v == 0})
        block_v //= 2
    return fallback_stages(cfg, *narrower)


def state_config(batch: int, hv: int, dk: int, dv: int, dtype: torch.dtype) -> dict:
    """Constexprs and launch options of `_chunk_state_kernel`, 8 warps: BLOCK_V 64 (2 stages), narrowed
    (32: 3 stages; 16) while the grid has fewer than TARGET_PROGRAMS programs. Measured on the H200
    (Hv 32, Dk = Dv = 128, bf16; bench/gated_delta_prefill.py): 4,096 tokens in 3 sequences 0.22 ms
    at BLOCK_V 64 (0.32 at 32); 16,384 in 16 0.68 (1.0 at 32); 16,384 in one 0.95 at 32 (1.24 at 64:
    64 programs leave half the SMs idle; 1.35 at 16). EVEN_K: Dk == BLOCK_K, EVEN_V: Dv % BLOCK_V == 0
    (no column masks)."""
    change = dict(kernel_options().gated_delta.state_launch)  # (a sweep's launch choices, if any)
    block_v = min(64, max(16, triton.next_power_of_2(dv)))
    while block_v > 16 and batch * hv * triton.cdiv(dv, block_v) < TARGET_PROGRAMS:
        block_v //= 2
    block_v = change.get("BLOCK_V", block_v)
    block_k = max(16, triton.next_power_of_2(dk))
    return {"CHUNK": CHUNK, "BLOCK_K": block_k, "BLOCK_V": block_v, "PRECISION": _precisions(dtype)[0],
            "EVEN_K": dk == block_k, "EVEN_V": dv % block_v == 0, "num_warps": 8,
            "num_stages": 2 if block_v == 64 else 3, **change}


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride along its last dimension (a copy only where it has not)."""
    return x if x.stride(-1) == 1 or x.numel() == 0 else x.contiguous()


def chunk_gated_delta_rule_varlen_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule over sequences packed along T, in two launches; per sequence the math of
    `chunk_gated_delta_rule_ref` (q, k L2-normalised, q scaled by Dk**-0.5; GQA: key head h // (Hv / Hk)).

    Args:
        q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; one dtype of TRITON_DTYPES; any token and head strides, unit
            stride along the head dim (else copied).
        g: [T, Hv] log decay (<= 0), beta: [T, Hv]; any float dtype, any token stride.
        ssm_state: [S, Hv, Dk, Dv] float32, any strides: sequence b's state before its first token at
            slots[b], replaced in place by its state after its last.
        cu_seqlens: [B+1] int32/int64 on q's device: sequence b is tokens cu[b]:cu[b+1]; cu[0] = 0,
            cu[B] = T, nondecreasing (not checked: that would sync). A 0-length sequence keeps its state.
        slots: [B] int32/int64 on q's device, distinct, in range (not checked).
        out: optional o [T, Hv, Dv] in v's dtype with unit stride along Dv.
    Returns:
        o [T, Hv, Dv] in v's dtype.
    Raises:
        ValueError on shapes or dtypes the kernels do not take (Dk or Dv above MAX_DK among them).
    """
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k must be [T, Hk, Dk] and v [T, Hv, Dv], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.dtype not in TRITON_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of {TRITON_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hk == 0 or hv % hk:
        raise ValueError(f"Hk = {hk} must divide Hv = {hv}")
    if not (1 <= dk <= MAX_DK and 1 <= dv <= MAX_DK):
        raise ValueError(f"head dims Dk = {dk}, Dv = {dv} outside 1..{MAX_DK}")
    if g.shape != (t, hv) or beta.shape != (t, hv) or not (g.is_floating_point() and beta.is_floating_point()):
        raise ValueError(f"g and beta must be float [T, Hv] = {(t, hv)}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    if ssm_state.dim() != 4 or ssm_state.shape[1:] != (hv, dk, dv) or ssm_state.dtype != torch.float32:
        raise ValueError(f"ssm_state must be [S, Hv, Dk, Dv] = [S, {hv}, {dk}, {dv}] float32, "
                         f"got {tuple(ssm_state.shape)} {ssm_state.dtype}")
    bsz = check_varlen(q, cu_seqlens, slots)
    if out is None:
        out = torch.empty(t, hv, dv, dtype=v.dtype, device=v.device)
    elif out.shape != (t, hv, dv) or out.dtype != v.dtype or (out.numel() and out.stride(-1) != 1):
        raise ValueError(f"out must be [T, Hv, Dv] = {(t, hv, dv)} {v.dtype} with unit stride along Dv, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if bsz == 0 or t == 0:
        return out
    q, k, v, g, beta = (_unit_last(x) for x in (q, k, v, g, beta))
    dev, dt = q.device, q.dtype
    # per-token intermediates of the first kernel (NOTE: sized by shapes only)
    w = torch.empty(t, hv, dk, dtype=dt, device=dev)
    u = torch.empty(t, hv, dv, dtype=dt, device=dev)
    gc = torch.empty(t, hv, dtype=torch.float32, device=dev)
    a = torch.empty(t, hv, CHUNK, dtype=dt, device=dev)
    group, scale = hv // hk, dk ** -0.5
    prep = prep_config(dk, dv, dt)
    launch_fitting(
        _chunk_prep_kernel, lambda cfg: (t // CHUNK + bsz, hv),
        (q, k, v, g, beta, cu_seqlens, w, u, gc, a, bsz, search_iters(bsz), group, dk, dv, scale,
         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
         w.stride(0), w.stride(1), u.stride(0), u.stride(1), gc.stride(0), a.stride(0), a.stride(1)),
        fallback_stages(prep), key=("gated_delta_prep", dt, g.dtype, beta.dtype, *sorted(prep.items())))
    states = state_configs(bsz, hv, dk, dv, dt)
    launch_fitting(
        _chunk_state_kernel, lambda cfg: (bsz, hv, triton.cdiv(dv, cfg["BLOCK_V"])),
        (q, k, w, u, gc, a, ssm_state, cu_seqlens, slots, out, group, dk, dv, scale,
         q.stride(0), q.stride(1), k.stride(0), k.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
         gc.stride(0), a.stride(0), a.stride(1), *ssm_state.stride(), out.stride(0), out.stride(1)),
        states, key=("gated_delta_state", dt, *sorted(states[0].items())))
    return out
