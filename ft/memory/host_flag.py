"""A flag in pinned host memory that a CUDA stream waits on: the host lets queued device work go on.

`HostFlag.pass_when_set(stream)` queues, on a stream, a wait until the host has set the flag (the driver's
stream memory operations: `cuStreamWaitValue32`, then `cuStreamWriteValue32` clearing it again), recorded into a
CUDA graph like any other operation on a capturing stream; `set()` is the host's side. So a step can be
queued, or its graph launched, before the host has something the step needs part-way (a paged n-gram table's
rows, read on the host from the token the step before sampled: `ft.engine.worker.buffers.RowsBuffer`): the
device runs what comes before the wait meanwhile, and the launch's own host time is off the critical path.

The contract the caller keeps (the driver cannot see this ordering: a stream waiting on a flag no one sets
waits forever, and so does any host call that waits for that stream):
- every queued pass is followed by exactly one `set()`, made after the pass before it was cleared (the
  caller has waited for that step's results), so that a clear never erases the next step's set;
- between queueing a pass and its `set()` the host makes no call that waits for the stream (a
  synchronize, an allocation that frees cached device memory) and sets the flag in a ``finally``.

Host stores are made visible in program order before the flag's (a full fence: `_fence`), so that
whatever the host wrote to pinned memory before `set()` is what the device reads after its wait.
"""

from __future__ import annotations

import threading
import time

import torch

from ft.memory.cuda_driver import call, driver

__all__ = ["HostFlag"]

_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier on the host: an uncontended lock's atomic read-modify-write (x86's locked
    instruction drains the store buffers, write-combined ones included; on Arm a sequentially consistent
    atomic is a dmb). Python exposes no fence of its own."""
    with _FENCE:
        pass


class HostFlag:
    """One 32-bit flag in pinned host memory, mapped for `device` (CUDA only): 0 clear, 1 set."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"a host flag needs a CUDA device, got {device}")
        self.device = device
        # (a 64-byte line of its own: nothing else the host writes shares the device's polled line)
        self._host = torch.zeros(16, dtype=torch.int32, pin_memory=True)
        self._address = int(call("cuMemHostGetDevicePointer", self._host.data_ptr(), 0))

    def pass_when_set(self, stream: torch.cuda.Stream | None = None) -> None:
        """Queue on `stream` (the current one by default; a capturing stream records it): wait until the
        flag is set, then clear it. Work queued after this on the stream runs once the host called `set()`."""
        handle = driver().CUstream((stream or torch.cuda.current_stream(self.device)).cuda_stream)
        address = driver().CUdeviceptr(self._address)
        call("cuStreamWaitValue32", handle, address, 1, int(driver().CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ))
        call("cuStreamWriteValue32", handle, address, 0, 0)

    def works(self, timeout_s: float = 2.0) -> bool:
        """Whether a pass on a stream of its own goes once the host sets the flag, within `timeout_s` (checked
        once, before any step relies on it: a device that never saw the host's store would leave a step
        waiting for ever; a failed check leaves only that side stream waiting)."""
        side = torch.cuda.Stream(self.device)
        self.pass_when_set(side)
        passed = torch.cuda.Event()
        passed.record(side)
        self.set()
        deadline = time.monotonic() + timeout_s
        while not passed.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-4)
        return not self.is_set

    def set(self) -> None:
        """Let the queued pass go (after a fence: the host's earlier stores first)."""
        _fence()
        self._host[0] = 1

    def clear(self) -> None:
        """Take back a set that no pass consumed (only once nothing queued waits on the flag: a failed step's
        recovery, `ft.engine.worker.buffers.RowsBuffer.settle`)."""
        self._host[0] = 0

    @property
    def is_set(self) -> bool:
        """Set and not yet passed by the device (tests and checks)."""
        return bool(self._host[0].item())
