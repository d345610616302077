"""The decode attention kernels' launch choices (details module of `ft.kernels.attention.kernel`,
whose launcher reads them at every call): block sizes and launch options (`decode_config`) and the
split count (`decode_split_count`), from `ft.kernels.options.DecodeAttentionOptions` (which NVFP4
inner loop, the split targets, the combine's columns; each field's note says what
was measured).
"""

from __future__ import annotations

import torch
import triton

from ft.kernels.attention.split import decode_attention_splits
from ft.kernels.backend import sm_count
from ft.kernels.options import kernel_options

__all__ = ["decode_config", "decode_split_count"]


# what each choice is and what it measured: `ft.kernels.options.DecodeAttentionOptions`


def decode_split_count(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device, prmt: bool) -> int:
    """The split count the launcher takes when none is given: `decode_attention_splits`, aimed at
    `prmt_programs_per_sm` programs an SM for the NVFP4_PRMT kernel (`prmt`) where that is set,
    rounded down so that the grid is one wave (every program does the same work: a few programs
    over the SMs' room would double the time)."""
    opts = kernel_options().decode_attention
    target = opts.prmt_programs_per_sm * sm_count(device) if prmt else 0
    if not target:
        return decode_attention_splits(batch, num_kv_heads, max_seq_len)
    rows = max(batch * num_kv_heads, 1)
    return decode_attention_splits(batch, num_kv_heads, max_seq_len, target_programs=max(1, target // rows) * rows,
                                   max_splits=opts.prmt_max_splits)


def decode_config(head_dim: int, group: int, dtype: torch.dtype) -> dict:
    """Block sizes and launch options of the decode kernels (untuned: K and V tiles of 16 KiB in bf16)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    opts = kernel_options().decode_attention
    return {"BLOCK_G": max(16, triton.next_power_of_2(group)), "BLOCK_N": 32 if block_d > 128 else 64,
            "BLOCK_D": block_d, "PRECISION": "ieee" if dtype == torch.float32 else "tf32", "num_warps": 4,
            "num_stages": 2, "NVFP4_HALVES": True, "NVFP4_F16": opts.nvfp4_f16, "NVFP4_PRMT": opts.nvfp4_prmt}
