"""Attention over a paged KV cache: `reference.py` (KV write, causal attention over a page table)
and the dispatchers the model calls. No Triton kernel yet (the decode-graphs issue adds one)."""

from __future__ import annotations

import torch

from ft.kernels.attention.reference import paged_attention_ref, write_kv_ref

__all__ = ["paged_attention", "paged_attention_ref", "write_kv", "write_kv_ref"]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
    start: int,
) -> None:
    """Dispatcher of `write_kv_ref` (same contract): the reference on every device today."""
    write_kv_ref(k_cache, v_cache, k, v, page_table, start)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    """Dispatcher of `paged_attention_ref` (same contract): the reference on every device today."""
    return paged_attention_ref(q, k_cache, v_cache, page_table, start, scale)
