"""CPU-side checks of the CUDA VMM buffer module (the GPU behaviour is checked by bench/vmm_check.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from ft.memory import vmm
from ft.memory.cuda_driver import DriverError, unwrap

MiB = 1 << 20
G = 2 * MiB


def test_imports_without_cuda():
    mod = importlib.import_module("ft.memory.vmm")
    assert hasattr(mod, "VmmBuffer") and hasattr(mod, "resize_rows_vmm")


def test_not_available_on_cpu():
    assert vmm.vmm_available(torch.device("cpu")) is False
    assert vmm.vmm_available("cpu") is False


def test_buffer_refuses_cpu_device():
    with pytest.raises(ValueError):
        vmm.VmmBuffer(G, torch.device("cpu"))


@pytest.mark.parametrize("nbytes,chunks", [
    (0, 0), (-5, 0), (1, 1), (G - 1, 1), (G, 1), (G + 1, 2), (100 * MiB, 50), (40 * MiB, 20),
    (40 * MiB + 1, 21), (300 * MiB, 150),
])
def test_chunks_for(nbytes, chunks):
    assert vmm.chunks_for(nbytes, G) == chunks
    assert vmm.round_up(nbytes, G) == chunks * G


def test_chunks_for_is_minimal_cover():
    for gran in (1, 3, 4096, G):
        for n in range(0, 5 * gran + 2, max(1, gran // 3)):
            c = vmm.chunks_for(n, gran)
            assert c * gran >= n
            assert c == 0 or (c - 1) * gran < n


def test_chunks_for_rejects_bad_granularity():
    with pytest.raises(ValueError):
        vmm.chunks_for(10, 0)


def test_check_raises_with_error_name():
    class FakeResult(int):
        @property
        def name(self):
            return {0: "CUDA_SUCCESS", 2: "CUDA_ERROR_OUT_OF_MEMORY"}[int(self)]

    class FakeDriver:
        class CUresult:
            CUDA_SUCCESS = FakeResult(0)

        @staticmethod
        def cuGetErrorName(err):
            return (FakeResult(0), err.name.encode())

    assert unwrap("cuX", (FakeResult(0), 7), drv=FakeDriver) == 7
    assert unwrap("cuX", (FakeResult(0), 7, 8), drv=FakeDriver) == (7, 8)
    assert unwrap("cuX", (FakeResult(0),), drv=FakeDriver) is None
    with pytest.raises(vmm.VmmError, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY") as ei:
        unwrap("cuMemCreate", (FakeResult(2), None), vmm.VmmError, drv=FakeDriver)
    assert ei.value.code == "CUDA_ERROR_OUT_OF_MEMORY"
    with pytest.raises(DriverError, match="cuX failed: CUDA_ERROR_OUT_OF_MEMORY"):
        unwrap("cuX", FakeResult(2), drv=FakeDriver)
