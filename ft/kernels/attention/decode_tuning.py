"""The decode attention kernels' launch choices (details module of `ft.kernels.attention.kernel`,
whose launcher reads them at every call, so that benchmarks may set them): block sizes and launch
options (`decode_config`), which NVFP4 inner loop and decode form, the split count
(`decode_split_count`) and the combine's columns. Each constant's note says what was measured.
"""

from __future__ import annotations

import torch
import triton

from ft.kernels.attention.split import decode_attention_splits
from ft.kernels.backend import sm_count

__all__ = ["decode_config", "decode_split_count"]


NVFP4_F16_DEFAULT = True
"""`decode_config`'s NVFP4_F16: the NVFP4 decode attention's fp16 dots over word-decoded fp16 tiles
(q rounded to fp16 once; an fp32 q keeps the exact path), 64 keys a step. H200
(bench/decode_attention.py, 16/2 heads, D 256, 2026-12-01): 92.2 us at a 128K context against 120.3
for the halves (1.30x), 19.7 against 24.8 at 4K; rel RMS against the reference 1.7e-3 (halves 2.2e-3)."""


NVFP4_PRMT_DEFAULT = True
"""`decode_config`'s NVFP4_PRMT: the NVFP4 halves decoded straight to fp16 by byte permutes in inline
PTX (`ft.kernels.nvfp4.decode.e2m1_halves_f16`, ~3 instructions an element), fp16 dots,
NVFP4_PRMT_BLOCK_N keys a step, NVFP4_PRMT_STAGES pipeline stages. H200 (bench/decode_attention.py,
16/2 heads, D 256, 2026-12-02, one run): 128K context 87.5 us for NVFP4_F16 (the default before) ->
71.2 us (64 keys, 3 stages; 78.1 with 2 stages, 73.3 at 128 keys, 82.5 at 32, 97.6 in 8 warps),
4K 19.4 -> 17.1 us. Statically (sm_90 SASS per 32 keys, 2 stages) the loop is no shorter than
NVFP4_F16's (1,082 against 1,009 instructions: q's fragments reloaded per tile and the scale
bytes' packing take what the decode saves) but it issues fewer conversions (F2FP 34 against 72)."""
NVFP4_PRMT_BLOCK_N = 64
NVFP4_PRMT_STAGES = 3
NVFP4_PRMT_FORM = 2
"""The NVFP4_PRMT loop's decode form (`ft.kernels.nvfp4.decode.e2m1_halves_f16_scaled`'s FORM:
HALVES_PRMT 0, HALVES_BITS 1, HALVES_CVT 2); every form gives the same output bits (the GPU tests
check it). H200, one layer (bench/decode_attention.py, 16/2 heads, D 256, 2026-12-02, two calls):
128K 70.9 / 71.1 us (byte permutes) -> 68.3 / 68.5 (E4M3 bytes converted two at a time), 72.3
with the bits placed; 4K 17.1 -> 16.6-16.8. With NVFP4_PRMT_MAXNREG and three programs an SM:
65.2 / 65.9 / 65.8 us at 128K (three calls), the bits form 66.3, byte permutes 71.1. Statically
(sm_90, 64 keys, 3 stages) 2,155 -> 1,756 instructions a step (F2FP 68 -> 196), 233 -> 220 registers."""
NVFP4_PRMT_MAXNREG = 168
"""Registers per thread the NVFP4_PRMT split kernel is held to (ptxas `maxnreg`; 0: the compiler's
choice) when its grid holds more than two programs an SM: the loop is latency-bound at two programs
(8 warps) an SM, and 168 registers make room for three, at the cost of some spills (128 bytes of
stack; the loop 1,756 -> 1,816 instructions). Measured slower: 8 warps at 128 registers (two
programs of 8 warps: 72.0 us at 128K), 4 warps at 128 (four programs, 264 splits: 69.2)."""
NVFP4_PRMT_PROGRAMS_PER_SM = 3
"""Programs an SM that the NVFP4_PRMT kernel's split count aims at (`decode_split_count`: this times
the SM count, at most NVFP4_PRMT_MAX_SPLITS splits; 0: `decode_attention_splits`' own rule, two an
SM of an H200); 3 goes with NVFP4_PRMT_MAXNREG 168."""
NVFP4_PRMT_MAX_SPLITS = 256
NVFP4_PRMT_WARPS = 4
"""Warps per program of the NVFP4_PRMT kernels."""


COMBINE_BLOCK_D = 64
"""Columns of the head dim per program of the split-K combine (the whole head when smaller). H200,
flagship heads, batch 1 (bench/decode_attention.py --profile, 2026-12-01): 128 splits (128K) 9.3 ->
4.4 us against one program per head, 16 splits (4K) 2.2 -> 1.8 us."""


def decode_split_count(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device, prmt: bool) -> int:
    """The split count the launcher takes when none is given: `decode_attention_splits`, aimed at
    NVFP4_PRMT_PROGRAMS_PER_SM programs an SM for the NVFP4_PRMT kernel (`prmt`) where that is set,
    rounded down so that the grid is one wave (every program does the same work: a few programs
    over the SMs' room would double the time)."""
    target = NVFP4_PRMT_PROGRAMS_PER_SM * sm_count(device) if prmt else 0
    if not target:
        return decode_attention_splits(batch, num_kv_heads, max_seq_len)
    rows = max(batch * num_kv_heads, 1)
    return decode_attention_splits(batch, num_kv_heads, max_seq_len, target_programs=max(1, target // rows) * rows,
                                   max_splits=NVFP4_PRMT_MAX_SPLITS)


def decode_config(head_dim: int, group: int, dtype: torch.dtype) -> dict:
    """Block sizes and launch options of the decode kernels (untuned: K and V tiles of 16 KiB in bf16)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return {"BLOCK_G": max(16, triton.next_power_of_2(group)), "BLOCK_N": 32 if block_d > 128 else 64,
            "BLOCK_D": block_d, "PRECISION": "ieee" if dtype == torch.float32 else "tf32", "num_warps": 4,
            "num_stages": 2, "NVFP4_HALVES": True, "NVFP4_F16": NVFP4_F16_DEFAULT,
            "NVFP4_WORDS": False, "NVFP4_PRMT": NVFP4_PRMT_DEFAULT}
