"""Where the pools' tensors live and how they resize at their tail.

`PoolStorage` hands out row-major tensors (rows = pages or slots) on one of three backends:

* ``vmm`` (CUDA with the driver's virtual memory management, `vmm.VmmBuffer`): each tensor sits
  in its own reserved address range as large as the budget; growing maps physical chunks (2 MiB on
  an H200) at the tail, shrinking unmaps and releases them. Stable addresses (CUDA graphs stay
  valid), nothing resident twice.
* ``mmap`` (CPU on Linux, `host_reservation.HostReservation`): the same on the host, with pages
  of a reserved anonymous mapping released by madvise.
* ``realloc`` (the fallback: CUDA without cuda-bindings, other OSes): the storage is reallocated
  and copied, so old and new are both resident while it copies. The cache manager counts that
  transient (`reallocates`), which makes the reachable ranges narrower, never wrong.

The storage also records what it really holds (`held_bytes`, and `peak_bytes`, its high-water
mark including a reallocation's transient), so tests and benchmarks can check the planner's
arithmetic against it, and offers a fault hook (`fault`) that tests use to fail any single
tensor resize, in a step or in its inverse.
"""

from __future__ import annotations

from typing import Callable

import torch

from ft.memory.resizable import resize_rows

BACKENDS = ("vmm", "mmap", "realloc")

_CUDA_REALLOC_GRANULARITY = 2 * 1024**2  # the caching allocator rounds large blocks to 2 MiB


def _row_bytes(row_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in row_shape:
        n *= d
    return n


def _choose_backend(device: torch.device, max_bytes: int | None) -> str:
    if device.type == "cuda" and max_bytes:
        from ft.memory.vmm import vmm_available

        return "vmm" if vmm_available(device) else "realloc"
    if device.type == "cpu" and max_bytes:
        from ft.memory.host_reservation import available

        return "mmap" if available() else "realloc"
    return "realloc"


class PoolStorage:
    """Backs the pools' tensors. `max_bytes` is each tensor's reservation (vmm, mmap)."""

    def __init__(self, device: torch.device, max_bytes: int | None = None, backend: str | None = None) -> None:
        self.device = device
        self.max_bytes = max_bytes
        self.backend = backend or _choose_backend(device, max_bytes)
        if self.backend not in BACKENDS:
            raise ValueError(f"storage backend must be one of {BACKENDS}, got {self.backend!r}")
        self._buffers: dict[int, object] = {}  # base pointer -> VmmBuffer | HostReservation
        self._realloc: dict[int, torch.Tensor] = {}  # id of a tensor's storage -> the current tensor
        self.peak_bytes = 0
        self.fault: Callable[[str], None] | None = None  # tests: called before each tensor resize

    # --------------------------------------------------------------------------- arithmetic
    @property
    def use_vmm(self) -> bool:
        return self.backend == "vmm"

    @property
    def reallocates(self) -> bool:
        """Whether a resize copies into a new allocation (old and new resident while it copies)."""
        return self.backend == "realloc"

    @property
    def granularity(self) -> int:
        """Bytes each tensor's allocation is rounded up to."""
        if self.backend == "vmm":
            from ft.memory.vmm import VmmBuffer

            buf = next(iter(self._buffers.values()), None)
            return buf.granularity if isinstance(buf, VmmBuffer) else _vmm_granularity(self.device)
        if self.backend == "mmap":
            from ft.memory.host_reservation import PAGE_BYTES

            return PAGE_BYTES
        return _CUDA_REALLOC_GRANULARITY if self.device.type == "cuda" else 1

    # --------------------------------------------------------------------------- tensors
    def empty(self, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = rows * _row_bytes(row_shape, dtype)
        if self.backend == "realloc":
            t = torch.empty((rows, *row_shape), dtype=dtype, device=self.device)
            self._realloc[id(t.untyped_storage())] = t
        else:
            buf = self._reserve(max(self.max_bytes, nbytes))
            buf.resize(nbytes)
            t = buf.tensor(dtype, (rows, *row_shape))
            self._buffers[buf.ptr] = buf
        self._note_peak(0)
        return t

    def _reserve(self, nbytes: int):
        if self.backend == "vmm":
            from ft.memory.vmm import VmmBuffer

            return VmmBuffer(nbytes, self.device)
        from ft.memory.host_reservation import HostReservation

        return HostReservation(nbytes)

    def zeros(self, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.empty(rows, row_shape, dtype).zero_()

    def resize(self, t: torch.Tensor, rows: int, label: str = "") -> torch.Tensor:
        """A view of `rows` rows; kept rows keep their data; `t` is invalid afterwards. All or
        nothing for this one tensor: on an error `t` is unchanged."""
        if self.fault is not None:
            self.fault(label)
        if self.backend == "realloc":
            return self._resize_realloc(t, rows)
        buf = self._buffers[t.data_ptr()]
        row_shape = tuple(t.shape[1:])
        buf.resize(rows * _row_bytes(row_shape, t.dtype))
        self._note_peak(0)
        return buf.tensor(t.dtype, (rows, *row_shape))

    def _resize_realloc(self, t: torch.Tensor, rows: int) -> torch.Tensor:
        new_bytes = rows * _row_bytes(tuple(t.shape[1:]), t.dtype)
        self._note_peak(_round(new_bytes, self.granularity))  # the copy's transient: old and new
        key = id(t.untyped_storage())
        out = resize_rows(t, rows)
        self._realloc[key] = out
        return out

    def forget(self, t: torch.Tensor) -> None:
        """Stop counting a tensor the caller dropped (unit-cost probes)."""
        self._realloc.pop(id(t.untyped_storage()), None)
        if t.numel():
            self._buffers.pop(t.data_ptr(), None)

    # --------------------------------------------------------------------------- accounting
    def held_bytes(self) -> int:
        """Bytes the backend holds now: chunks mapped (vmm), pages committed (mmap), storages
        rounded to the allocator's granularity (realloc)."""
        if self.backend == "realloc":
            g = self.granularity
            return sum(_round(t.untyped_storage().nbytes(), g) for t in self._realloc.values())
        if self.backend == "vmm":
            return sum(b.mapped_bytes for b in self._buffers.values())
        return sum(b.committed_bytes for b in self._buffers.values())

    def mapped_bytes(self) -> int:
        return self.held_bytes()

    def reset_peak(self) -> None:
        self.peak_bytes = self.held_bytes()

    def _note_peak(self, extra: int) -> None:
        self.peak_bytes = max(self.peak_bytes, self.held_bytes() + extra)


def _round(nbytes: int, granularity: int) -> int:
    return -(-nbytes // granularity) * granularity


def _vmm_granularity(device: torch.device) -> int:
    from ft.memory.vmm import VmmBuffer

    probe = VmmBuffer(1, device)
    try:
        return probe.granularity
    finally:
        probe.close()
