"""Linear-attention ("mamba") state slots: conv and SSM state of every Gated DeltaNet layer.

conv [S, L, C, W-1] (model dtype) and ssm [S, L, Hv, Dk, Dv] (float32), slot-major so the pool
can grow or shrink at its tail. A running request owns one slot; prefix-cache entries own one
each, holding the state at their cached boundary.
"""

from __future__ import annotations

import torch


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
    ) -> None:
        self.conv = torch.zeros(num_slots, num_layers, conv_dim, conv_width - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(
            num_slots, num_layers, num_v_heads, k_dim, v_dim, dtype=torch.float32, device=device
        )
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self.conv.shape[0]

    @property
    def bytes_per_slot(self) -> int:
        return self.conv[0].numel() * self.conv.element_size() + self.ssm[0].numel() * 4

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
        self.conv[slot].zero_()
        self.ssm[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"mamba slot {slot} freed twice"
        self._free.append(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        self.conv[dst].copy_(self.conv[src])
        self.ssm[dst].copy_(self.ssm[src])
