"""Mixture-of-experts over expert *slots*: router top-k and the expert computation.

The engine keeps routed experts in a pool of slots (dense or NVFP4) and maps (layer, expert)
to a slot; these functions only see slot indices. Torch references beside dispatchers that run
the Triton kernels on CUDA (`ft.kernels.router_triton`, `ft.kernels.moe_triton`).

Debug mode (``FT_DEBUG=1`` in the environment): `moe_over_slots` checks that every slot is -1
or a slot of the pool and raises otherwise (a device sync per call; off by default).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ft.kernels.nvfp4 import _use_triton, dequantize_nvfp4_rows


class SlotWeights(NamedTuple):
    """The slot pool of one expert cache.

    Dense: w13 [S, 2I, H] (gate rows then up rows), w2 [S, H, I], scales None.
    NVFP4: w13 uint8 [S, 2I, H/2], w13_scale e4m3 [S, 2I, H/16], w2 uint8 [S, H, I/2],
    w2_scale e4m3 [S, H, I/16], scale_2 float32 [S, 3] (gate, up, down global scales).
    """

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    scale_2: torch.Tensor | None = None

    @property
    def is_nvfp4(self) -> bool:
        return self.w13_scale is not None


GROUPED_MAX_TOKENS = 1024
"""The Triton MoE's grouped path takes at most this many tokens per pass (longer chunks are cut),
which bounds its fp32 workspace (`moe_workspace_bytes`)."""


def moe_workspace_bytes(tokens: int, top_k: int, hidden: int, intermediate: int) -> int:
    """Bytes the Triton MoE allocates for a forward of `tokens` tokens at most (its per-pair
    intermediate h and per-pair outputs, fp32): the engine adds it to its activation reserve."""
    return min(tokens, GROUPED_MAX_TOKENS) * top_k * (intermediate + hidden) * 4


def debug_checks() -> bool:
    """Whether ``FT_DEBUG=1``: the kernels' callers then check what the kernels assume."""
    return os.environ.get("FT_DEBUG") == "1"


def check_slots(topk_slots: torch.Tensor, num_slots: int) -> None:
    """Raise ValueError unless every entry is -1 (skip) or a slot in [0, num_slots) (syncs the device)."""
    bad = (topk_slots < -1) | (topk_slots >= num_slots)
    if bool(bad.any()):
        raise ValueError(f"slot {int(topk_slots[bad][0])} is not -1 or a slot of a pool of {num_slots}")


def router_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: `ft.kernels.router_triton` on CUDA (or in interpreter tests), else `router_topk_ref`."""
    if _use_triton(logits) and logits.shape[-1] <= 8192:
        # NOTE: imports triton only when used
        from ft.kernels.router_triton import router_topk_triton

        return router_topk_triton(logits, top_k, normalize)
    return router_topk_ref(logits, top_k, normalize)


def router_topk_ref(
    logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router: logits [T, E] -> (weights [T, k] in logits' dtype, ids [T, k] int64)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def dense_slots(w: SlotWeights, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense (w13 [U, 2I, H], w2 [U, H, I]) of the given slots (NVFP4 dequantized in one pass)."""
    if not w.is_nvfp4:
        return w.w13[slots].to(dtype), w.w2[slots].to(dtype)
    i = w.w13.shape[1] // 2
    s2 = w.scale_2[slots].float()  # [U, 3]: gate, up, down
    rows13 = torch.cat([s2[:, :1].expand(-1, i), s2[:, 1:2].expand(-1, i)], dim=1)  # [U, 2I]
    rows2 = s2[:, 2:3].expand(-1, w.w2.shape[1])  # [U, H]
    w13 = dequantize_nvfp4_rows(w.w13[slots], w.w13_scale[slots], rows13, dtype)
    w2 = dequantize_nvfp4_rows(w.w2[slots], w.w2_scale[slots], rows2, dtype)
    return w13, w2


def moe_over_slots_ref(
    x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor, w: SlotWeights
) -> torch.Tensor:
    """sum_k weight_k * down(silu(gate(x)) * up(x)) with the experts read from slots.

    Args:
        x: [T, H]; topk_slots: [T, k] int64 slot of each selected expert, or -1 for a pair to
        skip (its expert is computed in another call); topk_weights: [T, k] routing weights.
    Returns: [T, H] in x's dtype.
    """
    out = torch.zeros_like(x)
    flat = topk_slots.reshape(-1)
    order = torch.argsort(flat, stable=True)
    slots, counts = torch.unique_consecutive(flat[order], return_counts=True)
    pairs = order.split(counts.tolist())
    k = topk_slots.shape[1]
    if slots.numel() and slots[0] < 0:  # skipped pairs sort first
        slots, pairs = slots[1:], pairs[1:]
    if not slots.numel():
        return out
    w13s, w2s = dense_slots(w, slots, x.dtype)
    for j, idx in enumerate(pairs):
        tok = idx // k
        gate, up = F.linear(x[tok], w13s[j]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2s[j])
        out.index_add_(0, tok, y * topk_weights.reshape(-1)[idx, None])
    return out


def moe_over_slots(
    x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor, w: SlotWeights
) -> torch.Tensor:
    """Dispatcher: the Triton kernels (`ft.kernels.moe_triton`) for NVFP4 slot pools on CUDA (or
    on CPU in interpreter tests: ``FT_TRITON_INTERPRET_TEST=1`` with ``TRITON_INTERPRET=1``);
    the reference for dense pools and otherwise. Same contract as `moe_over_slots_ref`; in debug
    mode (`debug_checks`) the slots are checked first (`check_slots`)."""
    if debug_checks():
        check_slots(topk_slots, w.w13.shape[0])
    if w.is_nvfp4 and w.w13_scale.dtype == torch.float8_e4m3fn and _use_triton(x):
        # NOTE: imports triton only when used
        from ft.kernels.moe_triton import moe_over_slots_triton

        return moe_over_slots_triton(x, topk_slots, topk_weights, w)
    return moe_over_slots_ref(x, topk_slots, topk_weights, w)
