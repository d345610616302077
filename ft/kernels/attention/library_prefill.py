"""Long-prefix prefill attention through a library kernel (cuDNN's fused attention) for the bulk of
the prefix, ft's kernel for the rest, merged by log-sum-exp. Same contract as
`paged_attention_ref` for an unquantized (bf16 / fp16) cache.

Why: a chunk of T queries after a long cached prefix spends nearly all its FLOPs on the prefix,
where no mask applies; cuDNN's attention runs that part at 600-750 TFLOP/s on the H200 against
~500 for ft's Triton kernel (bench/attention_backends.py, bench/prefill_attention.py, 2026-12-01).

How, and why this shape:

* keys [0, cut), cut = start rounded down to a multiple of `granule`, go to the library in
  segments whose lengths are powers of two times `granule` (at most `segment_keys`), greedily,
  longest first. cuDNN builds an execution plan per new shape (50-75 ms measured on the H200), so
  the shapes must be few: with the queries padded to a power of two (`padded_rows`) a process
  sees at most a handful of shapes, not one per chunk. Each segment's K/V are gathered out of
  the pages into contiguous tensors (the library's layout; the largest transient, bounded by the
  segment). GQA runs as multi-head attention over Hkv heads: kv head j's query rows are its
  group's G heads, all T tokens, one after the other (G*T rows), exact without a mask.
* keys [cut, start+T) (under `granule` of the prefix, and the causal diagonal) go to `rest`:
  `paged_prefill_attention_triton` with its log-sum-exp output, on the page table from cut.

`attend(q, k, v, scale) -> (o, lse)` is the library call (no mask): q [1, H, M, D], k, v [1, H, N, D]
(contiguous) -> o [1, H, M, D] in q's dtype and the natural-log log-sum-exp of the scaled scores,
float32 with M * H elements in (H, M) order. `rest(q, k_cache, v_cache, page_table, start, scale)
-> (o [T, Hq, D], lse float32 [Hq, T])` is causal prefill attention with its log-sum-exp. The
`*_ref` functions are their torch references; no triton is imported here.
"""

from __future__ import annotations

from typing import Callable

import torch

from ft.kernels.attention.reference import paged_attention_lse_ref, paged_attention_ref

__all__ = ["attend_ref", "cudnn_attend", "library_prefill_attention", "padded_rows", "rest_ref", "rest_triton",
           "segment_bounds"]

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], "tuple[torch.Tensor, torch.Tensor]"]
Rest = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float],
                "tuple[torch.Tensor, torch.Tensor]"]


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The `attend` contract in fp32 torch."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse[..., None]) @ v.float()).to(q.dtype), lse


def cudnn_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The `attend` contract on cuDNN's fused attention (torch's SDPA cuDNN backend, the op that also
    returns the log-sum-exp). Raises whatever torch raises where cuDNN refuses the inputs."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)
    return out[0], out[1]


def rest_ref(q, k_cache, v_cache, page_table, start, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """The `rest` contract on the torch references."""
    return (paged_attention_ref(q, k_cache, v_cache, page_table, start, scale),
            paged_attention_lse_ref(q, k_cache, v_cache, page_table, start, scale))


def rest_triton(q, k_cache, v_cache, page_table, start, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """The `rest` contract on the Triton prefill kernel (its log-sum-exp output)."""
    from ft.kernels.attention.prefill_kernel import paged_prefill_attention_triton  # NOTE: imports triton when used

    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    return paged_prefill_attention_triton(q, k_cache, v_cache, page_table, start, scale, lse=lse), lse


def segment_bounds(n: int, granule: int, max_keys: int) -> list[tuple[int, int]]:
    """[0, n) (n a multiple of granule) cut into segments of granule * 2**k keys, at most max_keys
    (rounded down to such a size, at least granule), longest first: few distinct lengths."""
    if n % granule:
        raise ValueError(f"{n} keys are not a multiple of the granule {granule}")
    top = granule
    while top * 2 <= max_keys:
        top *= 2
    bounds, a, size = [], 0, top
    while a < n:
        while a + size > n:
            size //= 2
        bounds.append((a, a + size))
        a += size
    return bounds


def padded_rows(t: int) -> int:
    """Query rows the library sees for a chunk of t queries: the next power of two (at least 16), so
    that a chunk's length (a prompt's last chunk is any length) adds no new plan shape."""
    return max(16, 1 << (t - 1).bit_length())


def _gather(cache: torch.Tensor, page_table: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Positions a .. b-1 of one sequence out of cache [P, page_size, Hkv, D] -> [1, Hkv, b-a, D],
    contiguous (one gather kernel: indexing the head-major view puts the heads outermost)."""
    page = cache.shape[1]
    pos = torch.arange(a, b, device=cache.device)
    return cache.permute(2, 0, 1, 3)[:, page_table[pos // page], pos % page].unsqueeze(0)


def _merge(o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: o_acc [H, T, D] fp32 and lse_acc [H, T] fp32 (the parts so far) take in part (o, lse)
    of the same shapes (o in any float dtype, any strides): weights exp(lse_i - lse_new)."""
    m = torch.maximum(lse_acc, lse)
    w_acc = torch.exp(lse_acc - m)
    w = torch.exp(lse - m)
    total = w_acc + w
    o_acc.mul_((w_acc / total).unsqueeze(-1)).addcmul_(o, (w / total).unsqueeze(-1))
    torch.log(total, out=total)
    lse_acc.copy_(m + total)


def library_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, start: int,
    scale: float, *, granule: int, segment_keys: int, attend: Attend = cudnn_attend, rest: Rest = rest_triton,
) -> torch.Tensor:
    """Causal prefill attention (`paged_attention_ref`'s contract, unquantized cache): q [T, Hq, D]
    at positions start .. start+T-1 over k_cache, v_cache [P, page_size, Hkv, D] (q's dtype) through
    page_table [n] int64 -> [T, Hq, D] in q's dtype (module docstring: the prefix's first
    floor(start / granule) * granule keys on `attend` in segments of at most `segment_keys`, the
    rest on `rest`, merged in fp32). granule: a multiple of the page size.

    Raises: ValueError for a quantized cache, a head count that is no multiple of the cache's, or
    a granule off the page grid."""
    t, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype or hq % hkv or k_cache.shape[-1] != d:
        raise ValueError(f"library prefill attention takes an unquantized cache of q's dtype and shape: q {tuple(q.shape)} "
                         f"{q.dtype}, cache {tuple(k_cache.shape)} {k_cache.dtype}")
    if granule % page:
        raise ValueError(f"granule {granule} is not a multiple of the page size {page}")
    cut = start // granule * granule
    o_rest, lse_rest = rest(q, k_cache, v_cache, page_table[cut // page:], start - cut, scale)
    if cut == 0 or t == 0:
        return o_rest
    g, rows = hq // hkv, padded_rows(t)
    q_heads = torch.zeros((hq, rows, d), dtype=q.dtype, device=q.device)  # padding rows: discarded
    q_heads[:, :t] = q.permute(1, 0, 2)
    q_groups = q_heads.view(1, hkv, g * rows, d)  # kv head j: its G heads' rows, one after the other
    o_acc = o_rest.permute(1, 0, 2).float()  # [Hq, T, D], a copy
    lse_acc = lse_rest
    for a, b in segment_bounds(cut, granule, segment_keys):
        o, lse = attend(q_groups, _gather(k_cache, page_table, a, b), _gather(v_cache, page_table, a, b), scale)
        _merge(o_acc, lse_acc, o.reshape(hq, rows, d)[:, :t], lse.reshape(hq, rows)[:, :t].float())
    out = torch.empty_like(q)
    out.copy_(o_acc.permute(1, 0, 2))
    return out
