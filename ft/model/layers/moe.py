"""Qwen3-Next's sparse MoE block (routed experts from the expert cache + gated shared expert),
and the dense MLP used by shared experts and `mlp_only_layers`."""

from __future__ import annotations

import torch

from ft.model.layers.linear import Linear, NVFP4Weight
from ft.memory.expert_cache import ExpertCache
from ft.kernels.activation import expert_combine, silu_mul
from ft.kernels.backend import debug_checks
from ft.kernels.expert_lookup import route_and_lookup
from ft.kernels.moe import (DECODE_MAX_TOKENS, SlotWeights, moe_decode, moe_over_pools, moe_over_slots, runs_triton,
                            sum_counters_needed)
from ft.kernels.router import route, route_forced_ref, router_topk


class MLP:
    def __init__(self, gate_proj: Linear, up_proj: Linear, down_proj: Linear) -> None:
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class SparseMoE:
    """Router top-k over `num_experts`; expert weights come from `cache` at MoE layer `moe_index`."""

    def __init__(
        self,
        router: Linear,
        shared_expert: MLP,
        shared_expert_gate: Linear,
        top_k: int,
        norm_topk_prob: bool,
        moe_index: int,
    ) -> None:
        self.router, self.shared_expert, self.shared_expert_gate = router, shared_expert, shared_expert_gate
        self.top_k, self.norm_topk_prob, self.moe_index = top_k, norm_topk_prob, moe_index
        self.num_experts = router.weight.shape[0]
        # NOTE: the decode path's fused forms, built once, sharing storage with the unfused ones
        # (no weight is held twice): the router's rows and the shared gate's row as one matrix,
        # so that one GEMV gives every logit; the shared expert as a one-slot pool, so that the
        # MoE kernels run it as one more pair of each token and sum everything in one pass.
        self.gate_logits = _stack_rows(router, shared_expert_gate)
        if self.gate_logits is not None:
            e = self.num_experts
            self.router = Linear(self.gate_logits.weight[:e])
            self.shared_expert_gate = Linear(self.gate_logits.weight[e:])
        # and its down pass counts each token's pairs here where it sums them itself (`moe_decode`'s
        # sum_counters: no norm follows, one launch fewer)
        w = router.weight
        self.sum_counters = torch.zeros(sum_counters_needed(DECODE_MAX_TOKENS, w.shape[1]), dtype=torch.int32,
                                        device=w.packed.device if isinstance(w, NVFP4Weight) else w.device)
        self.shared_slot = _as_slot(shared_expert)

    def __call__(self, x: torch.Tensor, cache: ExpertCache, residual: torch.Tensor | None = None,
                 next_norm: torch.Tensor | None = None, eps: float = 1e-6, forced: torch.Tensor | None = None,
                 live: torch.Tensor | None = None):
        """x [T, H] -> y [T, H]. With `residual` and `next_norm` (the next layer's input norm
        weight) the decode path may also apply that norm (one launch less): it then returns
        (rms_norm(residual + y), residual + y) instead of y; callers check for a tuple.
        `forced` [T, k]: the experts to use instead of the router's top-k (synthetic traces).
        While the cache's read-through step is active (an offloaded decode step), misses are read
        from the host store inside the step (`_read_through`). `live` [T]: a decode step's KV slot
        mapping; the decode path skips the rows with a negative entry (padding: `moe_decode`)."""
        rt = cache.read_through
        if rt is not None and rt.active:
            return self._read_through(x, cache, residual, next_norm, eps, forced, live)
        if self._fused(x, cache):
            return self._decode(x, cache, residual, next_norm, eps, forced, live)
        if forced is not None:
            weights, ids, _ = route_forced_ref(self.router(x), forced, self.norm_topk_prob)
        else:
            weights, ids = router_topk(self.router(x), self.top_k, self.norm_topk_prob)
        routed = self._routed(x, weights, ids, cache)
        return expert_combine(routed, self.shared_expert(x), self.shared_expert_gate(x))

    def _fused(self, x: torch.Tensor, cache: ExpertCache) -> bool:
        """Whether this call takes the decode path: few tokens, the Triton MoE on this pool, the
        shared expert in the pool's shapes."""
        sh = self.shared_slot
        return (sh is not None and x.shape[0] <= DECODE_MAX_TOKENS and runs_triton(cache.slots, x.device)
                and runs_triton(sh, x.device) and sh.w13.shape[1:] == cache.slots.w13.shape[1:]
                and sh.w2.shape[1:] == cache.slots.w2.shape[1:])

    def _decode(self, x: torch.Tensor, cache: ExpertCache, residual: torch.Tensor | None = None,
                next_norm: torch.Tensor | None = None, eps: float = 1e-6, forced: torch.Tensor | None = None,
                live: torch.Tensor | None = None):
        """Four launches: the logits (router and shared gate), the routing (top-k, the shared gate's
        sigmoid, the slots), gate/up of every pair with the shared expert, down
        with the sum."""
        layer = self.moe_index
        table = cache.slot_table[layer]
        resident = cache.all_resident
        weights, ids, slots = self._route(x, table if resident else None, forced)
        if resident:
            if debug_checks():
                self._slots(table, ids)
        else:
            experts = torch.unique(ids).tolist()
            if len(experts) > cache.num_slots:  # more experts than slots: the grouped unfused path
                routed = self._routed(x, weights[:, : self.top_k], ids, cache)
                return expert_combine(routed, self.shared_expert(x), self.shared_expert_gate(x))
            cache.ensure(layer, experts)
            slots = self._slots(table, ids)
        return moe_decode(x, slots, weights, cache.slots, self.shared_slot, residual=residual, norm_weight=next_norm,
                          eps=eps, live=live, sum_counters=self.sum_counters)

    def _read_through(self, x: torch.Tensor, cache: ExpertCache, residual: torch.Tensor | None,
                      next_norm: torch.Tensor | None, eps: float, forced: torch.Tensor | None,
                      live: torch.Tensor | None = None):
        """An offloaded decode step without host syncs: routing, then the lookup kernel (slots, the
        book's bookkeeping, landing slots for first misses), then the MoE reading each miss from
        the host store and landing it (`ft.memory.read_through`). Fused (one sum with the shared
        expert) where the Triton kernels run, else the references and the unfused combine."""
        layer = self.moe_index
        fused = self._fused(x, cache)
        rt = cache.read_through
        logits = self._route_logits(x) if fused else self.router(x)  # (fused: the shared gate's column last)
        weights, ids, slots, dst = route_and_lookup(logits, self.top_k, self.norm_topk_prob, cache.slot_table,
                                                    rt.book, layer, owners=rt.mapped_victims, shared_gate=fused,
                                                    forced=forced)
        if fused:
            return moe_decode(x, slots, weights, cache.slots, self.shared_slot, residual=residual,
                              norm_weight=next_norm, eps=eps, host=cache.host, topk_ids=ids, layer=layer,
                              topk_dst=dst, live=live, sum_counters=self.sum_counters)
        routed = moe_decode(x, slots, weights, cache.slots, host=cache.host, topk_ids=ids, layer=layer, topk_dst=dst,
                            live=live, sum_counters=self.sum_counters)
        return expert_combine(routed, self.shared_expert(x), self.shared_expert_gate(x))

    def _route(self, x: torch.Tensor, table: torch.Tensor | None, forced: torch.Tensor | None):
        """The decode path's routing with the shared gate: (weights [T, k + 1], ids [T, k], slots from
        `table` or None), from `_route_logits`."""
        return route(self._route_logits(x), self.top_k, self.norm_topk_prob, shared_gate=True, slot_table=table,
                     forced=forced)

    def _route_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's logits with the shared gate's as a last column, [T, E + 1]: one GEMV where the two are
        stacked (`gate_logits`), else the two and a concatenation."""
        if self.gate_logits is not None:
            return self.gate_logits(x)
        return torch.cat([self.router(x), self.shared_expert_gate(x)], dim=1)

    def _slots(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each selected expert; in debug mode, an expert without a slot (-1, which the
        kernels would skip) is an error: the caller must have made every selected expert resident."""
        slots = table[ids]
        if debug_checks() and bool((slots < 0).any()):
            missing = sorted(set(ids[slots < 0].tolist()))
            raise RuntimeError(f"MoE layer {self.moe_index}: experts {missing[:8]} have no slot")
        return slots

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, cache: ExpertCache) -> torch.Tensor:
        layer = self.moe_index
        table = cache.slot_table[layer]
        if cache.all_resident:  # every expert has its slot: no bookkeeping, no device sync
            # NOTE: hits are counted by the model runner here ((token, expert) pairs): this code
            # also runs while a CUDA graph is captured, and not at all when it is replayed.
            return moe_over_slots(x, self._slots(table, ids), weights, cache.slots, experts=table.shape[0])
        stream = cache.prefill_stream
        if stream is not None and stream.wants(x.shape[0]):
            # a long chunk: the experts the cache lacks stream through staging pages, nothing is
            # evicted, no host sync (`ft.memory.prefill_stream`)
            return moe_over_pools(x, weights, stream.passes(layer, ids), experts=table.shape[0])
        experts = torch.unique(ids).tolist()
        if len(experts) <= cache.num_slots:
            cache.ensure(layer, experts)
            return moe_over_slots(x, self._slots(table, ids), weights, cache.slots, experts=table.shape[0])
        # More distinct experts than slots (a long prefill chunk on a small cache): run them in
        # groups that fit, each group's pairs with the others masked out (slot -1).
        out = torch.zeros_like(x)
        n = cache.num_slots
        for i in range(0, len(experts), n):
            group = experts[i : i + n]
            cache.ensure(layer, group)
            in_group = torch.isin(ids, torch.tensor(group, device=ids.device))
            slots = torch.where(in_group, table[ids], torch.full_like(ids, -1))
            out += moe_over_slots(x, slots, weights, cache.slots, experts=table.shape[0])
        return out


def _stack_rows(router: Linear, gate: Linear) -> Linear | None:
    """The router's rows and the shared gate's row as one dense matrix [E + 1, H], or None when
    either is not dense or their dtypes differ."""
    r, g = router.weight, gate.weight
    if isinstance(r, NVFP4Weight) or isinstance(g, NVFP4Weight) or r.dtype != g.dtype or r.shape[1] != g.shape[1]:
        return None
    return Linear(torch.cat([r, g.reshape(1, -1)]))


def _as_slot(mlp: MLP) -> SlotWeights | None:
    """The shared expert as a one-slot NVFP4 pool (gate rows then up rows; down), or None when its
    projections are not NVFP4. The MLP's projections become views of the pool's tensors."""
    ws = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    if not all(isinstance(w, NVFP4Weight) for w in ws):
        return None
    gate, up, down = ws
    i = gate.packed.shape[0]
    if up.packed.shape != gate.packed.shape:
        return None
    w13 = torch.cat([gate.packed, up.packed])[None]
    s13 = torch.cat([gate.scale, up.scale])[None]
    s2 = torch.stack([torch.as_tensor(w.scale_2, dtype=torch.float32, device=w13.device).reshape(()) for w in ws])
    slot = SlotWeights(w13, down.packed.contiguous()[None], s13, down.scale.contiguous()[None], s2[None])
    mlp.gate_proj = Linear(NVFP4Weight(w13[0, :i], s13[0, :i], gate.scale_2))
    mlp.up_proj = Linear(NVFP4Weight(w13[0, i:], s13[0, i:], up.scale_2))
    mlp.down_proj = Linear(NVFP4Weight(slot.w2[0], slot.w2_scale[0], down.scale_2))
    return slot
