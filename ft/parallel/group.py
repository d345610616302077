"""The process group of a tensor-parallel engine: collectives on the activations, control messages.

Two groups over the same ranks: the *device* group sums activations (NCCL on CUDA, so that the
all-reduces run inside CUDA graphs; gloo on the CPU) and the *control* group (gloo, CPU) carries
Python objects from rank 0 to the workers: each step's inputs, pool operations, rebuild orders,
and the workers' answers. A message is pickled into a preallocated buffer of `MESSAGE_BYTES` and
sent in one broadcast (a longer one takes a second broadcast for the rest): a batch-1 decode
step's message with 1,024 pages took 413-440 us against 615-667 us with torch's
`broadcast_object_list`, which sends the size and the bytes in two collectives (a loaded 2-core
CPU machine, medians of 20 x 100 messages, two runs; not yet measured on the H200's host).
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

MESSAGE_BYTES = 8192
"""The control buffer: a decode step's message (ids, positions, page lists, slots) fits at batch 1
up to ~1,500 pages per sequence; a larger one costs a second broadcast."""

CONTROL_TIMEOUT_S = 600
"""How long a rank waits in a control message or a collective before it gives up (a dead peer)."""


def free_port() -> int:
    """A TCP port free on this host now (the rendezvous of the ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """rank, world and the two process groups of one tensor-parallel engine."""

    def __init__(self, rank: int, world: int, device: torch.device, device_group, control_group) -> None:
        self.rank, self.world, self.device = rank, world, device
        self._device_group, self._control_group = device_group, control_group
        self._message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        self.broadcast_s = 0.0  # host seconds spent in control broadcasts (benchmarks: the per-step cost)
        self.broadcasts = 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (every rank gets the same values); returns x."""
        if x.dtype == torch.bfloat16 and x.device.type == "cpu":
            # NOTE: gloo sums bf16 through a float32 copy here (its own bf16 support varies by build)
            y = x.float()
            dist.all_reduce(y, group=self._device_group)
            x.copy_(y)
            return x
        dist.all_reduce(x, group=self._device_group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, n] on every rank -> [B, world * n]: rank r's columns at r * n (every rank gets it)."""
        x = x.contiguous()
        if x.device.type == "cuda":  # one collective into one tensor (capturable in a CUDA graph)
            out = torch.empty((self.world, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self._device_group)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x, group=self._device_group)
            out = torch.stack(parts)
        return out.permute(1, 0, 2).reshape(x.shape[0], -1)

    def broadcast(self, obj=None):
        """Rank 0 sends `obj` (picklable) to every rank; every rank returns it (rank 0: itself).
        The first 8 bytes of the buffer hold the pickle's length."""
        t0 = time.perf_counter()
        try:
            return self._broadcast(obj)
        finally:
            self.broadcast_s += time.perf_counter() - t0
            self.broadcasts += 1

    def _broadcast(self, obj):
        buf, head = self._message, MESSAGE_BYTES - 8
        data = b""
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            first = data[:head]
            buf[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
            buf[8 : 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self._control_group)
        n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
        rest = None
        if n > head:  # the rest in a second broadcast
            rest = torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8) if self.rank == 0 \
                else torch.empty(n - head, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self._control_group)
        if self.rank == 0:
            return obj
        body = buf[8 : 8 + min(n, head)].numpy().tobytes()
        if rest is not None:
            body += rest.numpy().tobytes()
        return pickle.loads(body)

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self._control_group)
        return out

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_group(rank: int, world: int, port: int, device: torch.device) -> TPGroup:
    """Join the group of `world` ranks that meet at 127.0.0.1:port (rank 0 listens)."""
    if device.type == "cuda":
        # NOTE: NVLink multicast stays off (the lent machines ask for it; NCCL falls back to its
        # ring and tree algorithms); the watchdog's asynchronous error handling would query events
        # that a CUDA graph capture owns (torch's notes on capturing NCCL collectives)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    timeout = timedelta(seconds=CONTROL_TIMEOUT_S)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout, **kwargs)
    device_group = dist.group.WORLD
    control_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else device_group
    return TPGroup(rank, world, device, device_group, control_group)
