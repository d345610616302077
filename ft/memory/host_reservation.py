"""Growable host buffers on a reserved range of anonymous memory: the CPU's counterpart of CUDA VMM.

A `HostReservation` maps `max_bytes` of private anonymous memory with MAP_NORESERVE: address
space only, no memory is committed until a page is first written. Growing only moves the end
(pages become resident as rows are written); shrinking gives the tail's pages back to the kernel
at once with madvise(MADV_DONTNEED) (they read as zeros if touched again). The base address never
moves and old and new never coexist, so a pool resize on the CPU frees before it allocates exactly
like the CUDA path. Linux only (`available()`); elsewhere pools fall back to a reallocating resize.
"""

from __future__ import annotations

import mmap
import sys

import torch

PAGE_BYTES = mmap.PAGESIZE
# NOTE: Python 3.11's mmap module lacks the constant; 0x4000 is its value on Linux.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


def available() -> bool:
    """Whether anonymous reservations with MADV_DONTNEED work here (Linux)."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_DONTNEED")


def round_to_pages(nbytes: int) -> int:
    return -(-max(0, nbytes) // PAGE_BYTES) * PAGE_BYTES


class HostReservation:
    """One reserved range; `committed_bytes` is the prefix rows may use (whole pages)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = round_to_pages(max_bytes)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        self._mm = mmap.mmap(-1, self.max_bytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # NOTE: the tensor keeps the mmap object alive (torch.frombuffer holds a reference).
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.committed_bytes = 0

    @property
    def ptr(self) -> int:
        return self._bytes.data_ptr()

    def resize(self, nbytes: int) -> None:
        """Make the first `nbytes` (rounded up to pages) usable; a shrink releases the tail's pages."""
        if nbytes < 0 or nbytes > self.max_bytes:
            raise ValueError(f"HostReservation: {nbytes} bytes is outside 0..{self.max_bytes}")
        new = round_to_pages(nbytes)
        if new < self.committed_bytes:
            self._mm.madvise(mmap.MADV_DONTNEED, new, self.committed_bytes - new)
        self.committed_bytes = new

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of the first bytes as `shape` (no copy)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= int(s)
        if numel * itemsize > self.committed_bytes:
            raise ValueError(f"HostReservation: a view of {numel * itemsize} bytes exceeds {self.committed_bytes}")
        return self._bytes[: numel * itemsize].view(dtype).view(tuple(shape))
