"""Triton paged prefill attention (details module of `ft.kernels.attention`): causal attention of a
chunk of one sequence's queries over its paged KV (the cached prefix and the chunk itself), flash
style: one program per block of BLOCK_M query tokens and one kv head, the group's query heads as
rows of one tile (token-major: row r is token r // BLOCK_G, head r % BLOCK_G), K/V tiles gathered
through the page table, online softmax in fp32 (base 2). Same contract as `paged_attention_ref`,
fp8 and NVFP4 caches included (tiles dequantized by `decode_loops.load_kv_tile`, the K scale folded into
the softmax scale, the V scale into the output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.attention.decode_loops import d_mask, load_kv_tile
from ft.kernels.attention.kernel import LOG2E, MAX_HEAD_DIM, check_cache, kv_args
from ft.kernels.fit import fallback_stages, launch_fitting

__all__ = ["CAUSAL_SPLIT", "paged_prefill_attention_triton", "prefill_config", "prefill_configs"]

CAUSAL_SPLIT = True
"""`_prefill_kernel`'s two-loop form (unmasked blocks, then the diagonal's) with the scale inside
exp2's FMA; with it, by default, the lazy maxima on bf16 / fp8 caches and the fp16 dots on NVFP4
ones (not with an fp32 q). H200 (bench/prefill_attention.py, a 4,096-token chunk after a 258,048-token
prefix, 16/2 heads, D 256, 2026-12-01): bf16 46.3 ms (the one-loop kernel) -> 41.7 (split) -> 34.3
(split + lazy), 377 -> 509 TFLOP/s; NVFP4 94.1 -> 86.2 (split) -> 80.9 ms (split + fp16 dots; with
the lazy maxima no better, 86.3). The one-loop kernel stays for CAUSAL_SPLIT=False (tests, benches)."""


@triton.jit
def _attend_block(b_q, b_m, b_l, b_acc, p_k, p_v, p_pt, n0, bound, q_pos, qk_scale, stride_kcp, stride_kcs,
                  stride_vcp, stride_vcs, D, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  PRECISION: tl.constexpr, KV_FP8: tl.constexpr, KV_NVFP4: tl.constexpr, EVEN_D: tl.constexpr,
                  CAUSAL: tl.constexpr, LAZY_RESCALE: tl.constexpr = False, NVFP4_F16: tl.constexpr = False,
                  NVFP4_WORDS: tl.constexpr = False):
    """One step of `_prefill_kernel`'s CAUSAL_SPLIT loops over keys n0 .. n0+BLOCK_N-1 (those < bound):
    the online softmax's (max m in scaled units, sum l, accumulator) updated. CAUSAL: mask key n from
    row r unless n <= q_pos[r] and n < bound; else every key of the block is visible to every row.
    LAZY_RESCALE: the maxima move (and the accumulator is rescaled) only when one grows by more than 8.
    NVFP4_F16: b_q is fp16 and the NVFP4 tiles are decoded in fp16 (`nvfp4_tile_f16`), p too."""
    o_n = n0 + tl.arange(0, BLOCK_N)
    m_n = o_n < bound
    b_page = tl.load(p_pt + o_n // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
    o_slot = o_n % PAGE_SIZE
    b_k = load_kv_tile(p_k, b_page * stride_kcp + o_slot * stride_kcs, m_n, D, b_q.dtype, BLOCK_N, BLOCK_D, KV_FP8,
                       KV_NVFP4, EVEN_D, NVFP4_F16, NVFP4_WORDS)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)  # [R, BLOCK_N], unscaled
    if CAUSAL:
        b_s = tl.where((o_n[None, :] <= q_pos[:, None]) & m_n[None, :], b_s, float("-inf"))
    # NOTE: key 0 is visible to every row, so the first block leaves every row's max finite
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1) * qk_scale)
    if LAZY_RESCALE:
        # keep the old maxima (and skip the accumulator's rescale) unless some row's grew by more
        # than 8 (log2 units): the reference of m, l and acc stays one, so the result is the same
        # softmax, its terms bounded by 2**8 (fp32 l and acc, bf16 p: no overflow, same precision)
        if tl.max(b_m_new - b_m, axis=0) > 8.0:
            b_alpha = tl.exp2(b_m - b_m_new)
            b_l = b_l * b_alpha
            b_acc = b_acc * b_alpha[:, None]
            b_m = b_m_new
        b_p = tl.exp2(b_s * qk_scale - b_m[:, None])
        b_l = b_l + tl.sum(b_p, axis=1)
        b_v = load_kv_tile(p_v, b_page * stride_vcp + o_slot * stride_vcs, m_n, D, b_q.dtype, BLOCK_N, BLOCK_D,
                           KV_FP8, KV_NVFP4, EVEN_D, NVFP4_F16, NVFP4_WORDS)
        b_acc = b_acc + tl.dot(b_p.to(b_q.dtype), b_v, input_precision=PRECISION)
        return b_m, b_l, b_acc
    b_alpha = tl.exp2(b_m - b_m_new)
    b_p = tl.exp2(b_s * qk_scale - b_m_new[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    b_v = load_kv_tile(p_v, b_page * stride_vcp + o_slot * stride_vcs, m_n, D, b_q.dtype, BLOCK_N, BLOCK_D, KV_FP8,
                       KV_NVFP4, EVEN_D, NVFP4_F16, NVFP4_WORDS)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_q.dtype), b_v, input_precision=PRECISION)
    return b_m_new, b_l, b_acc


# NOTE: start and T are not specialized (Triton's 1 and multiple-of-16 variants): a mixed step's chunk
# starts and ends anywhere (its token budget less the decode rows), and on the H200 each such variant
# compiled on the request path, a ~3.3 s stall of every stream in the first two waves of 32 1K prompts
# through `ft serve` (bench/RESULTS.md, session 27); they only bound rows and place positions
@triton.jit(do_not_specialize=["start", "T"])
def _prefill_kernel(
    p_q, p_kc, p_vc, p_pt, p_o, p_kvs, p_lse, start, T, G, D, qk_scale,
    stride_qt, stride_qh, stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    stride_ot, stride_oh,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr, KV_NVFP4: tl.constexpr = False,
    EVEN_D: tl.constexpr = False, CAUSAL_SPLIT: tl.constexpr = False, LAZY_RESCALE: tl.constexpr = False,
    NVFP4_F16: tl.constexpr = False, NVFP4_WORDS: tl.constexpr = False, HAS_LSE: tl.constexpr = False,
):
    """Grid (T / BLOCK_M, Hkv). CAUSAL_SPLIT: two key loops, the blocks every row of the program sees
    whole (no causal mask, no bound check) and then the blocks across the diagonal (masked); and the
    softmax scale applied inside exp2's argument (one FMA per score: exp2(s * scale - m), m kept in
    scaled units). Without it: one masked loop, scores scaled as they leave the dot.
    LAZY_RESCALE (with CAUSAL_SPLIT, its unmasked loop): `_attend_block`'s lazy maxima.
    NVFP4_F16 (with CAUSAL_SPLIT and KV_NVFP4): both dots in fp16 (q rounded to fp16 once, the tiles
    decoded exactly in fp16, p in fp16), fp32 accumulation: no per-element fp32 round trip in the
    decode. q must lie inside fp16's range (|q| < 65,504: normalized queries do); p's 11 bits are
    finer than bf16's 8. NVFP4_WORDS (set by the launcher when D == BLOCK_D and D % 64 == 0): the
    fp16 tiles decoded a word at a time (`nvfp4_tile_f16_words`). HAS_LSE: also each row's log-sum-exp
    of its scaled scores (natural log, float32 [Hq, T] at p_lse), for a merge with other keys' parts."""
    i_m = tl.program_id(0)
    i_kv = tl.program_id(1)
    R: tl.constexpr = BLOCK_M * BLOCK_G
    o_r = tl.arange(0, R)
    o_t = i_m * BLOCK_M + o_r // BLOCK_G  # query token within the chunk
    o_h = i_kv * G + o_r % BLOCK_G  # query head
    m_r = (o_t < T) & (o_r % BLOCK_G < G)
    o_d = tl.arange(0, BLOCK_D)
    m_rd = d_mask(m_r, o_d, D, EVEN_D)
    b_q = tl.load(p_q + o_t[:, None] * stride_qt + o_h[:, None] * stride_qh + o_d[None, :], mask=m_rd, other=0.0)
    if KV_FP8 or KV_NVFP4:
        qk_scale = qk_scale * tl.load(p_kvs)
    q_pos = start + o_t  # absolute positions; key n is visible to row r when n <= q_pos[r]
    hi = tl.minimum(start + i_m * BLOCK_M + BLOCK_M, start + T)  # past the block's last query: masked anyway
    p_k = p_kc + i_kv * stride_kch
    p_v = p_vc + i_kv * stride_vch
    b_m = tl.full((R,), float("-inf"), dtype=tl.float32)
    b_l = tl.zeros((R,), dtype=tl.float32)
    b_acc = tl.zeros((R, BLOCK_D), dtype=tl.float32)
    if CAUSAL_SPLIT:
        F16: tl.constexpr = NVFP4_F16 and KV_NVFP4
        if F16:
            b_q = b_q.to(tl.float16)
        # keys [0, lo): visible to every row of the block (n <= its first query's position)
        lo = (start + i_m * BLOCK_M + 1) // BLOCK_N * BLOCK_N
        for n0 in range(0, lo, BLOCK_N):
            b_m, b_l, b_acc = _attend_block(b_q, b_m, b_l, b_acc, p_k, p_v, p_pt, n0, lo, q_pos, qk_scale, stride_kcp,
                                            stride_kcs, stride_vcp, stride_vcs, D, PAGE_SIZE, BLOCK_N, BLOCK_D,
                                            PRECISION, KV_FP8, KV_NVFP4, EVEN_D, False, LAZY_RESCALE, F16,
                                            NVFP4_WORDS)
        for n0 in tl.range(lo, hi, BLOCK_N, num_stages=1):  # 1-2 blocks: not worth a pipeline's registers
            b_m, b_l, b_acc = _attend_block(b_q, b_m, b_l, b_acc, p_k, p_v, p_pt, n0, hi, q_pos, qk_scale, stride_kcp,
                                            stride_kcs, stride_vcp, stride_vcs, D, PAGE_SIZE, BLOCK_N, BLOCK_D,
                                            PRECISION, KV_FP8, KV_NVFP4, EVEN_D, True, False, F16, NVFP4_WORDS)
    else:
        for n0 in range(0, hi, BLOCK_N):
            o_n = n0 + tl.arange(0, BLOCK_N)
            m_n = o_n < hi
            b_page = tl.load(p_pt + o_n // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
            o_slot = o_n % PAGE_SIZE
            b_k = load_kv_tile(p_k, b_page * stride_kcp + o_slot * stride_kcs, m_n, D, b_q.dtype, BLOCK_N, BLOCK_D,
                               KV_FP8, KV_NVFP4, EVEN_D)
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * qk_scale  # [R, BLOCK_N]
            visible = (o_n[None, :] <= q_pos[:, None]) & m_n[None, :]
            b_s = tl.where(visible, b_s, float("-inf"))
            # NOTE: key 0 is visible to every row, so the first block leaves every row's max finite
            b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
            b_alpha = tl.exp2(b_m - b_m_new)
            b_p = tl.exp2(b_s - b_m_new[:, None])
            b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
            b_v = load_kv_tile(p_v, b_page * stride_vcp + o_slot * stride_vcs, m_n, D, b_q.dtype, BLOCK_N, BLOCK_D,
                               KV_FP8, KV_NVFP4, EVEN_D)
            b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_q.dtype), b_v, input_precision=PRECISION)
            b_m = b_m_new
    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    if HAS_LSE:  # m is in log2 units with the scale in (both loop forms): log2-sum-exp = m + log2(l)
        tl.store(p_lse + o_h * T + o_t, (b_m + tl.log2(b_l)) * 0.6931471805599453, mask=m_r)  # x ln 2
    if KV_FP8 or KV_NVFP4:
        b_o = b_o * tl.load(p_kvs + 1)
    tl.store(p_o + o_t[:, None] * stride_ot + o_h[:, None] * stride_oh + o_d[None, :], b_o.to(p_o.dtype.element_ty),
             mask=m_rd)


def _word_aligned(*caches: torch.Tensor) -> bool:
    """Whether every row of these caches starts on a 4-byte boundary (base and strides): the
    NVFP4 tiles' 32-bit word loads (`decode_loops.nvfp4_tile_f16_words`, this kernel's NVFP4_WORDS) need it."""
    return all(c.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in c.stride()[:-1]) for c in caches)


def prefill_config(head_dim: int, group: int, dtype: torch.dtype) -> dict:
    """Block sizes: 128 query rows (tokens x the group's heads) in 8 warps, 64 keys per step. H200
    (bench/prefill_attention.py, D 256, G 8, a 4,096-token chunk, 2026-12-01): 8 warps hold the
    [128, 256] fp32 accumulator in registers (4 warps spilled it: 82 against 278 TFLOP/s at a
    258K prefix); 64 keys a step 371 TFLOP/s against 278 for 32 (NVFP4 cache: 182 against 148)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_g = triton.next_power_of_2(max(1, group))
    return {"BLOCK_G": block_g, "BLOCK_M": max(1, 128 // block_g) if block_g <= 128 else 1, "BLOCK_N": 64,
            "BLOCK_D": block_d, "PRECISION": "ieee" if dtype == torch.float32 else "tf32", "num_warps": 8,
            "num_stages": 2, "CAUSAL_SPLIT": CAUSAL_SPLIT, "LAZY_RESCALE": None, "NVFP4_F16": None,
            "NVFP4_WORDS": False}


def paged_prefill_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, start: int,
    scale: float, kv_scale: torch.Tensor | None = None, *, config: dict | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention_ref` on Triton: q [T, Hq, D] at positions start .. start+T-1 (any strides but
    D's) -> [T, Hq, D] in q's dtype, over k_cache, v_cache [P, page_size, Hkv, R] (R = D, or
    D/2 + D/16 uint8 for NVFP4) through page_table [n] int64 (covering start+T positions);
    kv_scale: float32 [2] of an fp8 or NVFP4 cache (required then); lse: a contiguous float32 [Hq, T]
    that receives each query's log-sum-exp (`paged_attention_lse_ref`).

    Raises: ValueError on shapes or dtypes the kernel does not take."""
    cache_d = check_cache(k_cache, v_cache)
    t, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    if cache_d != d or hq % hkv or d > MAX_HEAD_DIM:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q must be fp32/bf16/fp16, got {q.dtype}")
    if page_table.dim() != 1 or page_table.numel() * page < start + t:
        raise ValueError(f"page_table [{page_table.numel()}] pages of {page} do not cover {start + t} positions")
    q = q if q.stride(-1) == 1 else q.contiguous()
    page_table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    if lse is not None and (lse.dtype != torch.float32 or lse.shape != (hq, t) or not lse.is_contiguous()):
        raise ValueError(f"lse must be a contiguous float32 [{hq}, {t}], got {lse.dtype} {tuple(lse.shape)}")
    out = torch.empty_like(q)
    if t == 0:
        return out
    k_cache, v_cache, kvs, kv_flags = kv_args(k_cache, v_cache, kv_scale, q)
    g = hq // hkv
    cfg = {**prefill_config(d, g, q.dtype), **(config or {})}
    cfg["EVEN_D"] = d == cfg["BLOCK_D"]  # no mask along D: vectorized loads
    nvfp4 = kv_flags["KV_NVFP4"]
    if cfg["LAZY_RESCALE"] is None:  # measured: lazy maxima win on bf16 (1.22x at a 258K prefix), not on NVFP4
        cfg["LAZY_RESCALE"] = not nvfp4
    if cfg["NVFP4_F16"] is None:  # measured: fp16 dots win on NVFP4 (1.07x over split alone); exact path for fp32
        cfg["NVFP4_F16"] = nvfp4 and q.dtype != torch.float32
    cfg["NVFP4_WORDS"] = cfg["EVEN_D"] and d % 64 == 0 and _word_aligned(k_cache, v_cache)  # with NVFP4_F16
    flags = {"PAGE_SIZE": page, "HAS_LSE": lse is not None, **kv_flags}
    configs = prefill_configs(cfg)
    launch_fitting(
        _prefill_kernel, lambda c: (triton.cdiv(t, c["BLOCK_M"]), hkv),
        (q, k_cache, v_cache, page_table, out, kvs, out if lse is None else lse, start, t, g, d, scale * LOG2E,
         q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1)),
        configs, key=("prefill_attention", q.dtype, k_cache.dtype, *sorted(flags.items()), *sorted(cfg.items())),
        **flags)
    return out


def prefill_configs(config: dict) -> list[dict]:
    """`config`, then what to fall back to where it needs more shared memory than a block may have
    (`ft.kernels.fit`): fewer stages, then 32 keys a step, then half the query rows (while a tile keeps
    16 rows, `tl.dot`'s least). Measured offline (sm_90, triton 3.9, equal to the H200's report): D 256,
    G 1, fp32 at 2 stages 288 KiB."""
    narrower = [{"BLOCK_N": 32}]
    if config["BLOCK_M"] * config["BLOCK_G"] >= 32:
        narrower.append({"BLOCK_N": 32, "BLOCK_M": config["BLOCK_M"] // 2})
    return fallback_stages(config, *narrower)
