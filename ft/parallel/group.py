"""The process group of a tensor-parallel engine: collectives on the activations, control messages.

Two groups over the same ranks: the *device* group sums activations (NCCL on CUDA, so that the
all-reduces run inside CUDA graphs; gloo on the CPU) and the *control* group (gloo, CPU) carries
Python objects from rank 0 to the workers: each step's inputs, pool operations, rebuild orders,
and the workers' answers. Messages are pickled (`broadcast_object_list`); they are small (token
ids, page lists) next to a step's work.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

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

    def broadcast(self, obj=None):
        """Rank 0 sends `obj` to every rank; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._control_group)
        return box[0]

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
