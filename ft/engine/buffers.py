"""The model runner's persistent device buffers: a buffer loaded from a host staging twin each step
(`StagedBuffer`) and the batch's page table (`PageTableBuffer`). Fixed addresses from step to step,
what a CUDA graph capture needs."""

from __future__ import annotations

import torch


class StagedBuffer:
    """A persistent device buffer [capacity] and its host staging twin (pinned on CUDA)."""

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._alloc(max(1, capacity))

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.device_buffer = torch.zeros(capacity, dtype=self.dtype, device=self.device)
        self.host = torch.zeros(capacity, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        self._host_np = self.host.numpy()

    def reserve(self, n: int) -> None:
        # NOTE: the only reallocation: a batch larger than the buffer (the constructor's sizes
        # were too small). The address changes, so a captured graph would have to be recaptured.
        if n > self.capacity:
            self._alloc(max(n, 2 * self.capacity))

    def load(self, values) -> torch.Tensor:
        """Copy `values` (a list of numbers) into the buffer's prefix; returns that prefix [n]."""
        n = len(values)
        self.reserve(n)
        self._host_np[:n] = values
        out = self.device_buffer[:n]
        out.copy_(self.host[:n], non_blocking=True)
        return out


class PageTableBuffer:
    """The page table [rows, cols] int64 of a batch: row i holds sequence i's KV pages.

    Only the block [B, w] a batch uses travels: packed in the host staging, copied in one copy to
    a flat device scratch, then spread into the table's rows on the device (fixed addresses)."""

    def __init__(self, rows: int, cols: int, device: torch.device) -> None:
        self.device = device
        self._alloc(max(1, rows), max(1, cols))

    def _alloc(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols
        self.table = torch.zeros(rows, cols, dtype=torch.int64, device=self.device)
        self._scratch = torch.zeros(rows * cols, dtype=torch.int64, device=self.device)
        self._host = torch.zeros(rows * cols, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._host_np = self._host.numpy()

    def reserve(self, rows: int, cols: int) -> None:
        # NOTE: reallocates (new addresses) only when a batch exceeds the constructor's sizes.
        if rows > self.rows or cols > self.cols:
            self._alloc(max(rows, self.rows), max(cols, self.cols))

    def load_rows(self, pages: list[list[int]]) -> torch.Tensor:
        """Write each sequence's pages into its row; returns table[:B] (its full width)."""
        self.load(pages)
        return self.table[: len(pages)]

    def load(self, pages: list[list[int]]) -> list[torch.Tensor]:
        """Write each sequence's pages into its row; returns the views table[i, :len(pages[i])]."""
        b, w = len(pages), max(1, max(map(len, pages), default=0))
        self.reserve(b, w)
        block = self._host_np[: b * w].reshape(b, w)
        for i, row in enumerate(pages):
            block[i, : len(row)] = row
        self._scratch[: b * w].copy_(self._host[: b * w], non_blocking=True)
        self.table[:b, :w].copy_(self._scratch[: b * w].view(b, w))
        return [self.table[i, : len(row)] for i, row in enumerate(pages)]
