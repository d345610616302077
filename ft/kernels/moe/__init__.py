"""Mixture-of-experts over expert *slots*: the expert computation of the routed experts.

The engine keeps routed experts in a pool of slots (dense or NVFP4) and maps (layer, expert)
to a slot; these functions only see slot indices. `slots.py` holds the pool's type,
`reference.py` the torch reference, `kernel.py` the Triton kernels (per pair for decode, grouped
by slot into ``tl.dot`` tiles for long prefill chunks), and this module the dispatcher.

Debug mode (``FT_DEBUG=1`` in the environment): `moe_over_slots` checks that every slot is -1
or a slot of the pool and raises otherwise (a device sync per call; off by default).
"""

from __future__ import annotations

import torch

from ft.kernels.backend import debug_checks, uses_triton
from ft.kernels.moe.decode_tiles import DECODE_DOWN_MIN_BLOCK_H, sum_counters_needed
from ft.kernels.moe.reference import dense_slots, moe_decode_ref, moe_over_pools_ref, moe_over_slots_ref
from ft.kernels.moe.slots import GROUPED_SHORT_TOKENS, PER_PAIR_MAX_TOKENS, SlotWeights, check_slots, moe_pools_workspace_bytes, moe_workspace_bytes

__all__ = [
    "DECODE_DOWN_MIN_BLOCK_H", "DECODE_MAX_TOKENS", "GROUPED_SHORT_TOKENS", "PER_PAIR_MAX_TOKENS", "SlotWeights", "check_slots", "dense_slots", "moe_decode",
    "moe_decode_ref", "moe_over_pools", "moe_over_pools_ref", "moe_over_slots", "moe_over_slots_ref", "moe_pools_workspace_bytes",
    "moe_workspace_bytes", "runs_triton", "sum_counters_needed",
]


def runs_triton(w: SlotWeights, device: torch.device) -> bool:
    """Whether `moe_over_slots` runs the Triton kernels for this pool on `device` (NVFP4 slots with
    e4m3 block scales where Triton runs). Only that path is free of host syncs, so only it can be
    captured in a CUDA graph (the reference groups pairs with a host-side unique)."""
    return w.is_nvfp4 and w.w13_scale.dtype == torch.float8_e4m3fn and uses_triton(device)


def moe_over_slots(
    x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor, w: SlotWeights,
    *, experts: int | None = None,
) -> torch.Tensor:
    """Dispatcher: the Triton kernels (`kernel.py`) for NVFP4 slot pools on CUDA (or
    on CPU in interpreter tests: ``FT_TRITON_INTERPRET_TEST=1`` with ``TRITON_INTERPRET=1``);
    the reference for dense pools and otherwise. Same contract as `moe_over_slots_ref`; in debug
    mode (`debug_checks`) the slots are checked first (`check_slots`), and so is `experts`.

    experts: when topk_slots are one layer's expert -> slot lookups (or -1), the layer's expert
    count: at most experts + 1 distinct values, so the grouped path sizes its grid by the layer,
    not by the pool (a pool of 48 layers' slots made ~12x more empty tiles than live ones).
    """
    if debug_checks():
        check_slots(topk_slots, w.w13.shape[0])
        if experts is not None and (n := int(torch.unique(topk_slots).numel())) > experts + 1:
            raise ValueError(f"topk_slots hold {n} distinct values, more than experts + 1 = {experts + 1}")
    if runs_triton(w, x.device):
        # NOTE: imports triton only when used
        from ft.kernels.moe.kernel import moe_over_slots_triton

        return moe_over_slots_triton(x, topk_slots, topk_weights, w,
                                     distinct_slots=None if experts is None else experts + 1)
    return moe_over_slots_ref(x, topk_slots, topk_weights, w)


def moe_over_pools(x: torch.Tensor, topk_weights: torch.Tensor, passes, *, experts: int | None = None) -> torch.Tensor:
    """`moe_over_slots` with the pairs' experts spread over several slot pools (a prefill chunk's
    resident experts in the cache, the others streamed into staging pools, `ft.memory.prefill_stream`).

    passes: an iterable of (topk_slots [T, k], pool); a pair has a slot (>= 0) in at most one pass
    (-1 elsewhere; a pair with none is skipped). The passes are drawn in order and each is computed
    (its kernels enqueued on the current stream) before the next is drawn, so a generator may load
    the next pool in between. x [T, H], topk_weights [T, k]; experts: as `moe_over_slots`'s (each
    pass's slots hold at most experts + 1 distinct values). Returns [T, H] in x's dtype: every pair's
    weighted output kept apart and a token's summed in routing order, so the bits equal one pool
    holding every expert (the reference's, or the Triton grouped path's, whatever T).

    Dispatcher: the Triton grouped kernels where `runs_triton` says so for the first pass's pool
    (every pool of a call must agree), else the reference. In debug mode each pass's slots are checked.
    """
    triton_path = None

    def checked():
        nonlocal triton_path
        for topk_slots, w in passes:
            here = runs_triton(w, x.device)
            if triton_path is None:
                triton_path = here
            elif here != triton_path:
                raise ValueError("moe_over_pools: every pool of a call must run on the same path (Triton or reference)")
            if debug_checks():
                check_slots(topk_slots, w.w13.shape[0])
            yield topk_slots, w

    it = checked()
    first = next(it, None)
    if first is None:
        return torch.zeros_like(x)

    def again():
        yield first
        yield from it

    if triton_path:
        from ft.kernels.moe.kernel import moe_over_pools_triton  # NOTE: imports triton only when used

        return moe_over_pools_triton(x, topk_weights, again(), distinct_slots=None if experts is None else experts + 1)
    return moe_over_pools_ref(x, topk_weights, again())


DECODE_MAX_TOKENS = 128
"""`moe_decode` takes at most this many tokens (the per-pair kernels' range: longer chunks read
each expert once per tile of its tokens in `moe_over_slots`'s grouped path)."""


def moe_decode(
    x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor, w: SlotWeights,
    shared: SlotWeights | None = None, *, residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, host: SlotWeights | None = None,
    topk_ids: torch.Tensor | None = None, layer: int = 0, topk_dst: torch.Tensor | None = None,
    live: torch.Tensor | None = None, sum_counters: torch.Tensor | None = None,
):
    """The decode MoE block, routed pairs and the shared expert in one sum (`moe_decode_ref`'s contract);
    with `residual` and `norm_weight`, followed by the next layer's input norm: returns
    `add_rms_norm(y, residual, norm_weight, eps)` = (normed, residual + y) instead of y.
    With `host`, `topk_ids` and `layer`, a pair without a slot reads its expert from the host store
    ([L, E, ...]); with `topk_dst` too, such a pair also lands the expert in pool slot topk_dst[t, j]
    (`moe_decode_triton`'s read-through landing store and its contract). `live` [T] (a decode step's
    KV slot mapping): tokens with a negative entry are padding, their rows zeros and their pairs not
    computed (measured: +5-10% decode at batches 10 / 20 / 36 on the 80B, RESULTS.md session 29).
    `sum_counters` (int32 [>= `sum_counters_needed(T, H)`], zero, kept zero; the caller's, one set per
    call site): the Triton path's down pass then sums the pairs itself where no norm follows (one
    launch fewer, the same bits).

    Dispatcher: three Triton launches (`decode_kernel.moe_decode_triton`; the norm rides on the sum)
    where `runs_triton` says so for the pool and the shared expert, else the references. In debug
    mode the slots are checked first.
    Raises: ValueError for more than DECODE_MAX_TOKENS tokens, or topk_dst without `host`.
    """
    if x.shape[0] > DECODE_MAX_TOKENS:
        raise ValueError(f"moe_decode takes at most {DECODE_MAX_TOKENS} tokens, got {x.shape[0]}")
    if debug_checks():
        check_slots(topk_slots, w.w13.shape[0])
    if runs_triton(w, x.device) and (shared is None or runs_triton(shared, x.device)):
        from ft.kernels.moe.decode_kernel import moe_decode_triton  # NOTE: imports triton only when used

        return moe_decode_triton(x, topk_slots, topk_weights, w, shared, residual=residual, norm_weight=norm_weight,
                                 eps=eps, host=host, topk_ids=topk_ids, layer=layer, topk_dst=topk_dst, live=live,
                                 sum_counters=sum_counters)
    y = moe_decode_ref(x, topk_slots, topk_weights, w, shared, host=host, topk_ids=topk_ids, layer=layer,
                       topk_dst=topk_dst, live=live)
    if residual is not None and norm_weight is not None:
        from ft.kernels.norm import add_rms_norm

        return add_rms_norm(y, residual, norm_weight, eps)
    return y
