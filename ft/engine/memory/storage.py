"""Where the pools' tensors live and how they resize at their tail.

`PoolStorage` hands out row-major tensors (rows = pages or slots). On CUDA, when the driver
supports virtual memory management, each tensor sits in its own reserved address range
(`vmm.VmmBuffer`) as large as the budget: growing maps physical chunks at the tail, shrinking
unmaps and releases them, so memory is freed before anything else is allocated, the base
address never moves (CUDA graphs stay valid) and nothing is ever resident twice. Elsewhere the
tensor's storage is resized in place (`resizable.resize_rows`).
"""

from __future__ import annotations

import torch

from ft.engine.memory.resizable import resize_rows


def _row_bytes(row_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in row_shape:
        n *= d
    return n


class PoolStorage:
    def __init__(self, device: torch.device, max_bytes: int | None = None, use_vmm: bool | None = None) -> None:
        self.device = device
        self.max_bytes = max_bytes
        if use_vmm is None:
            use_vmm = False
            if device.type == "cuda" and max_bytes:
                from ft.engine.memory.vmm import vmm_available

                use_vmm = vmm_available(device)
        self.use_vmm = use_vmm
        self._buffers: dict[int, object] = {}  # base pointer -> VmmBuffer

    def empty(self, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if not self.use_vmm:
            return torch.empty((rows, *row_shape), dtype=dtype, device=self.device)
        from ft.engine.memory.vmm import VmmBuffer

        buf = VmmBuffer(max(self.max_bytes, rows * _row_bytes(row_shape, dtype)), self.device)
        buf.resize(rows * _row_bytes(row_shape, dtype))
        t = buf.tensor(dtype, (rows, *row_shape))
        self._buffers[buf.ptr] = buf
        return t

    def zeros(self, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.empty(rows, row_shape, dtype).zero_()

    def resize(self, t: torch.Tensor, rows: int) -> torch.Tensor:
        """A view of `rows` rows; kept rows keep their data; `t` is invalid afterwards."""
        buf = self._buffers.get(t.data_ptr()) if self.use_vmm else None
        if buf is None:
            return resize_rows(t, rows)
        from ft.engine.memory.vmm import resize_rows_vmm

        return resize_rows_vmm(buf, t, rows)

    def mapped_bytes(self) -> int:
        return sum(b.mapped_bytes for b in self._buffers.values())
