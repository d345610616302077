"""Qwen3-Next's sparse MoE block (routed experts from the expert cache + gated shared expert),
and the dense MLP used by shared experts and `mlp_only_layers`."""

from __future__ import annotations

import torch

from ft.model.layers.linear import Linear
from ft.memory.expert_cache import ExpertCache
from ft.kernels.activation import expert_combine, silu_mul
from ft.kernels.backend import debug_checks
from ft.kernels.moe import moe_over_slots
from ft.kernels.router import router_topk


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

    def __call__(self, x: torch.Tensor, cache: ExpertCache) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, ids = router_topk(self.router(x), self.top_k, self.norm_topk_prob)
        routed = self._routed(x, weights, ids, cache)
        return expert_combine(routed, self.shared_expert(x), self.shared_expert_gate(x))

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
            return moe_over_slots(x, self._slots(table, ids), weights, cache.slots)
        experts = torch.unique(ids).tolist()
        if len(experts) <= cache.num_slots:
            cache.ensure(layer, experts)
            return moe_over_slots(x, self._slots(table, ids), weights, cache.slots)
        # More distinct experts than slots (a long prefill chunk on a small cache): run them in
        # groups that fit, each group's pairs with the others masked out (slot -1).
        out = torch.zeros_like(x)
        n = cache.num_slots
        for i in range(0, len(experts), n):
            group = experts[i : i + n]
            cache.ensure(layer, group)
            in_group = torch.isin(ids, torch.tensor(group, device=ids.device))
            slots = torch.where(in_group, table[ids], torch.full_like(ids, -1))
            out += moe_over_slots(x, slots, weights, cache.slots)
        return out
