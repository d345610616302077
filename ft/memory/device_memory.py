"""What the card's memory holds right now, by the driver's count: the figure beside the budget.

The budget (`ft.memory.budget`) is planned: weights, the activation reserve, the pools, and the
headroom kept back from them all (`ft.memory.budget.headroom_for`: for what no plan counts:
library workspaces, the CUDA context's growth, the caching allocator's fragments). Whether that
headroom is ever used is a measurement, not a plan: `DeviceMemoryProbe` reads the driver's count
of the card's use (`cudaMemGetInfo`, as nvidia-smi shows it) and the most torch's caching
allocator ever held, so the startup lines, `/metrics`, `ft ctl cache` and `ft top` can show how
much of the card the process has never taken: the measurement behind the default headroom's cap
(bench/RESULTS.md, session 54), and what tells a user whether a higher `--memory-ratio` is safe
on their workload.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

__all__ = ["DeviceMemory", "DeviceMemoryProbe"]


@dataclass(frozen=True)
class DeviceMemory:
    """One reading, in bytes. `card_bytes`: the card the budget sees (the device, or
    `--gpu-memory-limit`); `used_bytes`: the device's use by the driver's count (total - free:
    weights, pools, reserves, the caching allocator's blocks, library workspaces, the CUDA
    context, and any other process on the same device); `allocator_peak_bytes`: the most torch's
    caching allocator has held since the process started (its blocks are kept once taken, so it
    is also about what `used_bytes` has been at most, less the context and libraries);
    `headroom_bytes`: what the budget keeps back from the pools and the reserve (`MemoryBudget`)."""

    card_bytes: int
    used_bytes: int
    allocator_peak_bytes: int
    headroom_bytes: int

    @property
    def untouched_bytes(self) -> int:
        """Of the card, what the process has not taken (0 when it took more than the card: an
        emulated card on a larger device)."""
        return max(0, self.card_bytes - self.used_bytes)


class DeviceMemoryProbe:
    """Reads `DeviceMemory` for one CUDA device, at most every `interval_s` seconds (a cached
    reading between). `read()` -> None on any other device: the CPU "card" is host memory shared
    with everything else, and the driver has no count of it.

    Cost: one `cudaMemGetInfo` (a driver call, no device sync) and one allocator query per
    interval; thread-safe enough for the engine thread that owns it (one reader)."""

    def __init__(self, device: torch.device, card_bytes: int, headroom_bytes: int, interval_s: float = 1.0) -> None:
        self.device = device
        self.card_bytes = card_bytes
        self.headroom_bytes = headroom_bytes
        self.interval_s = interval_s
        self._last: DeviceMemory | None = None
        self._at = float("-inf")

    def read(self, fresh: bool = False) -> DeviceMemory | None:
        """The reading (taken now when `fresh` or the cached one is older than the interval)."""
        if self.device.type != "cuda":
            return None
        now = time.monotonic()
        if fresh or self._last is None or now - self._at >= self.interval_s:
            free, total = torch.cuda.mem_get_info(self.device)
            self._last = DeviceMemory(self.card_bytes, total - free,
                                      torch.cuda.max_memory_reserved(self.device), self.headroom_bytes)
            self._at = now
        return self._last

    def figures(self) -> dict[str, int] | None:
        """`read()` as plain numbers (the `DeviceMemory` fields), None off CUDA: what the engine's stats and
        the admin view publish."""
        reading = self.read()
        return dataclasses.asdict(reading) if reading is not None else None
