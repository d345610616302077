"""Mixture-of-experts over expert slots: the torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.kernels.moe.slots import SlotWeights
from ft.kernels.nvfp4.reference import dequantize_nvfp4_rows


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
    Returns: [T, H] in x's dtype. Each pair's weighted output is kept apart (fp32) and a token's
    pairs are summed in routing order, so the result does not depend on which slot holds which
    expert (offloaded and resident experts give the same bits).
    """
    return moe_over_pools_ref(x, topk_weights, [(topk_slots, w)])


def moe_over_pools_ref(x: torch.Tensor, topk_weights: torch.Tensor, passes) -> torch.Tensor:
    """`moe_over_slots_ref` with the experts spread over several pools: `passes` yields
    (topk_slots [T, k], pool) pairs, a pair of tokens and experts having a slot (>= 0) in at most
    one of them; each is computed before the next is drawn. Every pair's weighted output is kept
    apart (fp32) and a token's are summed in routing order at the end: the same bits as one pool
    holding every expert."""
    t, k = topk_weights.shape
    parts = torch.zeros((t * k, x.shape[1]), dtype=torch.float32, device=x.device)  # skipped pairs add 0
    wts = topk_weights.reshape(-1).float()
    for topk_slots, w in passes:
        _pairs_into(parts, x, topk_slots.reshape(-1), wts, k, w)
    parts = parts.view(t, k, -1)
    out = parts[:, 0].clone()
    for j in range(1, k):  # in routing order
        out += parts[:, j]
    return out.to(x.dtype)


def _pairs_into(parts: torch.Tensor, x: torch.Tensor, flat: torch.Tensor, wts: torch.Tensor, k: int,
                w: SlotWeights) -> None:
    """parts[p] = wts[p] * expert(x[p // k]) in fp32 for every pair p with flat[p] >= 0 (slots of `w`)."""
    order = torch.argsort(flat, stable=True)
    slots, counts = torch.unique_consecutive(flat[order], return_counts=True)
    pairs = order.split(counts.tolist())
    if slots.numel() and slots[0] < 0:  # skipped pairs sort first
        slots, pairs = slots[1:], pairs[1:]
    if not slots.numel():
        return
    w13s, w2s = dense_slots(w, slots, x.dtype)
    for j, idx in enumerate(pairs):
        tok = idx // k
        gate, up = F.linear(x[tok], w13s[j]).chunk(2, dim=-1)
        parts[idx] = F.linear(F.silu(gate) * up, w2s[j]).float() * wts[idx, None]


def moe_decode_ref(
    x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor, w: SlotWeights,
    shared: SlotWeights | None = None, host: SlotWeights | None = None, topk_ids: torch.Tensor | None = None,
    layer: int = 0, topk_dst: torch.Tensor | None = None, live: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode MoE block: sum_j weight_j * expert_j(x) over the routed pairs in order, then the
    shared expert (one more pair, slot 0 of `shared`) when given; everything in fp32, cast once.

    Args:
        x: [T, H]; topk_slots: [T, k] slots, -1 = skip; topk_weights: [T, k + S], S = 1 with
        `shared` (its weight last: the sigmoid of the shared expert's gate).
        host, topk_ids, layer: with a host store ([L, E, ...]) a pair without a slot reads expert
        topk_ids[t, j] of `layer` from it instead of being skipped (the slot-or-host gather).
        topk_dst: [T, k] slots, -1 = none (with `host` only): after computing, each pair with
        slot -1, an id >= 0 and d = topk_dst[t, j] >= 0 copies host[layer, id] into slot d of `w`
        (all five tensors), as the kernels' landing store does; each d at most once, and no pair
        reads slot d (the caller's contract, as in `moe_decode_triton`).
        live: [T] integers; a token with a negative entry (padding) gets a row of zeros (what
        lands still lands).
    Returns: [T, H] in x's dtype.
    Raises: ValueError for topk_dst without `host`.
    """
    if topk_dst is not None and host is None:
        raise ValueError("topk_dst (the landing store) needs the host store: pass host=, topk_ids= and layer=")
    t, k = topk_slots.shape
    xs = x.float()
    wts = topk_weights.float()
    parts = torch.zeros((t, k + (shared is not None), x.shape[1]), dtype=torch.float32, device=x.device)
    flat = topk_slots.reshape(-1)
    slotted = flat >= 0
    if bool(slotted.any()):
        pair = torch.arange(flat.numel(), device=x.device)[slotted]
        slots, inverse = torch.unique(flat[slotted], return_inverse=True)
        w13s, w2s = dense_slots(w, slots, torch.float32)
        for u in range(slots.numel()):
            p = pair[inverse == u]
            tok, j = p // k, p % k
            gate, up = F.linear(xs[tok], w13s[u]).chunk(2, dim=-1)
            parts[tok, j] = F.linear(F.silu(gate) * up, w2s[u]) * wts[tok, j, None]
    if host is not None:  # the slotless pairs, from the host store
        miss = (flat < 0).nonzero().flatten()
        if miss.numel():
            layer_store = SlotWeights(*(None if t_ is None else t_[layer] for t_ in host))
            ids = topk_ids.reshape(-1)[miss]
            w13s, w2s = dense_slots(layer_store, ids.to(layer_store.w13.device), torch.float32)
            for u, p in enumerate(miss.tolist()):
                tok, j = p // k, p % k
                gate, up = F.linear(xs[tok : tok + 1], w13s[u].to(x.device)).chunk(2, dim=-1)
                parts[tok, j] = (F.linear(F.silu(gate) * up, w2s[u].to(x.device)) * wts[tok, j])[0]
    if shared is not None:
        w13, w2 = dense_slots(shared, torch.zeros(1, dtype=torch.long, device=x.device), torch.float32)
        gate, up = F.linear(xs, w13[0]).chunk(2, dim=-1)
        parts[:, k] = F.linear(F.silu(gate) * up, w2[0]) * wts[:, k, None]
    out = parts[:, 0]
    for j in range(1, parts.shape[1]):  # in pair order, as the kernel sums
        out = out + parts[:, j]
    if live is not None:
        out = out.masked_fill((live < 0)[:, None].to(out.device), 0.0)
    if topk_dst is not None:  # the landing store: after computing, so no pair reads what lands
        ids, dst = topk_ids.reshape(-1).tolist(), topk_dst.reshape(-1).tolist()
        for p in (flat < 0).nonzero().flatten().tolist():
            if ids[p] >= 0 and dst[p] >= 0:
                for pool_t, host_t in zip(w, host):
                    if pool_t is not None:
                        pool_t[dst[p]].copy_(host_t[layer, ids[p]])
    return out.to(x.dtype)
