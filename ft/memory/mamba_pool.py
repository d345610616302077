"""Linear-attention ("mamba") state slots: conv and SSM state of every Gated DeltaNet layer.

conv [S, L, C, W-1] (model dtype) and ssm [S, L, Hv, Dk, Dv] (float32), slot-major so the pool
can grow or shrink at its tail, and any other state a model carries per sequence (`SlotState`:
Qwen3.8-Flash-Next's n-gram context and PLE conv history), in `extra[name]` [S, ...]. A running
request owns one slot; prefix-cache entries own one each, holding the state at their cached
boundary, or keep it in host memory instead (`save` / `restore`: `ft.engine.sched.prefix_cache`).
Every state of a slot is zeroed, copied, saved and resized together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft.memory.resizable import PoolInconsistent, follow_free_slots, narrow_to_common, resize_together
from ft.memory.storage import PoolStorage


@dataclass(frozen=True)
class SlotState:
    """One more per-sequence state: `extra[name]` is [S, *shape] of `dtype`, zero for a new sequence."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class MambaPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        conv_dim: int,
        conv_width: int,
        num_v_heads: int,
        k_dim: int,
        v_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        storage: PoolStorage | None = None,
        slot_states: tuple[SlotState, ...] = (),
    ) -> None:
        self.storage = storage or PoolStorage(device)
        self.conv = self.storage.zeros(num_slots, (num_layers, conv_dim, conv_width - 1), dtype)
        self.ssm = self.storage.zeros(num_slots, (num_layers, num_v_heads, k_dim, v_dim), torch.float32)
        self.extra: dict[str, torch.Tensor] = {
            st.name: self.storage.zeros(num_slots, st.shape, st.dtype) for st in slot_states}
        self._free = list(range(num_slots - 1, -1, -1))
        self.journal = None  # a `ft.engine.base.step_inputs.PoolJournal` recording content writes (tensor parallelism)

    @property
    def num_slots(self) -> int:
        return self.conv.shape[0]

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The pool's tensors, each [S, ...] (what its bytes are made of)."""
        return [self.conv, self.ssm, *self.extra.values()]

    @property
    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        """A slot with zeroed state (a new sequence starts from zero state)."""
        if not self._free:
            raise MemoryError("mamba pool: no free slot")
        slot = self._free.pop()
        self.zero_slot(slot)
        if self.journal is not None:
            self.journal.ops.append(("mamba_zero", slot))
        return slot

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"mamba slot {slot} freed twice"
        self._free.append(slot)

    def zero_slot(self, slot: int) -> None:
        for t in self.tensors:
            t[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        for t in self.tensors:
            t[dst].copy_(t[src])
        if self.journal is not None:
            self.journal.ops.append(("mamba_copy", src, dst))

    def save(self, slot: int) -> list[torch.Tensor]:
        """A copy of every state of `slot` in host memory (pinned on CUDA), one tensor per pool tensor,
        queued on the current stream: whatever that stream runs next (a new owner's zeroing, a later
        `restore`) comes after it, so the slot may be freed at once. Not under tensor parallelism (its
        journal replays device ops only)."""
        assert self.journal is None, "mamba states in host memory: one GPU only"
        pin = self.conv.device.type == "cuda"
        out = []
        for t in self.tensors:
            host = torch.empty(t.shape[1:], dtype=t.dtype, pin_memory=pin)
            host.copy_(t[slot], non_blocking=pin)
            out.append(host)
        return out

    def restore(self, saved: list[torch.Tensor], slot: int) -> None:
        """Copy a `save`d state into `slot` (queued on the current stream, after the save)."""
        assert self.journal is None, "mamba states in host memory: one GPU only"
        for t, host in zip(self.tensors, saved, strict=True):
            t[slot].copy_(host, non_blocking=host.is_pinned())

    # --------------------------------------------------------------------------- resizing
    def slots_in_use_from(self, n: int) -> list[int]:
        free = set(self._free)
        return [s for s in range(n, self.num_slots) if s not in free]

    def relocate_above(self, n: int) -> dict[int, int]:
        """Copy every used slot >= n into a free slot < n; returns {old: new}."""
        moving = self.slots_in_use_from(n)
        low_free = sorted(s for s in self._free if s < n)
        if len(low_free) < len(moving):
            raise MemoryError(f"mamba pool: {len(moving)} slots to keep above {n}, {len(low_free)} free below")
        moves = dict(zip(moving, low_free))
        taken = set(moves.values())
        self._free = [s for s in self._free if s not in taken] + list(moves)
        for old, new in moves.items():
            self.copy_slot(old, new)
        return moves

    def resize(self, num_slots: int) -> None:
        """Grow or shrink to `num_slots`; slots >= num_slots must be free when shrinking. conv, ssm
        and the extra states change together or not at all (PoolInconsistent when even putting back failed: the
        pool then narrows to the slots both still have)."""
        if self.slots_in_use_from(num_slots):
            raise RuntimeError(f"mamba pool: slots >= {num_slots} are still in use")
        old = self.num_slots
        ts = self.tensors
        try:
            resize_together(self.storage, ts, num_slots, "mamba")
        except PoolInconsistent:
            ts = narrow_to_common(ts)
            raise
        finally:
            self.conv, self.ssm = ts[:2]
            self.extra = dict(zip(self.extra, ts[2:]))
            self._follow(old)

    def _follow(self, old: int) -> None:
        self._free = follow_free_slots(self._free, old, self.num_slots)
