"""Expert lookup for an offloaded expert cache, inside the decode step: each routed expert's slot
(-1: read it from the host store), the device-side use bookkeeping the host policy reads between
steps, and read-through landing slots for this step's misses. No host sync: a CUDA graph captures it.
After the step, `commit_landed` maps the experts it landed in the slot table, on the device, so that
the next step hits them before the host has read the step's record.

`reference.py` holds the torch references, `kernel.py` the Triton kernels (the lookup: one launch per
MoE layer; the commit: one per step), this module the type of the bookkeeping tensors and the
dispatchers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ft.kernels.backend import uses_triton
from ft.kernels.expert_lookup.reference import commit_landed_ref, expert_lookup_ref
from ft.kernels.options import kernel_options
from ft.kernels.router import route

__all__ = ["ExpertBook", "commit_landed", "commit_landed_ref", "expert_lookup", "expert_lookup_ref", "new_book",
           "route_and_lookup"]


class ExpertBook(NamedTuple):
    """Device-side bookkeeping of an offloaded expert cache: L MoE layers, E experts each, up to R
    landing slots per layer per step. Persistent tensors (a captured graph bakes their addresses).

    step: int32 [2]: the step number (>= 0, rising) and the batch's real rows (padding rows after
        them are looked up but not counted and claim nothing).
    last_use: int32 [L, E]: the last step each expert was routed to by a real row (-1: never).
    claim: int32 [L, E]: the last step a miss of the expert claimed a landing slot (-1: never).
    landing: int32 [L, R]: slots the host reserved for this step's misses, in order (-1: none).
    owner: int32 [L, R]: the resident expert landing[l, i] still holds, as l' * E + e' (a victim of
        any layer, -1: a free slot). It stays mapped, a hit, until a miss claims its slot: the lookup
        that claims it unmaps it; a victim a real row routed this step in this layer or one before
        is not claimed (all -1: the host unmapped its victims before the step).
    landing_used: int32 [L]: misses that claimed a landing slot this step (may pass the unpinned
        reserve: the extra misses land nowhere); the host zeroes it before each step.
    landed: int32 [L, R]: landed[l, i] = the expert written into landing[l, i] this step, -1 where
        no miss claimed it (the host resets it to -1 before each step).
    counters: int64 [L, 2]: hits and misses of real rows' pairs, cumulative.
    order: int32 [L, R]: scratch of the lookup with owners (the claimable landing slots in order).
    """

    step: torch.Tensor
    last_use: torch.Tensor
    claim: torch.Tensor
    landing: torch.Tensor
    owner: torch.Tensor
    landing_used: torch.Tensor
    landed: torch.Tensor
    counters: torch.Tensor
    order: torch.Tensor

    @property
    def landing_capacity(self) -> int:
        return self.landing.shape[1]


def new_book(num_layers: int, num_experts: int, landing_capacity: int, device: torch.device) -> ExpertBook:
    """A fresh book: nothing used, claimed or reserved, step 0 with no rows."""
    i32 = dict(dtype=torch.int32, device=device)
    r = max(1, landing_capacity)
    return ExpertBook(
        step=torch.zeros(2, **i32),
        last_use=torch.full((num_layers, num_experts), -1, **i32),
        claim=torch.full((num_layers, num_experts), -1, **i32),
        landing=torch.full((num_layers, r), -1, **i32),
        owner=torch.full((num_layers, r), -1, **i32),
        landing_used=torch.zeros(num_layers, **i32),
        landed=torch.full((num_layers, r), -1, **i32),
        counters=torch.zeros((num_layers, 2), dtype=torch.int64, device=device),
        order=torch.zeros((num_layers, r), **i32),
    )


def expert_lookup(ids: torch.Tensor, slot_table: torch.Tensor, book: ExpertBook, layer: int, owners: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher (`expert_lookup_ref`'s contract; `slot_table` [L, E]): the Triton kernel on CUDA (or
    in interpreter tests), else the reference. `owners`: the book's landing slots may still hold
    their victims (`book.owner`), which takes the one-program kernel that sees every row before
    it claims; without, the owner table must be all -1 (a program per row, claims in any order)."""
    if uses_triton(ids.device):
        from ft.kernels.expert_lookup import kernel  # NOTE: imports triton only when used

        if owners:
            return kernel.expert_lookup_owned_triton(ids, slot_table, book, layer)
        return kernel.expert_lookup_triton(ids, slot_table, book, layer)
    return expert_lookup_ref(ids, slot_table, book, layer)


def route_and_lookup(logits: torch.Tensor, top_k: int, normalize: bool, slot_table: torch.Tensor, book: ExpertBook,
                     layer: int, *, owners: bool = False, shared_gate: bool = False, forced: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ft.kernels.router.route` (no slot table) then `expert_lookup`: (weights [T, k + S], ids [T, k] int64,
    slots [T, k] int32, dst [T, k] int32). One token with owners on Triton (`MoeOptions.route_lookup_fused`):
    one launch that keeps the ids in registers (on by default; variant "route-lookup-apart"); otherwise the two
    dispatchers, whose results and book updates it equals."""
    if (owners and logits.shape[0] == 1 and kernel_options().moe.route_lookup_fused and uses_triton(logits.device)
            and logits.shape[-1] - int(shared_gate) <= 8192):
        from ft.kernels.expert_lookup.kernel import route_lookup_owned_triton  # NOTE: imports triton only when used

        return route_lookup_owned_triton(logits, top_k, normalize, slot_table, book, layer, shared_gate=shared_gate,
                                         forced=forced)
    weights, ids, _ = route(logits, top_k, normalize, shared_gate=shared_gate, forced=forced)
    slots, dst = expert_lookup(ids, slot_table, book, layer, owners=owners)
    return weights, ids, slots, dst


def commit_landed(slot_table: torch.Tensor, book: ExpertBook) -> None:
    """Dispatcher (`commit_landed_ref`'s contract): the step's landed experts mapped in `slot_table`
    [L, E] on the device, queued right after the step; the Triton kernel on CUDA, else the reference."""
    if uses_triton(slot_table.device):
        from ft.kernels.expert_lookup.kernel import commit_landed_triton  # NOTE: imports triton only when used

        commit_landed_triton(slot_table, book)
    else:
        commit_landed_ref(slot_table, book)
