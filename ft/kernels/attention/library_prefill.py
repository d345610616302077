"""Long-prefix prefill attention through a library kernel (cuDNN's fused attention), merged by
log-sum-exp. Same contract as `paged_attention_ref` for an unquantized (bf16 / fp16) cache.

Why: a chunk of T queries after a long cached prefix spends nearly all its FLOPs on the prefix,
where no mask applies; cuDNN's attention runs that part at 669-755 TFLOP/s on the H200 against
505 for ft's Triton kernel (bench/attention_backends.py, 2026-12-01). The library kernels take
contiguous K/V, so the prefix is gathered out of the pages segment by segment (bounded memory:
`segment_keys`), and each part's output is merged with the others through its log-sum-exp:

* prefix segments: keys [a, b) of positions < start, no mask. GQA runs as multi-head attention
  with Hkv heads: kv head j's query rows are its group's G query heads, all T tokens, one after
  the other (G*T rows), which is exact without a mask and needs no copy of K/V per query head.
* the diagonal: the chunk's own keys start .. start+T-1, causal with Lq == Lk (the library's
  top-left mask is then the right one), K/V repeated to Hq heads (T keys only).

`attend(q, k, v, causal) -> (o, lse)` is the library call: q [1, H, M, D], k, v [1, H, N, D]
(last dim contiguous) -> o [1, H, M, D] in q's dtype and the natural-log log-sum-exp of the scaled
scores, float32 [1, H, M] (any trailing unit dims). `attend_ref` is its torch reference (fp32);
`cudnn_attend` the CUDA one. No triton here.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["Attend", "attend_ref", "cudnn_attend", "library_prefill_attention", "segment_bounds"]

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], "tuple[torch.Tensor, torch.Tensor]"]


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The `attend` contract in fp32 torch (top-left causal mask when `causal`: query i sees keys <= i)."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        m, n = s.shape[-2:]
        s = s.masked_fill(torch.ones(m, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.exp(s - lse[..., None]) @ v.float()
    return o.to(q.dtype), lse


def cudnn_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The `attend` contract on cuDNN's fused attention (torch's SDPA cuDNN backend, the op that also
    returns the log-sum-exp). Raises whatever torch raises where cuDNN refuses the inputs."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def segment_bounds(n: int, max_keys: int) -> list[tuple[int, int]]:
    """[0, n) cut into the fewest segments of at most max_keys keys, of near-equal length
    (a 258,048-key prefix in 32K segments: 8 of 32,256, not 7 full and a short one)."""
    if n <= 0:
        return []
    parts = -(-n // max(1, max_keys))
    step = -(-n // parts)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def _gather(cache: torch.Tensor, page_table: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Positions a .. b-1 of one sequence out of cache [P, page_size, Hkv, D] -> [1, Hkv, b-a, D],
    contiguous (one gather kernel: indexing the head-major view puts the heads outermost)."""
    page = cache.shape[1]
    pos = torch.arange(a, b, device=cache.device)
    return cache.permute(2, 0, 1, 3)[:, page_table[pos // page], pos % page].unsqueeze(0)


def _merge(o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: o_acc [H, T, D] fp32 and lse_acc [H, T] fp32 (the parts so far) take in part (o, lse)
    of the same shapes (o in any float dtype): softmax weights exp(lse_i - lse_new)."""
    m = torch.maximum(lse_acc, lse)
    w_acc = torch.exp(lse_acc - m)
    w = torch.exp(lse - m)
    total = w_acc + w
    o_acc.mul_((w_acc / total).unsqueeze(-1)).addcmul_(o, (w / total).unsqueeze(-1))
    torch.log(total, out=total)
    lse_acc.copy_(m + total)


def library_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, start: int,
    scale: float, *, segment_keys: int, attend: Attend = cudnn_attend,
) -> torch.Tensor:
    """Causal prefill attention (`paged_attention_ref`'s contract, unquantized cache): q [T, Hq, D]
    at positions start .. start+T-1 over k_cache, v_cache [P, page_size, Hkv, D] (q's dtype) through
    page_table [n] int64 -> [T, Hq, D] in q's dtype. The prefix goes to `attend` in segments of at
    most `segment_keys` keys (their gathered K and V are the path's largest transient besides
    the fp32 accumulator [Hq, T, D]); the parts are merged in fp32.

    Raises: ValueError for a quantized cache or a head count that is no multiple of the cache's."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype or hq % hkv or k_cache.shape[-1] != d:
        raise ValueError(f"library prefill attention takes an unquantized cache of q's dtype and shape: q {tuple(q.shape)} "
                         f"{q.dtype}, cache {tuple(k_cache.shape)} {k_cache.dtype}")
    g = hq // hkv
    if t == 0:
        return torch.empty_like(q)
    # the diagonal first: it initializes the accumulator (every query sees itself, so its lse is finite)
    q_heads = q.permute(1, 0, 2).contiguous().unsqueeze(0)  # [1, Hq, T, D], a copy
    k = _gather(k_cache, page_table, start, start + t).repeat_interleave(g, dim=1)
    v = _gather(v_cache, page_table, start, start + t).repeat_interleave(g, dim=1)
    o, lse = attend(q_heads, k, v, True, scale)
    k = v = None
    o_acc = o.reshape(hq, t, d).float()
    lse_acc = lse.reshape(hq, t).float()
    if start > 0:
        q_groups = q_heads.view(1, hkv, g * t, d)  # kv head j: its G heads' rows, one after the other
        for a, b in segment_bounds(start, segment_keys):
            o, lse = attend(q_groups, _gather(k_cache, page_table, a, b), _gather(v_cache, page_table, a, b), False,
                            scale)
            _merge(o_acc, lse_acc, o.reshape(hq, t, d), lse.reshape(hq, t).float())
    out = torch.empty_like(q)
    out.copy_(o_acc.permute(1, 0, 2))
    return out
