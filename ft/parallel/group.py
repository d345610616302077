"""The process group of a tensor-parallel engine: collectives on the activations, control messages.

Two groups over the same ranks: the *device* group sums activations (NCCL on CUDA, inside the
CUDA graphs; optionally torch's symmetric-memory one-shot kernel, `enable_one_shot`; gloo on the
CPU) and the *control* group (gloo, CPU) gathers the workers' answers. Rank
0's messages to the workers (each step's inputs, pool operations, rebuild orders) go through a
shared-memory `ControlChannel` on x86-64 hosts; elsewhere (or with FT_TP_CONTROL=gloo) through a
gloo broadcast of a preallocated buffer of `MESSAGE_BYTES` (a longer message takes a second
broadcast for the rest): there a batch-1 decode step's message took 0.30-0.34 ms on the H200 host.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ft.parallel.control_channel import ControlChannel, channel_path
from ft.parallel.control_channel import supported as channel_supported

log = logging.getLogger("ft.parallel")

MESSAGE_BYTES = 8192
"""The control buffer: a decode step's message (ids, positions, page lists, slots) fits at batch 1
up to ~1,500 pages per sequence; a larger one costs a second broadcast."""

CONTROL_TIMEOUT_S = 600
"""How long a rank waits in a control message or a collective before it gives up (a dead peer)."""

_SYMMETRIC_RENDEZVOUS = False  # whether this process has set up the one-shot path once (`enable_one_shot`)

ONE_SHOT_BYTES = 512 * 1024
"""The largest all-reduce that takes the one-shot path when it is on (a decode step's hidden states
up to 128 rows of 2,048 bf16); larger ones (prefill chunks) go to NCCL, whose ring moves less."""


def free_port() -> int:
    """A TCP port free on this host now (the rendezvous of the ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """rank, world and the two process groups of one tensor-parallel engine."""

    def __init__(self, rank: int, world: int, device: torch.device, device_group, control_group,
                 channel: ControlChannel | None = None) -> None:
        self.rank, self.world, self.device = rank, world, device
        self._device_group, self._control_group = device_group, control_group
        self.channel = channel  # rank 0's messages through shared memory (else gloo broadcasts)
        self._message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        self._one_shot: dict[torch.dtype, list[torch.Tensor]] = {}  # dtype -> two symmetric buffers
        self._one_shot_turn = 0
        self.all_reduce_path = "nccl" if device.type == "cuda" else "gloo"
        self.broadcast_s = 0.0  # host seconds spent in control broadcasts (benchmarks: the per-step cost)
        self.broadcasts = 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def enable_one_shot(self, dtype: torch.dtype) -> str | None:
        """With FT_TP_ALL_REDUCE=one-shot on CUDA: all-reduces of `dtype` up to `ONE_SHOT_BYTES` take
        torch's symmetric-memory one-shot kernel (every rank reads its peers' buffers over NVLink and
        sums: no ring). A collective: every rank calls it at the same point; the path is used only
        when every rank set it up. Returns None, or why not (NCCL stays).

        Off by default, by measurement: on two H200s (NV18) a batch-1 decode step took 6.66 ms with
        it against 5.69 ms with NCCL's LL ring (bench/RESULTS.md): its kernel took 6.4 us against
        NCCL's 5.3 us once the ranks arrive together, and it needs a copy into its buffer first.
        Kept for topologies where NCCL's small all-reduces are slower (measure there).

        NOTE: two buffers used in turn: a rank that already left all-reduce k cannot overwrite the
        buffer its peer may still read, since it writes the other one in k + 1 and the one after
        only once the peer has reached k + 1."""
        global _SYMMETRIC_RENDEZVOUS
        why = None
        if self.device.type != "cuda":
            why = "not on CUDA"
        elif os.environ.get("FT_TP_ALL_REDUCE", "nccl") != "one-shot":
            why = "off unless FT_TP_ALL_REDUCE=one-shot (NCCL measured faster on two H200s)"
        elif _SYMMETRIC_RENDEZVOUS:
            # NOTE: torch numbers the store exchanges of its symmetric-memory rendezvous per process:
            # rank 0's count goes on from an earlier engine in this process, a new worker's starts at
            # 0, and the two would wait for each other's keys forever (a hang seen on the H200s)
            why = "an earlier tensor-parallel engine in this process set it up (torch counts its rendezvous per process)"
        why = next((w for w in self.gather(why) if w is not None), None)  # every rank takes the same path
        bufs: list[torch.Tensor] = []
        if why is None:
            _SYMMETRIC_RENDEZVOUS = True
            try:
                import torch.distributed._symmetric_memory as symm_mem

                name = self._device_group.group_name
                for _ in range(2):
                    b = symm_mem.empty(ONE_SHOT_BYTES // dtype.itemsize, dtype=dtype, device=self.device)
                    symm_mem.rendezvous(b, name)
                    bufs.append(b)
                probe = torch.full((64,), float(self.rank + 1), dtype=dtype, device=self.device)
                self._sum_one_shot(probe, bufs[0])
                if probe.float().sub_(self.world * (self.world + 1) / 2).abs_().max().item() != 0:
                    why = "its probe summed wrong"
            except Exception as e:  # noqa: BLE001 - any failure keeps NCCL, said in the log
                why = f"{type(e).__name__}: {e}"
        answers = self.gather(why)
        why = next((w for w in answers if w is not None), None)
        if why is None:
            self._one_shot[dtype] = bufs
            self.all_reduce_path = "one-shot"
        return why

    def _sum_one_shot(self, x: torch.Tensor, buf: torch.Tensor) -> None:
        flat = x.view(-1)
        n = flat.numel()
        buf[:n].copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(buf[:n], "sum", self._device_group.group_name, flat)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (every rank gets the same values); returns x."""
        bufs = self._one_shot.get(x.dtype)
        if bufs is not None and x.is_contiguous() and x.numel() <= bufs[0].numel():
            self._one_shot_turn ^= 1
            self._sum_one_shot(x, bufs[self._one_shot_turn])
            return x
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
        Through the shared-memory channel when there is one (rank 0 returns once the message is
        written: a worker may still be reading it), else through gloo."""
        t0 = time.perf_counter()
        try:
            if self.channel is None:
                return self._broadcast(obj)
            if self.rank == 0:
                self.channel.send(obj)
                return obj
            return self.channel.recv()
        finally:
            self.broadcast_s += time.perf_counter() - t0
            self.broadcasts += 1

    def _broadcast(self, obj):
        """gloo: the first 8 bytes of the buffer hold the pickle's length."""
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
        """Leave the group (every rank at once). The caller has released its CUDA graphs first:
        NCCL's teardown waits until no captured graph holds its collectives."""
        self._one_shot.clear()
        if self.channel is not None:
            self.channel.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if dist.is_initialized():
            dist.destroy_process_group()

    def abort(self) -> None:
        """Leave the group without waiting for anything (a destroy that did not finish)."""
        if dist.is_initialized():
            dist.distributed_c10d._abort_process_group()


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
    # the control channel: shared memory on hosts that order stores as it needs, else gloo (also
    # with FT_TP_CONTROL=gloo, the same environment on every rank)
    wanted = channel_supported() and os.environ.get("FT_TP_CONTROL", "shm") != "gloo"
    path, channel, why = channel_path(port), None, None
    if wanted and rank == 0:  # before the group forms: the workers map it once it has
        try:
            if os.path.exists(path):  # left by a process that died with the same port
                os.unlink(path)
            channel = ControlChannel(path, 0, world - 1, True, CONTROL_TIMEOUT_S)
        except OSError as e:  # e.g. /dev/shm full or read-only: gloo carries the messages
            why = f"{type(e).__name__}: {e}"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout, **kwargs)
    device_group = dist.group.WORLD
    control_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else device_group
    if wanted:
        if rank and os.path.exists(path):  # rank 0 made it (it unlinks it only after the gather below)
            try:
                channel = ControlChannel(path, rank, world - 1, False, CONTROL_TIMEOUT_S)
            except OSError as e:
                why = f"{type(e).__name__}: {e}"
        elif rank:
            why = "rank 0 could not create it"
        answers = [None] * world
        dist.all_gather_object(answers, why, group=control_group)  # every rank mapped it, or none uses it
        if rank == 0 and channel is not None:
            channel.unlink()
        failed = next((a for a in answers if a is not None), None)
        if failed is not None:
            if channel is not None:
                channel.close()
            channel = None
            if rank == 0:
                log.warning("tensor parallelism: control messages go through gloo (shared memory: %s)", failed)
    return TPGroup(rank, world, device, device_group, control_group, channel)
