"""Compile every Triton kernel the CUDA path launches, with its default configurations, for sm_90
(Hopper) without a GPU: ASTSource -> cubin with the ptxas that the triton wheel carries.

Run by tests/test_kernels_compile.py in a subprocess (the interpreter, which the other kernel tests
turn on, must be off here). Catches what the interpreter does not: type errors across control flow,
layouts or tiles the compiler rejects. Prints one line per kernel; exit status 1 if any failed.
`--regs` adds registers, stack (spills) and shared memory; `--loops` each loop's SASS instruction mix; `--ops`
the whole kernel's; `--only S` the cases named with S; `--loads` adds each kernel's global load instructions by kind (`load_counts`: scalar loads where
16-byte ones were meant show a mask the compiler could not see through).
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ft.kernels.activation import kernel as act  # noqa: E402
from ft.kernels.attention import kernel as attn  # noqa: E402
from ft.kernels.attention import decode_tuning as attn_tuning  # noqa: E402
from ft.kernels.attention import prefill_kernel as attn_pf  # noqa: E402
from ft.kernels.attention import sparse_decode as attn_sparse  # noqa: E402
from ft.kernels.dense import kernel as dense  # noqa: E402
from ft.kernels.engram import kernel as engram  # noqa: E402
from ft.kernels.gated_delta import kernel as gd  # noqa: E402
from ft.kernels.gated_delta import chunk_kernel as gd_chunk  # noqa: E402
from ft.kernels.hyper_connection import kernel as hc  # noqa: E402
from ft.kernels.conv1d import kernel as conv  # noqa: E402
from ft.kernels.moe import decode_kernel as moe_dec  # noqa: E402
from ft.kernels.moe import grouped_kernel as moe_grp  # noqa: E402
from ft.kernels.moe import kernel as moe  # noqa: E402
from ft.kernels.moe import pair_tiles as moe_tiles  # noqa: E402
from ft.kernels.norm import kernel as norm  # noqa: E402
from ft.kernels.nvfp4 import kernel as nv  # noqa: E402
from ft.kernels.nvfp4 import dequant_kernel as nv_dq  # noqa: E402
from ft.kernels.nvfp4 import f16_rows as nv_rows  # noqa: E402
from ft.kernels.router import kernel as router  # noqa: E402
from ft.kernels.expert_lookup import kernel as lookup  # noqa: E402
from ft.kernels.options import kernel_options  # noqa: E402

OPTIONS = kernel_options()  # the defaults: the variants the engine runs

TARGET = GPUTarget("cuda", 90, 32)


def ints(*names: str) -> dict:
    return {n: "i32" for n in names}


GEMV = {"p_x": "*bf16", "p_w": "*i32", "p_s": "*u8", "p_s2": "*fp32", "p_y": "*bf16",
        **ints("M", "N", "K", "stride_xm", "stride_wn", "stride_sn", "stride_ym")}
DOT = {**GEMV, "p_w": "*u8", "p_part": "*fp32", "p_count": "*i32", "K_SPLIT": "i32", "p_xs": "*fp32"}
GATE_UP = {"p_x": "*bf16", "p_slots": "*i32", "p_w13": "*i32", "p_s13": "*u8", "p_s2": "*fp32", "p_h": "*fp32",
           **ints("I", "H", "TOPK", "stride_xt", "stride_w13e", "stride_w13r", "stride_s13e", "stride_s13r",
                  "stride_s2e", "stride_ht")}
DOWN_PAIRS = {"p_h": "*fp32", "p_slots": "*i32", "p_wts": "*bf16", "p_w2": "*i32", "p_s2w": "*u8", "p_s2": "*fp32",
              "p_yp": "*fp32", **ints("I", "H", "stride_ht", "stride_w2e", "stride_w2r", "stride_s2we", "stride_s2wr",
                                      "stride_s2e", "stride_yp")}
SUM = {"p_yp": "*fp32", "p_out": "*bf16", **ints("H", "TOPK", "stride_yp", "stride_ot")}
TILES = {"p_tile_start": "*i32", "p_tile_end": "*i32", "p_sorted": "*i32", "p_order": "*i32"}
G_GATE_UP = {"p_x": "*bf16", **TILES, "p_w13": "*u8", "p_s13": "*u8", "p_s2": "*fp32", "p_h": "*bf16",
             **ints("I", "H", "TOPK", "stride_xt", "stride_w13e", "stride_w13r", "stride_s13e", "stride_s13r",
                    "stride_s2e", "stride_hp")}
G_DOWN = {"p_h": "*bf16", **TILES, "p_wts": "*bf16", "p_w2": "*u8", "p_s2w": "*u8", "p_s2": "*fp32", "p_y": "*bf16",
          **ints("I", "H", "TOPK", "stride_hp", "stride_w2e", "stride_w2r", "stride_s2we", "stride_s2wr",
                 "stride_s2e", "stride_yp")}
LOOKUP = {"p_ids": "*i64", "p_table": "*i64", "p_step": "*i32", "p_last": "*i32", "p_claim": "*i32",
          "p_landing": "*i32", "p_used": "*i32", "p_landed": "*i32", "p_counters": "*i64", "p_slots": "*i32",
          "p_dst": "*i32", "K": "i32", "R": "i32", "stride_it": "i32", "stride_st": "i32", "stride_dt": "i32"}
LOOKUP_OWNED = {**{k: v for k, v in LOOKUP.items() if k != "K"}, "p_owner": "*i32", "p_order": "*i32",
                **ints("layer_base", "T", "K")}
COMMIT = {"p_table": "*i64", "p_landing": "*i32", "p_landed": "*i32", **ints("stride_tl", "stride_ll", "R")}
ROUTER = {"p_logits": "*bf16", "p_w": "*bf16", "p_ids": "*i64", "p_table": "*i64", "p_slots": "*i32",
          **ints("E", "K", "stride_lt", "stride_wt", "stride_it", "stride_st")}
MOE_DECODE_GATE_UP = {"p_x": "*bf16", "p_slots": "*i32", "p_ids": "*i64", "p_dst": "*i32", "p_w13": "*i32",
                      "p_s13": "*u8", "p_s2": "*fp32", "p_sw13": "*i32", "p_ss13": "*u8", "p_ss2": "*fp32",
                      "p_hw13": "*i32", "p_hs13": "*u8", "p_hs2": "*fp32", "p_h": "*fp32", "p_live": "*i64",
                      **ints("I", "H", "stride_xt", "stride_st", "stride_it", "stride_dt", "stride_w13e", "stride_w13r",
                             "stride_s13e", "stride_s13r", "stride_s2e", "stride_hw13e", "stride_hs13e",
                             "stride_hs2e", "stride_ht")}
MOE_DECODE_DOWN_PAIRS = {"p_h": "*fp32", "p_slots": "*i32", "p_ids": "*i64", "p_dst": "*i32", "p_wts": "*bf16",
                         "p_w2": "*i32", "p_s2w": "*u8", "p_s2": "*fp32", "p_sw2": "*i32", "p_ss2w": "*u8",
                         "p_ss2": "*fp32", "p_hw2": "*i32", "p_hs2w": "*u8", "p_hs2": "*fp32", "p_yp": "*fp32",
                         "p_live": "*i64",
                         **ints("I", "H", "stride_ht", "stride_st", "stride_it", "stride_dt", "stride_wt", "stride_w2e",
                                "stride_w2r", "stride_s2we", "stride_s2wr", "stride_s2e", "stride_hw2e",
                                "stride_hs2we", "stride_hs2e", "stride_yp"),
                         "p_count": "*i32", "p_y": "*bf16", "stride_yt": "i32"}
MOE_SUM_NORM = {"p_yp": "*fp32", "p_r": "*bf16", "p_w": "*bf16", "p_x": "*bf16", "p_h": "*bf16", "H": "i32",
                "eps": "fp32", **ints("stride_yp", "stride_rt", "stride_xt", "stride_ht")}
MOE_DECODE_DOWN = {"p_h": "*fp32", "p_slots": "*i32", "p_wts": "*bf16", "p_w2": "*i32", "p_s2w": "*u8", "p_s2": "*fp32",
                   "p_sw2": "*i32", "p_ss2w": "*u8", "p_ss2": "*fp32", "p_out": "*bf16", "p_live": "*i64",
                   **ints("I", "H", "stride_ht", "stride_st", "stride_wt", "stride_w2e", "stride_w2r", "stride_s2we",
                          "stride_s2wr", "stride_s2e", "stride_ot")}
WRITE_KV = {"p_k": "*bf16", "p_v": "*bf16", "p_kc": "*bf16", "p_vc": "*bf16", "p_slot": "*i64", "p_kvs": "*fp32",
            **ints("H", "D", "page_size", "stride_kb", "stride_kh", "stride_vb", "stride_vh", "stride_kcp",
                   "stride_kcs", "stride_kch", "stride_vcp", "stride_vcs", "stride_vch"),
            "p_x": "*bf16", "p_xc": "*bf16", **ints("DX", "stride_xb", "stride_xcp", "stride_xcs")}
DECODE_IN = {"p_q": "*bf16", "p_kc": "*bf16", "p_vc": "*bf16", "p_pt": "*i64", "p_seq": "*i32"}
DECODE_STRIDES = ("stride_qb", "stride_qh", "stride_kcp", "stride_kcs", "stride_kch", "stride_vcp", "stride_vcs",
                  "stride_vch", "stride_ptb")
DECODE = {**DECODE_IN, "p_g": "*bf16", "p_o": "*bf16", "p_kvs": "*fp32", "qk_scale": "fp32",
          **ints("G", "D", *DECODE_STRIDES, "stride_gb", "stride_gh", "stride_ob", "stride_oh")}
DECODE_SPLIT = {**DECODE_IN, "p_acc": "*fp32", "p_st": "*fp32", "p_kvs": "*fp32", "qk_scale": "fp32",
                **ints("G", "D", *DECODE_STRIDES, "stride_ar", "stride_ah", "stride_sr", "stride_sh")}
PREFILL = {"p_q": "*bf16", "p_kc": "*bf16", "p_vc": "*bf16", "p_pt": "*i64", "p_o": "*bf16", "p_kvs": "*fp32",
           "p_lse": "*fp32",
           **ints("start", "T", "G", "D"), "qk_scale": "fp32",
           **ints("stride_qt", "stride_qh", "stride_kcp", "stride_kcs", "stride_kch", "stride_vcp", "stride_vcs",
                  "stride_vch", "stride_ot", "stride_oh")}
COMBINE = {"p_acc": "*fp32", "p_st": "*fp32", "p_g": "*bf16", "p_o": "*bf16",
           **ints("S", "D", "stride_ar", "stride_ah", "stride_sr", "stride_sh", "stride_gb", "stride_gh", "stride_ob",
                  "stride_oh")}
RMS_NORM = {"p_x": "*bf16", "p_r": "*bf16", "p_w": "*bf16", "p_y": "*bf16", "p_h": "*bf16", "D": "i32", "eps": "fp32",
            **ints("stride_xt", "stride_rt", "stride_yt", "stride_ht")}
GATED_NORM = {"p_x": "*bf16", "p_g": "*bf16", "p_w": "*bf16", "p_y": "*bf16", "N": "i32", "D": "i32", "eps": "fp32",
              **ints("stride_xt", "stride_gt", "stride_yt", "G_ROWS", "stride_gg")}
QK_NORM_ROPE = {"p_q": "*bf16", "p_k": "*bf16", "p_qw": "*bf16", "p_kw": "*bf16", "p_pos": "*i64", "p_inv": "*fp32",
                "p_qo": "*bf16", "p_ko": "*bf16", "HQ": "i32", "D": "i32", "HALF": "i32", "eps": "fp32",
                **ints("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_qot", "stride_qoh", "stride_kot",
                       "stride_koh")}

GD_CONV = {"p_x": "*bf16", "p_w": "*bf16", "p_cs": "*bf16", "p_slots": "*i64", "p_y": "*bf16", "C": "i32",
           **ints("stride_xb", "stride_wc", "stride_css", "stride_csc", "stride_csw", "stride_yb"),
           "p_h": "*bf16", "p_wba": "*bf16", "p_ba": "*bf16", **ints("N_BA", "stride_hb", "stride_wba", "stride_bab")}
GD_DELTA = {"p_y": "*bf16", "p_b": "*bf16", "p_a": "*bf16", "p_alog": "*bf16", "p_dt": "*bf16", "p_ss": "*fp32",
            "p_slots": "*i64", "p_o": "*bf16", **ints("HK", "GROUP", "DK", "DV"), "scale": "fp32",
            **ints("stride_yb", "stride_bb", "stride_ab", "stride_sss", "stride_ssh", "stride_ssk", "stride_ssv",
                   "stride_ob", "stride_oh")}
GD_CONV_LAUNCH = {"stride_csw": 1, "_plain": ("stride_csc",), "_divisible": ("C",)}
GD_DELTA_LAUNCH = {"stride_ssv": 1, "_divisible": ("DK", "DV")}
CONV_VARLEN = {"p_x": "*bf16", "p_w": "*bf16", "p_cs": "*bf16", "p_cu": "*i32", "p_slots": "*i64", "p_y": "*bf16",
               **ints("B", "C", "n_iters", "stride_xt", "stride_wc", "stride_css", "stride_csc", "stride_csw",
                      "stride_yt")}
GD_CHUNK_PREP = {"p_q": "*bf16", "p_k": "*bf16", "p_v": "*bf16", "p_g": "*fp32", "p_beta": "*bf16", "p_cu": "*i32",
                 "p_w": "*bf16", "p_u": "*bf16", "p_gc": "*fp32", "p_a": "*bf16", **ints("B", "n_iters", "GROUP", "DK", "DV"),
                 "scale": "fp32", **ints("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                                         "stride_gt", "stride_bt", "stride_wt", "stride_wh", "stride_ut", "stride_uh",
                                         "stride_gct", "stride_at", "stride_ah")}
GD_CHUNK_STATE = {"p_q": "*bf16", "p_k": "*bf16", "p_w": "*bf16", "p_u": "*bf16", "p_gc": "*fp32", "p_a": "*bf16",
                  "p_ss": "*fp32", "p_cu": "*i32", "p_slots": "*i64", "p_o": "*bf16", **ints("GROUP", "DK", "DV"),
                  "scale": "fp32", **ints("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_wt", "stride_wh",
                                          "stride_ut", "stride_uh", "stride_gct", "stride_at", "stride_ah", "stride_sss",
                                          "stride_ssh", "stride_ssk", "stride_ssv", "stride_ot", "stride_oh")}


SPARSE = {"p_q": "*bf16", "p_k": "*bf16", "p_v": "*bf16", "p_pt": "*i32", "p_tok": "*i64", "p_acc": "*fp32",
          "p_st": "*fp32", "p_kvs": "*fp32", "p_g": "*bf16", "p_o": "*bf16", **ints("W", "G", "D"), "qk_scale": "fp32",
          **ints("stride_qb", "stride_qh", "stride_kp", "stride_ks", "stride_kh", "stride_vp", "stride_vs",
                 "stride_vh", "stride_ptb", "stride_tb", "stride_ar", "stride_ah", "stride_sr", "stride_sh",
                 "stride_gb", "stride_gh", "stride_ob", "stride_oh")}
SPARSE_CFG = {"TILES": 65, "PAGE_SIZE": 64, "BLOCK_G": 16, "BLOCK_D": 256, "PRECISION": "tf32", "KV_FP8": False,
              "KV_NVFP4": False, "EVEN_D": True}
"""QSA's lists of 2,051 positions in one split of 65 tiles (a prefill's launch; a decode's splits take fewer)."""


def prefill_cfg(head_dim: int, group: int) -> dict:
    cfg = {"PAGE_SIZE": 64, **attn_pf.prefill_config(head_dim, group, torch.bfloat16)}
    # the wrapper's choices; a case names its own LAZY_RESCALE / NVFP4_F16 where it wants them on
    return {**cfg, "EVEN_D": head_dim == cfg["BLOCK_D"], "LAZY_RESCALE": False, "NVFP4_F16": False, "HAS_LSE": False}


def decode_cfg(head_dim: int, group: int, fp8: bool = False, nvfp4: bool = False) -> dict:
    # every constexpr named
    cfg = {"PAGE_SIZE": 64, **attn_tuning.decode_config(head_dim, group, torch.bfloat16), "KV_FP8": fp8, "KV_NVFP4": nvfp4}
    # the byte-permute halves (NVFP4_PRMT, the NVFP4 default) only where a case names them, with the wrapper's
    # block size, stages and the PTX on (as on a GPU)
    return {**cfg, "EVEN_D": head_dim == cfg["BLOCK_D"], "NVFP4_PRMT": False}  # EVEN_D as the wrapper sets it


def gemv_cfg(m: int, n: int, k: int) -> dict:
    cfg = dict(nv._gemv_config(m, n, k))
    cfg["WHOLE_K"], cfg["WHOLE_K2"] = nv.whole_k_split(m, k) if cfg.pop("WHOLE_K", False) else (0, 0)
    cfg["ASM"] = OPTIONS.nvfp4.lanes_ptx and cfg["WHOLE_K"] > 0  # as the wrapper sets it on a CUDA device
    return cfg


HC_UP_MIX = {"p_zp": "*fp32", "p_up": "*bf16", "p_n": "*bf16", "p_u": "*bf16", "p_gl": "*bf16",
             **ints("T", "S", "stride_zp", "D"), "inv_c": "fp32",
             **ints("stride_upr", "stride_nt", "stride_ut", "stride_glt"), "p_wn": "*bf16", "p_ss": "*fp32", "eps": "fp32"}
"""`_read_up_mix_streams_kernel`'s signature as the deferred norm launches it (its norm weight bf16; a plain
read passes z_part there, fp32)."""


def dot_cfg(m: int, n: int, k: int) -> dict:
    cfg = {"SWAP_AB": False, **nv._dot_config(m, n, k), "PRECISION": "tf32"}  # every constexpr named
    halves = OPTIONS.nvfp4.dot_halves and m <= 64 and k % cfg["BLOCK_K"] == 0 and cfg["BLOCK_K"] % 64 == 0 and not cfg["SWAP_AB"]
    return {**cfg, "EVEN_K": k % cfg["BLOCK_K"] == 0, "HALVES": halves,
            "ASM": halves}  # as the wrapper sets them (bf16 x)


def moe_cfg(config: tuple, k_words: int, rows: str, whole: bool = True) -> dict:
    r, w, warps = config
    out = {rows: r, "BLOCK_W": max(2, w or 64), "num_warps": warps}
    if whole:
        out["WHOLE_K"] = k_words if w == 0 else 0
        out["ASM"] = OPTIONS.nvfp4.lanes_ptx and out["WHOLE_K"] > 0  # as `moe_decode_triton` sets it on a CUDA device
    return out


def short_grouped_cfg() -> dict:
    bm, bn, bk, warps, stages, swap = moe_grp.GROUPED_CONFIG_SHORT
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PRECISION": "tf32", "EVEN_K": True, "SWAP_AB": swap,
            "WORDS": OPTIONS.moe.grouped_words, "H_SORTED": OPTIONS.moe.grouped_h_sorted,
            "COLUMNS_FIRST": OPTIONS.moe.grouped_columns_first, "num_warps": warps, "num_stages": stages}


def grouped_cfg(which: int = 0) -> dict:
    """GROUPED_CONFIG's tile of the gate_up (0) or the down (1) pass."""
    bm, bn, bk, warps, stages, swap = moe_grp.GROUPED_CONFIG[which]
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PRECISION": "tf32", "EVEN_K": True, "SWAP_AB": swap,
            "WORDS": OPTIONS.moe.grouped_words, "H_SORTED": OPTIONS.moe.grouped_h_sorted,
            "COLUMNS_FIRST": OPTIONS.moe.grouped_columns_first, "num_warps": warps, "num_stages": stages}


DENSE = {"p_x": "*bf16", "p_w": "*bf16", "p_y": "*bf16", **ints("M", "N", "K", "stride_xm", "stride_wn", "stride_ym")}


HC_WRITE = {"p_x": "*bf16", "p_y": "*bf16", "p_a": "*bf16", "p_wn": "*bf16", "p_out": "*bf16", "p_nn": "*bf16",
            "eps": "fp32", **ints("stride_xt", "stride_yt", "stride_at", "stride_ot", "stride_nnt")}


def dense_cfg(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    cfg = dense.default_config(m, n, k, dtype)
    return {**cfg, **dense.k_tiling(k, cfg["BLOCK_K"])}


CASES = [  # (name, kernel, signature, constexprs and launch options); flagship shapes
    ("gemv M=1 whole K (2048)", nv._nvfp4_gemv_kernel, GEMV, gemv_cfg(1, 12288, 2048)),
    ("gemv M=1 whole K (8192)", nv._nvfp4_gemv_kernel, GEMV, gemv_cfg(1, 32768, 8192)),
    ("gemv M=1 K loop (16384)", nv._nvfp4_gemv_kernel, GEMV, gemv_cfg(1, 4096, 16384)),
    ("gemv M=1 two whole-K tiles (2560)", nv._nvfp4_gemv_kernel, GEMV, gemv_cfg(1, 16384, 2560)),
    ("gemv M=1 two whole-K tiles (6144)", nv._nvfp4_gemv_kernel, GEMV, gemv_cfg(1, 2560, 6144)),
    ("gemv M=2 K loop", nv._nvfp4_gemv_kernel, GEMV, gemv_cfg(2, 2048, 4096)),
    ("gemv M=8 whole K", nv._nvfp4_gemv_kernel, GEMV, gemv_cfg(8, 1024, 2048)),
    ("dot M=8", nv._nvfp4_dot_kernel, DOT, dot_cfg(8, 8192, 2048)),
    ("dot M=64", nv._nvfp4_dot_kernel, DOT, dot_cfg(64, 8192, 2048)),
    ("dot prefill (swapped operands)", nv._nvfp4_dot_kernel, DOT, dot_cfg(4096, 8192, 2048)),
    ("dot M=8, 2 warps (a grid past one wave: Flash-Next's in_proj_qkvz)", nv._nvfp4_dot_kernel, DOT,
     {**dot_cfg(8, 16384, 2560), "num_warps": OPTIONS.nvfp4.dot_small_m_past_wave_warps}),
    ("dot M=8, fp16 x rows (Nvfp4Options.dot_f16_x_max_m)", nv._nvfp4_dot_kernel, {**DOT, "p_x": "*fp16"},
     {**dot_cfg(8, 8192, 2048), "F16X": True}),
    ("dot M=8, fp16 x rows, 2 warps (Flash-Next's in_proj_qkvz)", nv._nvfp4_dot_kernel, {**DOT, "p_x": "*fp16"},
     {**dot_cfg(8, 16384, 2560), "num_warps": OPTIONS.nvfp4.dot_small_m_past_wave_warps, "F16X": True}),
    ("dot M=8, split K 4, fp16 x rows", nv._nvfp4_dot_kernel, {**DOT, "p_x": "*fp16"},
     {**dot_cfg(8, 8192, 2048), "SPLIT_K": 4, "F16X": True}),
    ("nvfp4 fp16 rows (the fp16 tile's x)", nv_rows._f16_rows_kernel,
     {"p_x": "*bf16", "p_y": "*fp16", "p_s": "*fp32", **ints("K", "stride_xm", "stride_ym")},
     {"TOP": 14, "MAX_SHIFT": 126, "BLOCK_K": 4096}),
    ("dot M=8, whole tiles (no halves)", nv._nvfp4_dot_kernel, DOT,
     {**dot_cfg(8, 8192, 2048), "HALVES": False, "ASM": False}),
    ("dot M=32, split K 4 (a ticket)", nv._nvfp4_dot_kernel, DOT, {**dot_cfg(32, 12288, 2048), "SPLIT_K": 4}),
    ("dot M=8, split K 4 (a ticket; the 16-row tile on a thin grid)", nv._nvfp4_dot_kernel, DOT,
     {**dot_cfg(8, 2560, 6144), "SPLIT_K": 4}),
    ("moe gate_up, 1 token", moe._moe_gate_up_kernel, GATE_UP, moe_cfg(moe.GATE_UP_CONFIG[1], 256, "BLOCK_I")),
    ("moe gate_up, more tokens", moe._moe_gate_up_kernel, GATE_UP, moe_cfg(moe.GATE_UP_CONFIG[2], 256, "BLOCK_I")),
    ("moe gate_up, K loop", moe._moe_gate_up_kernel, GATE_UP, moe_cfg((8, 64, 4), 256, "BLOCK_I")),
    ("moe down per pair, 1 token", moe._moe_down_pairs_kernel, DOWN_PAIRS, moe_cfg(moe.DOWN_CONFIG[1], 64, "BLOCK_H")),
    ("moe down per pair, more", moe._moe_down_pairs_kernel, DOWN_PAIRS, moe_cfg(moe.DOWN_CONFIG[2], 64, "BLOCK_H")),
    ("moe sum over k", moe.moe_sum_pairs_kernel, SUM, {"BLOCK": 1024}),
    ("moe grouped gate_up", moe_grp._grouped_gate_up_kernel, G_GATE_UP, grouped_cfg()),
    ("moe grouped down", moe_grp._grouped_down_kernel, G_DOWN, grouped_cfg(1)),
    ("moe grouped gate_up, short passes", moe_grp._grouped_gate_up_kernel, G_GATE_UP, short_grouped_cfg()),
    ("moe grouped down, short passes", moe_grp._grouped_down_kernel, G_DOWN, short_grouped_cfg()),
    ("moe grouped gate_up, word decode", moe_grp._grouped_gate_up_kernel, G_GATE_UP, {**grouped_cfg(), "WORDS": True}),
    ("moe grouped down, word decode", moe_grp._grouped_down_kernel, G_DOWN, {**grouped_cfg(1), "WORDS": True}),
    ("moe grouped gate_up, short passes, word decode", moe_grp._grouped_gate_up_kernel, G_GATE_UP,
     {**short_grouped_cfg(), "WORDS": True}),
    ("moe grouped down, h rows by pair, tiles first", moe_grp._grouped_down_kernel, G_DOWN,
     {**grouped_cfg(1), "H_SORTED": False, "COLUMNS_FIRST": False}),
    ("moe grouped down, h in sorted rows, columns first", moe_grp._grouped_down_kernel, G_DOWN,
     {**grouped_cfg(1), "H_SORTED": True, "COLUMNS_FIRST": True}),
    ("moe grouped gate_up, unswapped tile", moe_grp._grouped_gate_up_kernel, G_GATE_UP,
     {**grouped_cfg(), "BLOCK_M": 64, "SWAP_AB": False}),
    ("moe grouped pair tiles (one program)", moe_tiles._pair_tiles_kernel,
     {"p_sorted": "*i32", "p_start": "*i32", "p_end": "*i32", **ints("P", "G")},
     {"BLOCK_M": moe_grp.GROUPED_CONFIG[0][0], "BLOCK": moe_tiles.TILES_BLOCK, "num_warps": 8}),
    ("moe grouped sum over live pairs", moe_grp._sum_live_pairs_kernel,
     {"p_yp": "*bf16", "p_slots": "*i32", "p_out": "*bf16", **ints("H", "TOPK", "stride_yp", "stride_ot")},
     {"BLOCK": 1024}),
    ("nvfp4 decode pass (prefill linear)", nv_dq._dequant_kernel,
     {"p_w": "*u8", "p_s": "*u8", "p_y": "*bf16", **ints("N", "K", "stride_wn", "stride_sn", "stride_yn")},
     {"BLOCK_R": nv_dq.DEQUANT_BLOCK[0], "BLOCK_K": nv_dq.DEQUANT_BLOCK[1], "EVEN_K": True, "num_warps": 4}),
    ("moe decode gate_up + shared, 1 token", moe_dec._moe_decode_gate_up_kernel, MOE_DECODE_GATE_UP,
     {"TOPK": 10, "HAS_SHARED": True, "HAS_HOST": False, "HAS_DST": False,
      **moe_cfg(moe_dec.DECODE_GATE_UP_CONFIG[1], 256, "BLOCK_I")}),
    ("moe decode gate_up + shared + host store, more tokens", moe_dec._moe_decode_gate_up_kernel, MOE_DECODE_GATE_UP,
     {"TOPK": 10, "HAS_SHARED": True, "HAS_HOST": True, "HAS_DST": False,
      **moe_cfg(moe_dec.DECODE_GATE_UP_CONFIG[2], 256, "BLOCK_I")}),
    ("moe decode gate_up + shared + host store + landing store, 1 token", moe_dec._moe_decode_gate_up_kernel,
     MOE_DECODE_GATE_UP, {"TOPK": 10, "HAS_SHARED": True, "HAS_HOST": True, "HAS_DST": True,
                          **moe_cfg(moe_dec.DECODE_GATE_UP_CONFIG[1], 256, "BLOCK_I")}),
    ("moe decode gate_up + shared + host store + landing store, more tokens", moe_dec._moe_decode_gate_up_kernel,
     MOE_DECODE_GATE_UP, {"TOPK": 10, "HAS_SHARED": True, "HAS_HOST": True, "HAS_DST": True,
                          **moe_cfg(moe_dec.DECODE_GATE_UP_CONFIG[2], 256, "BLOCK_I")}),
    ("moe decode gate_up + shared + host store + landing store, two tiles (Flash-Next's 2,560: 256 + 64 words)",
     moe_dec._moe_decode_gate_up_kernel, MOE_DECODE_GATE_UP,
     {"TOPK": 10, "HAS_SHARED": True, "HAS_HOST": True, "HAS_DST": True, "HAS_LIVE": True, "WHOLE_K2": 64,
      "HALF": OPTIONS.nvfp4.half_sums, **moe_cfg(OPTIONS.moe.decode_gate_up_two_tiles, 256, "BLOCK_I")}),
    ("moe decode gate_up + shared, padding rows skipped", moe_dec._moe_decode_gate_up_kernel, MOE_DECODE_GATE_UP,
     {"TOPK": 10, "HAS_SHARED": True, "HAS_HOST": False, "HAS_DST": False, "HAS_LIVE": True,
      **moe_cfg(moe_dec.DECODE_GATE_UP_CONFIG[2], 256, "BLOCK_I")}),
    ("moe decode gate_up + host store + landing store, padding rows skipped", moe_dec._moe_decode_gate_up_kernel,
     MOE_DECODE_GATE_UP, {"TOPK": 10, "HAS_SHARED": True, "HAS_HOST": True, "HAS_DST": True, "HAS_LIVE": True,
                          **moe_cfg(moe_dec.DECODE_GATE_UP_CONFIG[2], 256, "BLOCK_I")}),
    ("moe decode gate_up, K loop", moe_dec._moe_decode_gate_up_kernel, MOE_DECODE_GATE_UP,
     {"TOPK": 10, "HAS_SHARED": False, "HAS_HOST": False, "HAS_DST": False, **moe_cfg((8, 64, 4), 256, "BLOCK_I")}),
    ("moe decode down + sum + shared", moe_dec._moe_decode_down_kernel, MOE_DECODE_DOWN,
     {"TOPK": 10, "HAS_SHARED": True, **moe_cfg(moe_dec.DECODE_DOWN_CONFIG[1], 64, "BLOCK_H")}),
    ("moe decode down + sum + shared, more tokens", moe_dec._moe_decode_down_kernel, MOE_DECODE_DOWN,
     {"TOPK": 10, "HAS_SHARED": True, **moe_cfg(moe_dec.DECODE_DOWN_CONFIG[2], 64, "BLOCK_H")}),
    ("moe decode down per pair + shared", moe_dec._moe_decode_down_pairs_kernel, MOE_DECODE_DOWN_PAIRS,
     {"TOPK": 10, "HAS_SHARED": True, "BLOCK_H": moe_dec.down_pairs_config()[0], "WHOLE_K": 64,
      "HAS_HOST": False, "HAS_DST": False, "ASM": OPTIONS.nvfp4.lanes_ptx, "num_warps": OPTIONS.moe.decode_down_warps}),
    ("moe decode down per pair + shared, the pairs summed by the last program (WHOLE_K 64 + 16: Flash-Next's 640)",
     moe_dec._moe_decode_down_pairs_kernel, MOE_DECODE_DOWN_PAIRS,
     {"TOPK": 10, "HAS_SHARED": True, "BLOCK_H": moe_dec.down_pairs_config(640)[0], "WHOLE_K": 64, "WHOLE_K2": 16,
      "HAS_HOST": True, "HAS_DST": True, "HAS_LIVE": True, "SUM": True, "ASM": OPTIONS.nvfp4.lanes_ptx,
      "num_warps": moe_dec.down_pairs_config(640)[2]}),
    ("moe decode down per pair + shared, slotless pairs from the host store", moe_dec._moe_decode_down_pairs_kernel,
     MOE_DECODE_DOWN_PAIRS, {"TOPK": 10, "HAS_SHARED": True, "BLOCK_H": moe_dec.down_pairs_config()[0],
                             "WHOLE_K": 64, "HAS_HOST": True, "HAS_DST": False, "ASM": OPTIONS.nvfp4.lanes_ptx,
                             "num_warps": OPTIONS.moe.decode_down_warps}),
    ("moe decode down per pair + shared, host store + landing store", moe_dec._moe_decode_down_pairs_kernel,
     MOE_DECODE_DOWN_PAIRS, {"TOPK": 10, "HAS_SHARED": True, "BLOCK_H": moe_dec.down_pairs_config()[0],
                             "WHOLE_K": 64, "HAS_HOST": True, "HAS_DST": True, "ASM": OPTIONS.nvfp4.lanes_ptx,
                             "num_warps": OPTIONS.moe.decode_down_warps}),
    ("moe decode down per pair, host store + landing store, padding rows skipped",
     moe_dec._moe_decode_down_pairs_kernel, MOE_DECODE_DOWN_PAIRS,
     {"TOPK": 10, "HAS_SHARED": True, "BLOCK_H": moe_dec.down_pairs_config()[0], "WHOLE_K": 64, "HAS_HOST": True,
      "HAS_DST": True, "HAS_LIVE": True, "ASM": OPTIONS.nvfp4.lanes_ptx, "num_warps": OPTIONS.moe.decode_down_warps}),
    ("moe decode down + sum + shared, padding rows skipped", moe_dec._moe_decode_down_kernel, MOE_DECODE_DOWN,
     {"TOPK": 10, "HAS_SHARED": True, "HAS_LIVE": True, **moe_cfg(moe_dec.DECODE_DOWN_CONFIG[2], 64, "BLOCK_H")}),
    ("moe decode sum + residual + next norm, H 2048", moe_dec._moe_sum_add_norm_kernel, MOE_SUM_NORM,
     {"KS": 11, "BLOCK_D": 2048, "num_warps": 8}),
    ("moe decode down, K loop", moe_dec._moe_decode_down_kernel, MOE_DECODE_DOWN,
     {"TOPK": 10, "HAS_SHARED": False, **moe_cfg((32, 32, 4), 64, "BLOCK_H")}),
    ("router 512 experts top-10", router._router_topk_kernel, ROUTER,
     {"NORMALIZE": True, "BLOCK_E": 512, "BLOCK_K": 16, "SHARED_GATE": False, "HAS_TABLE": False, "FORCED": False,
      "num_warps": 4}),
    ("router top-10 + shared gate + slot table", router._router_topk_kernel, ROUTER,
     {"NORMALIZE": True, "BLOCK_E": 512, "BLOCK_K": 16, "SHARED_GATE": True, "HAS_TABLE": True, "FORCED": False,
      "num_warps": 4}),
    ("router, forced experts (traces) + shared gate", router._router_topk_kernel, ROUTER,
     {"NORMALIZE": True, "BLOCK_E": 512, "BLOCK_K": 16, "SHARED_GATE": True, "HAS_TABLE": False, "FORCED": True,
      "num_warps": 1}),
    ("expert lookup, top-10", lookup._expert_lookup_kernel, LOOKUP, {"BLOCK_K": 16, "num_warps": 1}),
    ("expert lookup with owners, 8 x top-10", lookup._expert_lookup_owned_kernel, LOOKUP_OWNED,
     {"BLOCK_N": 128, "BLOCK_R": 128, "num_warps": 1}),
    ("expert lookup with owners, 256 x top-10", lookup._expert_lookup_owned_kernel, LOOKUP_OWNED,
     {"BLOCK_N": 4096, "BLOCK_R": 1024, "num_warps": 8}),
    ("landed experts committed", lookup._commit_landed_kernel, COMMIT, {"BLOCK_R": 128, "num_warps": 1}),
    ("dense M=1 router 512x2048 (one K tile)", dense._dense_gemv_kernel, DENSE, dense_cfg(1, 512, 2048)),
    ("dense M=8 router 512x2048", dense._dense_gemv_kernel, DENSE, dense_cfg(8, 512, 2048)),
    ("dense M=16 in_proj_ba 64x2048", dense._dense_gemv_kernel, DENSE, dense_cfg(16, 64, 2048)),
    ("dense M=4 K loop, last tile masked (2064)", dense._dense_gemv_kernel, DENSE, dense_cfg(4, 2048, 2064)),
    ("dense M=8 Flash-Next router 513x2560", dense._dense_gemv_kernel, DENSE, dense_cfg(8, 513, 2560)),
    ("dense M=1 Flash-Next router 513x2560", dense._dense_gemv_kernel, DENSE, dense_cfg(1, 513, 2560)),
    ("dense M=8 fp32 K loop", dense._dense_gemv_kernel, {**DENSE, "p_x": "*fp32", "p_w": "*fp32", "p_y": "*fp32"},
     dense_cfg(8, 512, 2048, torch.float32)),
    # the norms' EVEN_D: D == BLOCK_D, as the wrappers set it
    ("rms_norm hidden 2048", norm._rms_norm_kernel, RMS_NORM,
     {"HAS_RESIDUAL": False, "BLOCK_D": 2048, "EVEN_D": True, "num_warps": 8}),
    ("add + rms_norm hidden 2048", norm._rms_norm_kernel, RMS_NORM,
     {"HAS_RESIDUAL": True, "BLOCK_D": 2048, "EVEN_D": True, "num_warps": 8}),
    ("add + rms_norm 8192 (largest tile)", norm._rms_norm_kernel, RMS_NORM,
     {"HAS_RESIDUAL": True, "BLOCK_D": 8192, "EVEN_D": True, "num_warps": 8}),
    ("add + rms_norm hidden 2000 (masked along D)", norm._rms_norm_kernel, RMS_NORM,
     {"HAS_RESIDUAL": True, "BLOCK_D": 2048, "EVEN_D": False, "num_warps": 8}),
    ("gated rms_norm Dv 128", norm._gated_rms_norm_kernel, GATED_NORM,
     {"ROUND_WY": True, "BLOCK_R": 8, "BLOCK_D": 128, "EVEN_D": True, "num_warps": 4}),
    ("gated rms_norm Dv 96 (masked along D)", norm._gated_rms_norm_kernel, GATED_NORM,
     {"ROUND_WY": True, "BLOCK_R": 8, "BLOCK_D": 128, "EVEN_D": False, "num_warps": 4}),
    ("q/k norm + rope 256, rotary 64", norm._qk_norm_rope_kernel, QK_NORM_ROPE,
     {"BLOCK_D": 256, "BLOCK_HALF": 32, "EVEN_D": True, "num_warps": 1}),
    ("q/k norm + rope 200 (masked along D), rotary 64", norm._qk_norm_rope_kernel, QK_NORM_ROPE,
     {"BLOCK_D": 256, "BLOCK_HALF": 32, "EVEN_D": False, "num_warps": 1}),
    ("write kv decode Hkv 2, D 256", attn._write_kv_decode_kernel, WRITE_KV,
     {"BLOCK_H": 2, "BLOCK_D": 256, "KV_FP8": False, "KV_NVFP4": False, "num_warps": 4}),
    ("write kv decode Hkv 2, D 256, fp8 cache", attn._write_kv_decode_kernel, {**WRITE_KV, "p_kc": "*u8", "p_vc": "*u8"},
     {"BLOCK_H": 2, "BLOCK_D": 256, "KV_FP8": True, "KV_NVFP4": False, "num_warps": 4}),
    ("write kv decode Hkv 2, D 256, nvfp4 cache, QSA's indexer keys (128) too", attn._write_kv_decode_kernel,
     {**WRITE_KV, "p_kc": "*u8", "p_vc": "*u8"}, {"BLOCK_H": 2, "BLOCK_D": 256, "KV_FP8": False, "KV_NVFP4": True,
                                                 "EXTRA": True, "BLOCK_X": 128, "num_warps": 4}),
    ("write kv decode Hkv 2, D 256, nvfp4 cache", attn._write_kv_decode_kernel,
     {**WRITE_KV, "p_kc": "*u8", "p_vc": "*u8"}, {"BLOCK_H": 2, "BLOCK_D": 256, "KV_FP8": False, "KV_NVFP4": True,
                                                 "num_warps": 4}),
    ("decode attention G 8, D 256", attn._decode_kernel, DECODE, {**decode_cfg(256, 8), "HAS_GATE": False}),
    ("decode attention G 8, D 256, output gate", attn._decode_kernel, DECODE, {**decode_cfg(256, 8), "HAS_GATE": True}),
    ("decode attention G 1, D 128", attn._decode_kernel, DECODE, {**decode_cfg(128, 1), "HAS_GATE": False}),
    ("decode attention split-K G 8, D 256", attn._decode_split_kernel, DECODE_SPLIT, decode_cfg(256, 8)),
    ("decode attention G 8, D 256, fp8 cache, output gate", attn._decode_kernel,
     {**DECODE, "p_kc": "*u8", "p_vc": "*u8"}, {**decode_cfg(256, 8, fp8=True), "HAS_GATE": True}),
    ("decode attention split-K G 8, D 256, fp8 cache", attn._decode_split_kernel,
     {**DECODE_SPLIT, "p_kc": "*u8", "p_vc": "*u8"}, decode_cfg(256, 8, fp8=True)),
    ("decode attention G 8, D 256, nvfp4 cache (even/odd halves), output gate", attn._decode_kernel,
     {**DECODE, "p_kc": "*u8", "p_vc": "*u8"}, {**decode_cfg(256, 8, nvfp4=True), "HAS_GATE": True}),
    ("decode attention split-K G 8, D 256, nvfp4 cache (even/odd halves)", attn._decode_split_kernel,
     {**DECODE_SPLIT, "p_kc": "*u8", "p_vc": "*u8"}, decode_cfg(256, 8, nvfp4=True)),
    ("decode attention split-K G 8, D 256, nvfp4 cache, fp16 dots over byte-decoded tiles", attn._decode_split_kernel,
     {**DECODE_SPLIT, "p_kc": "*u8", "p_vc": "*u8"},
     {**decode_cfg(256, 8, nvfp4=True), "NVFP4_F16": True, "EVEN_D": True}),
    ("decode attention split-K G 8, D 256, nvfp4 cache, halves decoded by E4M3 conversions (PTX), 168 registers",
     attn._decode_split_kernel, {**DECODE_SPLIT, "p_kc": "*u8", "p_vc": "*u8", "p_q": "*fp16"},
     {**decode_cfg(256, 8, nvfp4=True), "NVFP4_PRMT": True, "NVFP4_ASM": True, "BLOCK_N": 64,
      "num_stages": OPTIONS.decode_attention.prmt_stages,
      "maxnreg": OPTIONS.decode_attention.prmt_maxnreg}),
    ("decode attention split-K G 8, D 256, nvfp4 cache, whole tiles", attn._decode_split_kernel,
     {**DECODE_SPLIT, "p_kc": "*u8", "p_vc": "*u8"}, {**decode_cfg(256, 8, nvfp4=True), "NVFP4_HALVES": False}),
    ("prefill attention G 8, D 256", attn_pf._prefill_kernel, PREFILL,
     {**prefill_cfg(256, 8), "KV_FP8": False, "KV_NVFP4": False, "CAUSAL_SPLIT": False}),
    ("prefill attention G 8, D 256, fp8 cache", attn_pf._prefill_kernel, {**PREFILL, "p_kc": "*u8", "p_vc": "*u8"},
     {**prefill_cfg(256, 8), "KV_FP8": True, "KV_NVFP4": False, "CAUSAL_SPLIT": False}),
    ("prefill attention G 8, D 256, nvfp4 cache", attn_pf._prefill_kernel, {**PREFILL, "p_kc": "*u8", "p_vc": "*u8"},
     {**prefill_cfg(256, 8), "KV_FP8": False, "KV_NVFP4": True, "CAUSAL_SPLIT": False}),
    ("prefill attention G 8, D 256, causal split", attn_pf._prefill_kernel, PREFILL,
     {**prefill_cfg(256, 8), "KV_FP8": False, "KV_NVFP4": False, "CAUSAL_SPLIT": True}),
    ("prefill attention G 8, D 256, causal split, lazy rescale", attn_pf._prefill_kernel, PREFILL,
     {**prefill_cfg(256, 8), "KV_FP8": False, "KV_NVFP4": False, "CAUSAL_SPLIT": True, "LAZY_RESCALE": True}),
    ("prefill attention G 8, D 256, causal split, lazy rescale, log-sum-exp out", attn_pf._prefill_kernel, PREFILL,
     {**prefill_cfg(256, 8), "KV_FP8": False, "KV_NVFP4": False, "CAUSAL_SPLIT": True, "LAZY_RESCALE": True,
      "EVEN_D": True, "HAS_LSE": True}),
    ("prefill attention G 8, D 256, nvfp4 cache, causal split, fp16 dots", attn_pf._prefill_kernel,
     {**PREFILL, "p_kc": "*u8", "p_vc": "*u8"},
     {**prefill_cfg(256, 8), "KV_FP8": False, "KV_NVFP4": True, "CAUSAL_SPLIT": True, "NVFP4_F16": True,
      "EVEN_D": True, "NVFP4_WORDS": True}),
    ("prefill attention G 8, D 256, nvfp4 cache, causal split, fp16 dots, byte decode", attn_pf._prefill_kernel,
     {**PREFILL, "p_kc": "*u8", "p_vc": "*u8"},
     {**prefill_cfg(256, 8), "KV_FP8": False, "KV_NVFP4": True, "CAUSAL_SPLIT": True, "NVFP4_F16": True}),
    ("prefill attention G 8, D 256, nvfp4 cache, causal split", attn_pf._prefill_kernel,
     {**PREFILL, "p_kc": "*u8", "p_vc": "*u8"},
     {**prefill_cfg(256, 8), "KV_FP8": False, "KV_NVFP4": True, "CAUSAL_SPLIT": True}),
    # QSA's sparse attention (24 / 2 heads of 256): splits into the combine's layout (decode), and one pass at a
    # prefill's rows (the one-split tile, the output written and gated by the kernel)
    ("QSA sparse attention, splits, G 12, D 256", attn_sparse._sparse_decode_kernel, SPARSE,
     {**SPARSE_CFG, "BLOCK_N": attn_sparse.BLOCK_N, "num_warps": 4, "num_stages": 3}),
    ("QSA sparse attention, one pass, output gate, G 12, D 256", attn_sparse._sparse_decode_kernel, SPARSE,
     {**SPARSE_CFG, "ONE_PASS": True, "HAS_GATE": True, "BLOCK_N": OPTIONS.qsa.one_split_tile[0],
      "num_warps": OPTIONS.qsa.one_split_tile[1], "num_stages": OPTIONS.qsa.one_split_tile[2]}),
    ("QSA sparse attention, one pass, nvfp4 cache", attn_sparse._sparse_decode_kernel,
     {**SPARSE, "p_k": "*u8", "p_v": "*u8"},
     {**SPARSE_CFG, "KV_NVFP4": True, "ONE_PASS": True, "BLOCK_N": OPTIONS.qsa.one_split_tile_quantized[0],
      "num_warps": OPTIONS.qsa.one_split_tile_quantized[1], "num_stages": OPTIONS.qsa.one_split_tile_quantized[2]}),
    # Flash-Next's PLE over a prefill's packed tokens (4 streams of 2,560: blocks of 1,024 columns, 4 taps at 3)
    ("PLE prefill conv, 4 taps, dilation 3", engram._ple_conv_prefill_kernel,
     {"p_x": "*bf16", "p_u": "*bf16", "p_uh": "*bf16", "p_hist": "*bf16", "p_seq": "*i64", "p_local": "*i64",
      "p_w": "*bf16", "p_out": "*bf16", **ints("W", "stride_x", "stride_u", "stride_hb", "stride_hr", "stride_w",
                                                "stride_o")},
     {"K": 4, "DIL": 3, "BLOCK": engram.BLOCK_COLUMNS, "num_warps": 4}),
    ("decode attention combine", attn._decode_combine_kernel, COMBINE,
     {"CHUNK_S": 16, "BLOCK_D": 64, "HAS_GATE": False, "num_warps": 4}),
    ("decode attention combine, output gate", attn._decode_combine_kernel, COMBINE,
     {"CHUNK_S": 16, "BLOCK_D": 64, "HAS_GATE": True, "num_warps": 4}),
    ("silu * up, shared expert 512", act._silu_mul_kernel,
     {"p_g": "*bf16", "p_u": "*bf16", "p_o": "*bf16", **ints("N", "stride_g", "stride_u", "stride_o")},
     {"BLOCK_N": act.BLOCK}),
    ("routed + shared expert combine 2048", act._expert_combine_kernel,
     {"p_r": "*bf16", "p_s": "*bf16", "p_gl": "*bf16", "p_o": "*bf16",
      **ints("N", "stride_r", "stride_s", "stride_gl", "stride_o")}, {"BLOCK_N": act.BLOCK}),
    # (as launched: the conv state [S, C, W - 1] has unit stride along W and W - 1 = 3 along C; C divisible by 16)
    ("gated delta decode conv C 8192, W 4", gd._conv_decode_kernel, GD_CONV,
     {**gd.conv_config(8192, 4), **GD_CONV_LAUNCH}),
    ("gated delta decode conv C 10240, W 4, with in_proj_ba (H 2560)", gd._conv_decode_kernel, GD_CONV,
     {**gd.conv_config(10240, 4), "BA": True, "ROWS_BA": gd.BA_ROWS, "H": 2560, "BLOCK_H": 4096, **GD_CONV_LAUNCH}),
    # (as launched: the state [S, Hv, Dk, Dv] with unit stride along Dv; Dk, Dv 128)
    ("gated delta decode step B 1 (BLOCK_V 16)", gd._delta_decode_kernel, GD_DELTA,
     {**gd.delta_config(1, 32, 128, 128), **GD_DELTA_LAUNCH}),
    ("gated delta decode step B 8 (BLOCK_V 64)", gd._delta_decode_kernel, GD_DELTA,
     {**gd.delta_config(8, 32, 128, 128), **GD_DELTA_LAUNCH}),
    # the configs set EVEN_C, EVEN_K, EVEN_V from the shapes (the masked cases: EVEN_* False)
    ("conv1d varlen prefill C 8192, W 4", conv._conv_varlen_kernel, CONV_VARLEN, conv.conv_varlen_config(8192, 4)),
    ("conv1d varlen prefill C 8200 (masked along C), W 4", conv._conv_varlen_kernel, CONV_VARLEN,
     conv.conv_varlen_config(8200, 4)),
    ("conv1d varlen prefill rows C 8192, W 4", conv._conv_varlen_rows_kernel, CONV_VARLEN, conv.conv_rows_config(8192, 4)),
    ("conv1d varlen prefill rows C 8200 (masked along C), W 3", conv._conv_varlen_rows_kernel, CONV_VARLEN,
     conv.conv_rows_config(8200, 3)),
    ("gated delta chunk prep (UT transform) Dk 128, Dv 128", gd_chunk._chunk_prep_kernel, GD_CHUNK_PREP,
     gd_chunk.prep_config(128, 128, torch.bfloat16)),
    ("gated delta chunk prep Dk 96, Dv 80 (masked)", gd_chunk._chunk_prep_kernel, GD_CHUNK_PREP,
     gd_chunk.prep_config(96, 80, torch.bfloat16)),
    ("gated delta chunk state pass B 1 (BLOCK_V 32)", gd_chunk._chunk_state_kernel, GD_CHUNK_STATE,
     gd_chunk.state_config(1, 32, 128, 128, torch.bfloat16)),
    ("gated delta chunk state pass B 3 (BLOCK_V 64)", gd_chunk._chunk_state_kernel, GD_CHUNK_STATE,
     gd_chunk.state_config(3, 32, 128, 128, torch.bfloat16)),
    ("gated delta chunk state pass B 3, Dk 96, Dv 80 (masked)", gd_chunk._chunk_state_kernel, GD_CHUNK_STATE,
     gd_chunk.state_config(3, 32, 96, 80, torch.bfloat16)),
    ("hyper connection write + next norm (D 2560)", hc._write_kernel, HC_WRITE,
     {"D": 2560, "BLOCK_D": 4096, "NEXT_NORM": True, "num_warps": 8, "enable_fp_fusion": False}),
    # (as launched: the streams' width, 10,240, divisible by 16)
    ("hyper connection read, down (4 rows x 2048)", hc._read_down_kernel,
     {"p_n": "*bf16", "p_w": "*bf16", "p_zp": "*fp32", **ints("T", "R", "W", "stride_nt", "stride_wr", "stride_zp")},
     {"ROWS": 4, "CHUNK": 2048, "num_warps": 8, "_divisible": ("W",)}),
    ("hyper connection read (dot), down (16 tokens x 16 rows x 1024)", hc._read_down_dot_kernel,
     {"p_n": "*bf16", "p_w": "*bf16", "p_zp": "*fp32", **ints("T", "R", "W", "stride_nt", "stride_wr")},
     {"BLOCK_T": 16, "ROWS": 16, "CHUNK": 1024, "BLOCK_K": 256, "PRECISION": "tf32", "num_warps": 4,
      "num_stages": 3, "_divisible": ("W",)}),
    ("hyper connection read (dot), reduce + SiLU", hc._read_reduce_kernel,
     {"p_zp": "*fp32", "p_a": "*bf16", "p_gl": "*bf16", **ints("T", "S", "R", "RANK"), "inv_c": "fp32",
      **ints("stride_at", "stride_glt")}, {"BLOCK_R": 512, "GATES": True, "num_warps": 4}),
    ("hyper connection write folded into the next read's down, norm deferred (4 rows x 1280 of a stream)",
     hc._write_down_deferred_kernel,
     {"p_x": "*bf16", "p_y": "*bf16", "p_a": "*bf16", "p_wn": "*bf16", "p_w": "*bf16", "p_out": "*bf16",
      "p_zp": "*fp32", "p_ss": "*fp32", **ints("T", "R"),
      **ints("stride_xt", "stride_yt", "stride_at", "stride_ot", "stride_wr", "stride_zp")},
     {"C": 4, "D": 2560, "SK": 2, "SPAN": 1280, "ROWS": 4, "BLOCK": 2048, "num_warps": 8, "enable_fp_fusion": False}),
    ("hyper connection read, up + mix, all streams' tile (4 columns, rank 320 = 256 + 64; as launched)",
     hc._read_up_mix_streams_kernel,
     {**HC_UP_MIX, "p_wn": "*fp32"},
     {"RANK": 320, "C": 4, "BLOCK_D": 4, "BLOCK_R": 256, "BLOCK_S": 8, "BLOCK_C": 4, "GATES": True, "R2": 64,
      "num_warps": 4}),
    ("hyper connection read, up + mix after the deferred norm (4 columns, rank 256 + 64, 2 chunks a stream; "
     "as launched)",
     hc._read_up_mix_streams_kernel,
     HC_UP_MIX,
     {"RANK": 320, "C": 4, "BLOCK_D": 4, "BLOCK_R": 256, "BLOCK_S": 8, "BLOCK_C": 4, "GATES": True, "SK": 2, "R2": 64,
      "num_warps": 4, "maxnreg": 128}),
    ("hyper connection read (dot), up + mix, all streams' tile (16 tokens x 8 columns, rank steps of 64)",
     hc._read_up_mix_dot_streams_kernel,
     {"p_a": "*bf16", "p_up": "*bf16", "p_n": "*bf16", "p_u": "*bf16", **ints("T", "D", "stride_at", "stride_upr",
                                                                             "stride_nt", "stride_ut")},
     {"RANK": 320, "C": 4, "BLOCK_T": 16, "BLOCK_D": 8, "BLOCK_RK": 64, "PRECISION": "tf32", "num_warps": 4,
      "num_stages": 6}),
]



def _pdl_cases() -> list:
    """Cases again with PDL on (the constexpr and the launch option, `ft.kernels.pdl`): every NVFP4
    GEMV case (its paths place the wait differently: after the whole-K weights, or first), the
    dense GEMV (after its first weight tile), and one of each kernel whose wait comes first (the
    same two lines in every such kernel; the HyperConnection's fma form after the folded write, both
    up cases). Each must compile with the wait in its PTX."""
    picked = {nv._nvfp4_gemv_kernel: 99, dense._dense_gemv_kernel: 1, nv._nvfp4_dot_kernel: 1, norm._rms_norm_kernel: 1,
              moe_dec._moe_decode_gate_up_kernel: 1, attn._decode_split_kernel: 1,
              hc._write_down_deferred_kernel: 1, hc._read_up_mix_streams_kernel: 2}
    out = []
    for name, kernel, signature, params in CASES:
        if picked.get(kernel, 0) > 0:
            picked[kernel] -= 1
            out.append((f"{name} [PDL]", kernel, signature, {**params, "PDL": True, "launch_pdl": True}))
    return out


CASES += _pdl_cases()


def _half_sum_cases() -> list:
    """Cases again with the fp16 block sums (`Nvfp4Options.half_sums`, on by default): the decode
    MoE's gate/up with the landing store and its per-pair down pass, their one user (the other whole-K callers
    take the same helper, `rows.dot_whole_k`, with the fp32 sums)."""
    names = ("moe decode gate_up + shared + host store + landing store, more tokens",
             "moe decode down per pair + shared")
    return [(f"{name} [half sums]", kernel, signature, {**params, "HALF": True})
            for name, kernel, signature, params in CASES if name in names]


CASES += _half_sum_cases()


def compile_case(kernel, signature: dict, params: dict):
    """A case compiled as a launch at its shapes would be: pointers and `stride*` integers divisible by 16,
    plus the integers a case names in "_divisible" (a launch specializes every integer argument divisible
    by 16: widths such as 10,240), less those in "_plain" (strides that are not, such as 3); an integer
    argument a case gives a value (1 for a unit stride, which a launch also specializes) is a constexpr."""
    divisible, plain = set(params.pop("_divisible", ())), set(params.pop("_plain", ()))
    options = {k: params.pop(k) for k in ("num_warps", "num_stages", "maxnreg", "launch_pdl", "enable_fp_fusion") if k in params}
    for p in kernel.params:  # constexprs a case leaves out take their defaults (else triton fails obscurely)
        default = getattr(p, "default", inspect.Parameter.empty)
        if p.is_constexpr and p.name not in params and p.name not in signature and default is not inspect.Parameter.empty:
            params[p.name] = default
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if (n.startswith(("p_", "stride")) or n in divisible) and n not in plain and n not in params}
    sig = {**signature, **{k: "constexpr" for k in params}}
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=params, attrs=attrs), target=TARGET,
                          options=options)


def load_counts(compiled) -> str:
    """The global-memory load instructions of a compiled kernel's PTX, by kind ("b16 x 384" is one
    2-byte load per element: a tile mask against a runtime bound keeps the compiler from
    vectorizing; "v4.b32" and "cp.async" are 16-byte loads, the latter software-pipelined)."""
    kinds = Counter(re.findall(r"(ld\.global[\w.]*|cp\.async\.c[ag]\.shared\.global)", compiled.asm["ptx"]))
    return ", ".join(f"{k.replace('ld.global.', '').replace('.shared.global', '')} x {n}" for k, n in sorted(kinds.items()))


def resource_usage(compiled) -> str:
    """Registers per thread, stack bytes (spills show here) and shared memory of the cubin, from the
    cuobjdump that the triton wheel carries (`cuobjdump -res-usage`)."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([_bin_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    return f"REG {m[1]} STACK {m[2]} SHARED {m[3]} (+{compiled.metadata.shared} dynamic)" if m else out.strip()[-200:]


def _bin_tool(name: str) -> str:
    from pathlib import Path

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _sass(compiled) -> str:
    """The kernel's SASS, from the nvdisasm that the triton wheel carries."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([_bin_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout


def opcode_mix(compiled) -> str:
    """The kernel's SASS instructions, all of them (every branch, taken or not): their count and the
    opcodes that fill it (a static view: e.g. the decode MoE's lone-pair kernel against the one that
    shares experts)."""
    ops = Counter(m[1].split(".")[0] for line in _sass(compiled).splitlines()
                  if (m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)[^;]*;", line)))
    return f"{sum(ops.values())} instructions: " + ", ".join(f"{o} {n}" for o, n in ops.most_common(8))


def loop_bodies(compiled) -> list[str]:
    """Each loop of the kernel's SASS (a backward branch to a label): its instruction count and the
    opcodes that fill it. A static view of the hot loop without a GPU (what the device runs is
    triton 3.6's code: the counts here are this wheel's compiler's); a body holds the branches that
    are skipped at run time too."""
    out = _sass(compiled)
    ins, labels, pending = [], {}, []
    for line in out.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            pending.append(m[1])
        elif m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line):
            labels.update((p, len(ins)) for p in pending)
            pending = []
            ins.append((m[1].split(".")[0], m[2]))
    loops = []
    for i, (op, rest) in enumerate(ins):
        target = re.search(r"(\.L_x_\d+)", rest) if op == "BRA" else None
        if target and labels.get(target[1], i + 1) < i:
            body = Counter(o for o, _ in ins[labels[target[1]] : i + 1])
            top = ", ".join(f"{o} {n}" for o, n in body.most_common(10))
            loops.append(f"loop of {sum(body.values())} instructions: {top}")
    return loops


def main() -> int:
    """Compile every case; with --loads, also print each kernel's load instructions (`load_counts`);
    with --regs, its registers, stack (spills) and shared memory (`resource_usage`); with --loops,
    its loops' instruction mix (`loop_bodies`); with --ops, its whole SASS's (`opcode_mix`); --only SUBSTRING
    picks cases by name; --shard I/N
    compiles every N-th case from the I-th (the test runs the shards in parallel processes)."""
    args = sys.argv[1:]
    loads, regs, loops, ops = "--loads" in args, "--regs" in args, "--loops" in args, "--ops" in args
    only = args[args.index("--only") + 1] if "--only" in args else ""
    shard, shards = map(int, args[args.index("--shard") + 1].split("/")) if "--shard" in args else (0, 1)
    failed = 0
    for i, (name, kernel, signature, params) in enumerate(CASES):
        if only not in name or i % shards != shard:
            continue
        try:
            compiled = compile_case(kernel, signature, dict(params))
            if params.get("PDL") and "griddepcontrol.wait" not in compiled.asm["ptx"]:
                raise AssertionError("launched with PDL but its PTX has no griddepcontrol.wait")
            print(f"ok      {name}" + (f"  [{load_counts(compiled)}]" if loads else "")
                  + (f"  [{resource_usage(compiled)}]" if regs else ""), flush=True)
            for line in loop_bodies(compiled) if loops else []:
                print(f"          {line}")
            if ops:
                print(f"          {opcode_mix(compiled)}")
        except Exception as exc:  # noqa: BLE001 (report every kernel)
            failed += 1
            print(f"FAILED  {name}: {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
