"""Attention over a paged KV cache: `reference.py` (KV write and causal attention per sequence for
prefill; the batched decode step), `kernel.py` (Triton kernels of the decode step: KV write by
slot, single-pass and split-K paged attention), `prefill_kernel.py` (Triton prefill),
`library_prefill.py` (long-prefix prefill chunks on cuDNN, merged by log-sum-exp), `split.py`
(split count and workspace, no triton) and the dispatchers the model calls.

The decode dispatchers take only device tensors for what changes per step (slot mapping, page
table, sequence lengths), so a decode step on CUDA is capturable in a CUDA graph; pass the
split-K workspace (`decode_attention_workspace`) and `max_seq_len` when capturing.
"""

from __future__ import annotations

import logging

import torch

from ft.kernels.nvfp4.reference import E2M1_MAX, E4M3_MAX
from ft.kernels.attention.reference import (
    FP8_MAX,
    paged_attention_ref,
    paged_decode_attention_ref,
    sparse_decode_attention_ref,
    write_kv_decode_ref,
    write_kv_ref,
)
from ft.kernels.attention.split import (
    DecodeWorkspace,
    decode_attention_splits,
    decode_attention_workspace,
)
from ft.kernels.attention.library_prefill import library_prefill_attention
from ft.kernels.backend import TRITON_DTYPES, debug_checks, uses_triton
from ft.kernels.options import kernel_options
from ft.kernels.slot_write import write_slots

log = logging.getLogger(__name__)

__all__ = [
    "KV_SCALE_HEADROOM", "calibrate_kv_scale", "library_prefill_reserve", "use_library_prefill", "DecodeWorkspace", "decode_attention_splits", "decode_attention_workspace", "paged_attention",
    "paged_attention_ref", "paged_decode_attention", "paged_decode_attention_ref", "write_kv", "write_kv_decode",
    "write_kv_decode_ref", "write_kv_ref", "sparse_decode_attention", "sparse_decode_attention_ref",
]


# which path a CUDA prefill chunk takes: `ft.kernels.options.PrefillAttentionOptions`

LIBRARY_GRANULE_KEYS = 16384
"""The library path's granule: it takes the prefix's first floor(start / granule) * granule keys,
in segments of granule * 2**k keys; 16K keys: where cuDNN begins to win (H200, 2026-12-01)."""

LIBRARY_SEGMENT_BYTES = 128 << 20
"""Bytes of one prefix segment's gathered K and V in the library path at most (its transient):
65,536 keys of the flagship (2 kv heads, D 256, bf16); 64K-key segments measured 1.02x 32K ones."""

_library_refused: list[str] = []  # why cuDNN refused once (then every chunk stays on Triton)

KV_SCALE_HEADROOM = 2.0
"""Calibrated layer scales put the calibrating batch's largest |K| (|V|) at 1/KV_SCALE_HEADROOM of the
format's largest value: later tokens up to twice as large are still represented, not clamped."""


def calibrate_kv_scale(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, kv_scale: torch.Tensor) -> None:
    """Set a quantized layer's (K, V) scales (`kv_scale`, float32 [2], in place, on the device: no host
    sync) from the largest |K| and |V| of k, v [T, Hkv, D]: scale = amax * KV_SCALE_HEADROOM / qmax,
    qmax the largest value the cache holds (fp8 e4m3: 448; NVFP4: 6 x 448, an E2M1 value under its
    largest block scale). A zero amax keeps a tiny positive scale (the cache then holds zeros)."""
    qmax = FP8_MAX if k_cache.dtype == torch.float8_e4m3fn else E2M1_MAX * E4M3_MAX
    amax = torch.stack([k.detach().abs().amax(), v.detach().abs().amax()]).float()
    kv_scale.copy_(amax.clamp(min=1e-30) * (KV_SCALE_HEADROOM / qmax))


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
    start: int, kv_scale: torch.Tensor | None = None,
) -> None:
    """Dispatcher of `write_kv_ref` (same contract): the reference on every device today."""
    write_kv_ref(k_cache, v_cache, k, v, page_table, start, kv_scale)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, start: int, scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal prefill attention (`paged_attention_ref`'s contract). Dispatcher: the Triton kernel
    (`prefill_kernel.py`) in interpreter tests, and on CUDA unless `PrefillAttentionOptions.triton_on_cuda`
    is off; the reference otherwise."""
    if use_library_prefill(q, k_cache, start, kv_scale):
        try:
            return library_prefill_attention(q, k_cache, v_cache, page_table, start, scale,
                                             granule=LIBRARY_GRANULE_KEYS, segment_keys=library_segment_keys(k_cache))
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:  # cuDNN refused (a torch or cuDNN version without the op): Triton from now on
            _library_refused.append(f"{type(exc).__name__}: {exc}")
            log.warning("cuDNN attention refused a long-prefix prefill chunk, the Triton kernel runs instead: %s",
                        str(exc).splitlines()[0][:200])
    if uses_triton(q.device) and q.dtype in TRITON_DTYPES and (q.device.type != "cuda" or kernel_options().prefill_attention.triton_on_cuda):
        from ft.kernels.attention.prefill_kernel import paged_prefill_attention_triton  # NOTE: imports triton when used

        return paged_prefill_attention_triton(q, k_cache, v_cache, page_table, start, scale, kv_scale)
    return paged_attention_ref(q, k_cache, v_cache, page_table, start, scale, kv_scale)


def use_library_prefill(q: torch.Tensor, k_cache: torch.Tensor, start: int, kv_scale: torch.Tensor | None) -> bool:
    """Whether `paged_attention` sends this chunk to the library path (`PrefillAttentionOptions.library_on_cuda`; never
    inside `backend.reference_kernels()`)."""
    return (kernel_options().prefill_attention.library_on_cuda and not _library_refused and q.device.type == "cuda" and uses_triton(q.device)
            and start >= LIBRARY_GRANULE_KEYS and kv_scale is None and q.dtype in (torch.bfloat16, torch.float16)
            and k_cache.dtype == q.dtype and LIBRARY_GRANULE_KEYS % k_cache.shape[1] == 0)


def library_segment_keys(k_cache: torch.Tensor) -> int:
    """Keys per prefix segment of the library path at most: LIBRARY_SEGMENT_BYTES of gathered K and V."""
    per_key = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    return max(LIBRARY_GRANULE_KEYS, LIBRARY_SEGMENT_BYTES // per_key)


def library_prefill_reserve(tokens: int, hq: int, hkv: int, head_dim: int, elem: int) -> int:
    """Bytes the library path holds beside its output for a chunk of `tokens` queries (elem: bytes
    per value), an upper bound: the padded head-major queries and one segment's output (up to 2T
    rows each), the rest's output and the fp32 accumulator, a segment's gathered K and V, and
    [Hq, T] float32 log-sum-exps and merge weights."""
    per_head_row = tokens * hq * head_dim
    per_key = 2 * hkv * head_dim * elem
    segment = max(LIBRARY_GRANULE_KEYS, LIBRARY_SEGMENT_BYTES // per_key) * per_key
    return per_head_row * (5 * elem + 4) + segment + 8 * tokens * hq * 4


def write_kv_decode(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None, extra: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store one new token per sequence: k, v [B, Hkv, D] into k_cache, v_cache [P, page_size, Hkv, R]
    (views of the pool, any strides but the last; R = D, or D/2 + D/16 uint8 for NVFP4) at
    slot_mapping [B] int64 = page * page_size + offset; a negative slot (padding row) writes
    nothing; a quantized cache (`kv_scale`, float32 [2]: the layer's K and V scales; fp8 e4m3 or
    NVFP4) stores x / scale (see `reference.py`). extra: (a paged cache [P, page_size, X] of the
    same page size, rows [B, X]): the rows written at the same slots too (`write_slots`' contract).

    Dispatcher: the Triton kernel where `uses_triton` says so (the extra rows in its launch where
    their cache has the same page size and both unit stride along X), `write_kv_decode_ref` and
    `write_slots` otherwise.
    """
    fused_extra = extra is None or (extra[0].dim() == 3 and extra[0].shape[1] == k_cache.shape[1]
                                    and extra[0].stride(-1) == 1 and extra[1].stride(-1) == 1)
    if uses_triton(k.device) and k.dtype in TRITON_DTYPES:
        # NOTE: imports triton only when used
        from ft.kernels.attention.kernel import write_kv_decode_triton

        write_kv_decode_triton(k_cache, v_cache, k, v, slot_mapping, kv_scale, extra if fused_extra else None)
        if fused_extra:
            return
    else:
        write_kv_decode_ref(k_cache, v_cache, k, v, slot_mapping, kv_scale)
    if extra is not None:
        write_slots(extra[0], slot_mapping, extra[1], page_size=extra[0].shape[1])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    out: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: q [B, Hq, D], one query per sequence at position seq_lens[b] - 1, over keys
    0 .. seq_lens[b] - 1 (write the new K/V first) -> [B, Hq, D] in q's dtype, softmax in fp32;
    with `gate`, o * sigmoid(gate) instead.

    Args:
        k_cache, v_cache: [P, page_size, Hkv, R] (R = D, or D/2 + D/16 uint8 for NVFP4); query head h
            reads kv head h // (Hq // Hkv); D <= 256.
        page_table: [B, max_pages] int64; entries past a sequence's length are never read.
        seq_lens: [B] int32/int64 device tensor, at most max_pages * page_size; 0 gives zeros (padding).
        max_seq_len: the longest context the caller declares (default: the page table's capacity);
            it sets the split count (`decode_attention_splits`), a speed choice only.
        splits: force a split count (1: single pass); workspace: the split-K workspace, at least
            B * splits rows (`decode_attention_workspace`); out: optional output. Ignored by the
            reference except `out`.
        gate: optional output gate [B, Hq, D] in q's dtype, any strides (D's 1, else the kernels take a
            copy): Qwen3-Next's gated attention passes its view of the q projection. The output is
            then o * sigmoid(gate), in fp32 rounded to q's dtype once, written by the kernel that
            writes the output (no elementwise launches in the model).
        kv_scale: float32 [2], the layer's K and V scales of a quantized (fp8 or NVFP4) cache.

    Dispatcher: the Triton kernels (single pass, or split-K when the split count is above 1) where
    `uses_triton` says so; `paged_decode_attention_ref` otherwise. Nothing here syncs with the
    host unless ``FT_DEBUG=1`` (then the page ids and lengths are checked).
    """
    if debug_checks():
        _check_decode_inputs(k_cache, page_table, seq_lens)
    if uses_triton(q.device) and q.dtype in TRITON_DTYPES:
        # NOTE: imports triton only when used
        from ft.kernels.attention.kernel import paged_decode_attention_triton

        return paged_decode_attention_triton(q, k_cache, v_cache, page_table, seq_lens, scale,
                                             max_seq_len=max_seq_len, splits=splits, workspace=workspace, out=out,
                                             gate=gate, kv_scale=kv_scale)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, page_table, seq_lens, scale, gate=gate, kv_scale=kv_scale)
    return ref if out is None else out.copy_(ref)


def _check_decode_inputs(k_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Debug mode (syncs): lengths within the page table, the pages they use within the pool."""
    page = k_cache.shape[1]
    if seq_lens.numel() and not (0 <= int(seq_lens.min()) and int(seq_lens.max()) <= page_table.shape[1] * page):
        raise ValueError(f"seq_lens {seq_lens.tolist()} outside 0 .. {page_table.shape[1] * page} (page table width)")
    used = torch.arange(page_table.shape[1], device=page_table.device)[None, :] * page < seq_lens[:, None]
    ids = page_table[used]
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < k_cache.shape[0]):
        raise ValueError(f"page ids outside 0 .. {k_cache.shape[0] - 1}: {sorted(set(ids.tolist()))[:8]} ...")


def sparse_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                            tokens: torch.Tensor, scale: float, kv_scale: torch.Tensor | None = None, *,
                            gate: torch.Tensor | None = None) -> torch.Tensor:
    """QSA's decode attention: one query per sequence over its selected positions (`tokens` [B, W], -1
    unused) -> [B, Hq, D], with `gate` o * sigmoid(gate) (`sparse_decode_attention_ref`'s contract). The
    Triton kernels where Triton runs (`sparse_decode.py`: split-K over the list, fixed shapes, the splits
    combined and gated in one launch), else the reference."""
    if uses_triton(q.device) and q.dtype in TRITON_DTYPES:
        from ft.kernels.attention.sparse_decode import sparse_decode_attention_triton  # NOTE: imports triton when used

        return sparse_decode_attention_triton(q, k_cache, v_cache, page_table, tokens, scale, kv_scale, gate=gate)
    return sparse_decode_attention_ref(q, k_cache, v_cache, page_table, tokens, scale, kv_scale, gate=gate)
