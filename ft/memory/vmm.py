"""Growable CUDA buffers on the driver's virtual memory management (VMM) API.

A `VmmBuffer` reserves one virtual address range, as large as the buffer could ever get, and maps
physical chunks (the allocation granularity, 2 MiB on an H200) at its tail to grow, or unmaps and
releases them to shrink. The base address never moves, so CUDA graphs captured over the buffer stay
valid; kept rows keep their data; a released chunk goes back to the driver at once (free memory as
seen by `torch.cuda.mem_get_info` rises right away). Old and new copies never coexist.

Driver calls go through `cuda.bindings.driver` (cuda-python), imported lazily, so this module
imports on a machine with no CUDA at all. Each physical chunk is its own `cuMemCreate` handle, so
any tail chunk can be released on its own.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from ft.memory.cuda_driver import DriverError, driver, unwrap

__all__ = ["VmmBuffer", "VmmError", "chunks_for", "resize_rows_vmm", "round_up", "vmm_available"]


class VmmError(DriverError):
    """A CUDA driver call of a VMM buffer failed; `code` is the driver's error name (e.g. CUDA_ERROR_OUT_OF_MEMORY)."""


def chunks_for(nbytes: int, granularity: int) -> int:
    """The fewest granularity-sized chunks whose total is >= nbytes (0 for nbytes <= 0)."""
    if granularity <= 0:
        raise ValueError(f"granularity must be positive, got {granularity}")
    if nbytes <= 0:
        return 0
    return -(-nbytes // granularity)


def round_up(nbytes: int, granularity: int) -> int:
    """nbytes rounded up to a whole number of chunks."""
    return chunks_for(nbytes, granularity) * granularity


def _check(drv, call: str, result):
    """Unwrap a cuda-bindings (err, *values) tuple; raise VmmError with the error name on failure."""
    return unwrap(call, result, VmmError, drv)


def _device_index(device: torch.device | str | int) -> int:
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"VMM buffers live on a CUDA device, not {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def vmm_available(device: torch.device | str | int) -> bool:
    """True when `device` is a CUDA device, cuda-python's driver bindings import, and the device
    supports virtual memory management."""
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            return False
        idx = _device_index(dev)
        if idx >= torch.cuda.device_count():
            return False
        drv = driver()
        _check(drv, "cuInit", drv.cuInit(0))
        cu_dev = _check(drv, "cuDeviceGet", drv.cuDeviceGet(idx))
        attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        return bool(_check(drv, "cuDeviceGetAttribute", drv.cuDeviceGetAttribute(attr, cu_dev)))
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False


class _CudaArray:
    """A minimal `__cuda_array_interface__` (v3) exporter over raw bytes; holds its owner alive
    for as long as the torch tensor made from it lives (torch keeps a reference to this object)."""

    def __init__(self, ptr: int, nbytes: int, owner: Any):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "version": 3,
            "typestr": "|u1",
            "shape": (nbytes,),
            "data": (ptr, False),
            "strides": None,
        }


class VmmBuffer:
    """One reserved virtual address range with physical chunks mapped at its base, grown or shrunk
    at the tail by `resize`. Views come from `tensor`; views of bytes past `mapped_bytes` after a
    shrink must not be used (their memory is gone)."""

    def __init__(self, max_bytes: int, device: torch.device | str | int):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self._lock = threading.Lock()
        self._handles: list[Any] = []  # one cuMemCreate handle per mapped chunk, base first
        self._ptr = 0
        self._reserved = 0
        self._ctx = None
        self._closed = True
        self._device_index = _device_index(device)
        self.device = torch.device("cuda", self._device_index)

        # Let torch create (and make current) the device's primary context before we talk to the
        # driver, then hold our own reference to that same context.
        torch.cuda.init()
        with torch.cuda.device(self._device_index):
            torch.empty(1, device=self.device)
        drv = self._drv = driver()
        _check(drv, "cuInit", drv.cuInit(0))
        self._cu_dev = _check(drv, "cuDeviceGet", drv.cuDeviceGet(self._device_index))
        self._ctx = _check(drv, "cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(self._cu_dev))
        try:
            self._make_current()
            prop = drv.CUmemAllocationProp()
            prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = self._device_index
            self._prop = prop
            self._granularity = int(_check(drv, "cuMemGetAllocationGranularity", drv.cuMemGetAllocationGranularity(
                prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
            access = drv.CUmemAccessDesc()
            access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = self._device_index
            access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self._access = access
            reserved = round_up(max_bytes, self._granularity)
            ptr = _check(drv, "cuMemAddressReserve", drv.cuMemAddressReserve(reserved, self._granularity, 0, 0))
            self._ptr = int(ptr)
            self._reserved = reserved
            self._closed = False
        except BaseException:
            drv.cuDevicePrimaryCtxRelease(self._cu_dev)
            self._ctx = None
            raise

    # ----------------------------------------------------------------------------------------
    @property
    def ptr(self) -> int:
        """The base address (never changes while the buffer is open)."""
        return self._ptr

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def max_bytes(self) -> int:
        """The reserved size: max_bytes as asked, rounded up to the granularity."""
        return self._reserved

    @property
    def mapped_bytes(self) -> int:
        return len(self._handles) * self._granularity

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return (f"VmmBuffer(ptr=0x{self._ptr:x}, mapped={self.mapped_bytes}, max={self._reserved}, "
                f"granularity={getattr(self, '_granularity', 0)}, device={self.device})")

    # ----------------------------------------------------------------------------------------
    def _make_current(self) -> None:
        drv = self._drv
        cur = _check(drv, "cuCtxGetCurrent", drv.cuCtxGetCurrent())
        if cur is None or int(cur) != int(self._ctx):
            _check(drv, "cuCtxSetCurrent", drv.cuCtxSetCurrent(self._ctx))

    def _unmap_tail(self, n: int) -> None:
        """Unmap and release the last n chunks."""
        drv, g = self._drv, self._granularity
        for _ in range(n):
            i = len(self._handles) - 1
            _check(drv, "cuMemUnmap", drv.cuMemUnmap(self._ptr + i * g, g))
            _check(drv, "cuMemRelease", drv.cuMemRelease(self._handles[i]))
            self._handles.pop()

    def _map_tail(self, n: int) -> None:
        """Map n more chunks at the tail, all or none: on failure every chunk made here is unmapped
        and released again and MemoryError is raised with the driver's error name."""
        drv, g = self._drv, self._granularity
        start = len(self._handles)
        made: list[Any] = []  # handles created here
        mapped = 0  # how many of them are mapped
        try:
            for k in range(n):
                h = _check(drv, "cuMemCreate", drv.cuMemCreate(g, self._prop, 0))
                made.append(h)
                _check(drv, "cuMemMap", drv.cuMemMap(self._ptr + (start + k) * g, g, 0, h, 0))
                mapped += 1
            # One access call over the whole new range (it may span several allocations).
            _check(drv, "cuMemSetAccess", drv.cuMemSetAccess(self._ptr + start * g, n * g, [self._access], 1))
        except VmmError as e:
            for k in range(mapped):
                drv.cuMemUnmap(self._ptr + (start + k) * g, g)
            for h in made:
                drv.cuMemRelease(h)
            raise MemoryError(
                f"VMM: mapping {n} chunk(s) of {g} bytes ({n * g / 2**20:.1f} MiB) on top of "
                f"{start * g / 2**20:.1f} MiB on {self.device} failed after {len(made)} chunk(s): "
                f"{e.call} returned {e.code}") from e
        self._handles.extend(made)

    def resize(self, nbytes: int) -> None:
        """Map or unmap whole chunks at the tail so that mapped_bytes is the fewest chunks holding
        nbytes. Growing raises MemoryError (buffer unchanged) when the driver cannot back it.
        Shrinking first waits for the device, so no queued kernel touches freed memory."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            if self._closed:
                raise RuntimeError("VmmBuffer is closed")
            if nbytes > self._reserved:
                raise ValueError(f"VmmBuffer: {nbytes} bytes exceed the reservation of {self._reserved}")
            want = chunks_for(nbytes, self._granularity)
            have = len(self._handles)
            if want == have:
                return
            self._make_current()
            if want > have:
                self._map_tail(want - have)
            else:
                torch.cuda.synchronize(self.device)
                self._unmap_tail(have - want)

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int] | torch.Size) -> torch.Tensor:
        """A CUDA tensor of `shape` viewing the mapped bytes from the base address (no copy). The
        tensor holds a reference to this buffer."""
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = numel * itemsize
        if self._closed:
            raise RuntimeError("VmmBuffer is closed")
        if nbytes > self.mapped_bytes:
            raise ValueError(f"VmmBuffer: view of {nbytes} bytes exceeds the {self.mapped_bytes} mapped")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=self.device)
        with torch.cuda.device(self._device_index):
            raw = torch.as_tensor(_CudaArray(self._ptr, nbytes, self), device=self.device)
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        """Unmap and release every chunk, free the reservation, drop the context reference.
        Idempotent. Views made by `tensor` must not be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            drv = self._drv
            try:
                self._make_current()
                if self._handles:
                    torch.cuda.synchronize(self.device)
                self._unmap_tail(len(self._handles))
                _check(drv, "cuMemAddressFree", drv.cuMemAddressFree(self._ptr, self._reserved))
            finally:
                self._reserved = 0
                if self._ctx is not None:
                    drv.cuDevicePrimaryCtxRelease(self._cu_dev)
                    self._ctx = None

    def __del__(self):
        with contextlib.suppress(Exception):  # best effort, also at interpreter shutdown
            self.close()


def resize_rows_vmm(buf: VmmBuffer, t: torch.Tensor, rows: int) -> torch.Tensor:
    """Grow or shrink `buf` to hold `rows` rows shaped like t's rows and return a view of `rows`
    rows from the same base address; rows below min(rows, len(t)) keep their data, new rows are
    uninitialised. `t` and older views must not be used past the new end afterwards."""
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    if t.numel() > 0 and t.data_ptr() != buf.ptr:
        raise ValueError("resize_rows_vmm: t does not view buf from its base address")
    row_shape = tuple(t.shape[1:])
    row_bytes = t.element_size()
    for d in row_shape:
        row_bytes *= d
    buf.resize(rows * row_bytes)
    return buf.tensor(t.dtype, (rows, *row_shape))
