"""Rank 0's control messages to the worker ranks through shared memory: one writer, N readers.

Why not a gloo broadcast: on the H200 host a batch-1 decode step's message took 0.30-0.34 ms
through gloo (TCP over loopback), spent before either rank could launch its graph, and 1.6 ms at
batch 8 (two broadcasts); and a gloo collective times out, so a worker waiting for the next step
of a server idle longer than the timeout would fail. Here a worker polls a sequence number in a
mapped file and waits as long as rank 0's process lives.

Layout of the mapped file (little-endian uint64 words): [0] the sequence number of the message
part now in the buffer, [1] the whole message's length, [2] this part's length, [8 + r] the last
part reader r has copied (its acknowledgement); the payload starts at `PAYLOAD_OFFSET`. A message
longer than the payload area goes in parts, each written only after every reader acknowledged the
one before.

NOTE: correctness rests on the writer's stores becoming visible in program order (payload and
lengths before the sequence number) and the reader's loads likewise: true of x86-64 (TSO), not of
Arm; `supported()` says whether this host may use the channel (else the group keeps gloo).
"""

from __future__ import annotations

import mmap
import os
import pickle
import platform
import struct
import tempfile
import time
from collections.abc import Callable

PAYLOAD_OFFSET = 4096
CHANNEL_BYTES = 4 * 1024 * 1024 + PAYLOAD_OFFSET
"""The mapped file's size; pages are committed as written (a decode step's message is a few KiB)."""

SPIN_S = 0.2
"""How long a reader polls without sleeping after its last message (decode steps come every few
milliseconds: a sleeping reader would add its wake-up latency to every step); then it backs off
to sleeps of up to `MAX_SLEEP_S`."""
MAX_SLEEP_S = 0.002


def supported() -> bool:
    """Whether this host orders stores and loads as the channel needs (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def channel_path(port: int) -> str:
    """The file every rank of the group meeting at `port` maps (rank 0 creates it): in
    $FT_TP_CONTROL_DIR, else /dev/shm, else the temporary directory."""
    base = os.environ.get("FT_TP_CONTROL_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    return os.path.join(base, f"ft-tp-control-{os.getuid()}-{port}")


class ControlChannel:
    """`send(obj)` on rank 0 (the writer), `recv()` on the readers 1..readers. Create the writer
    first (`create=True`), open the readers, then the writer may `unlink()` the file (the mappings
    stay)."""

    def __init__(self, path: str, rank: int, readers: int, create: bool, timeout_s: float,
                 size: int = CHANNEL_BYTES) -> None:
        if readers + 8 > PAYLOAD_OFFSET // 8:
            raise ValueError(f"{readers} readers do not fit the header")
        self.path, self.rank, self.readers, self.timeout_s = path, rank, readers, timeout_s
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.capacity = size - PAYLOAD_OFFSET
        self._seq = 0  # the writer's last part / the reader's last part read
        self._parent = os.getppid()
        self.readers_alive: Callable[[], bool] | None = None  # the writer's check of its readers' processes

    def unlink(self) -> None:
        """Remove the file (every rank has mapped it): nothing is left behind if a rank dies."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a view still exported: the mapping goes with the process
            pass

    # ------------------------------------------------------------------ writer
    def send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        m = self._map
        for off in range(0, max(1, len(data)), self.capacity):
            part = data[off : off + self.capacity]
            self._wait_acks()
            m[PAYLOAD_OFFSET : PAYLOAD_OFFSET + len(part)] = part
            struct.pack_into("<QQ", m, 8, len(data), len(part))
            self._seq += 1
            struct.pack_into("<Q", m, 0, self._seq)  # last: publishes the part

    def _wait_acks(self) -> None:
        """Until every reader copied the part now in the buffer."""
        m, want = self._map, self._seq
        deadline = checked = None
        while True:
            acks = struct.unpack_from(f"<{self.readers}Q", m, 64 + 8)
            if min(acks) >= want:
                return
            now = time.monotonic()
            if deadline is None:
                deadline, checked = now + self.timeout_s, now
            elif now > deadline:
                slow = [r + 1 for r, a in enumerate(acks) if a < want]
                raise RuntimeError(f"tensor-parallel rank(s) {slow} did not take a control message in "
                                   f"{self.timeout_s:.0f} s")
            elif now - checked > 1.0 and self.readers_alive is not None:
                checked = now
                if not self.readers_alive():  # a dead reader never acknowledges: no need to wait it out
                    raise RuntimeError("a tensor-parallel worker rank exited before it took a control message")
            time.sleep(0)

    # ------------------------------------------------------------------ readers
    def recv(self):
        parts, got, total = [], 0, None
        while total is None or got < total:
            self._wait_part()
            m = self._map
            total, n = struct.unpack_from("<QQ", m, 8)
            parts.append(bytes(m[PAYLOAD_OFFSET : PAYLOAD_OFFSET + n]))
            got += n
            struct.pack_into("<Q", m, 64 + 8 * self.rank, self._seq)  # acknowledged: the writer may go on
        return pickle.loads(b"".join(parts))

    def _wait_part(self) -> None:
        """Until the writer published part self._seq + 1 (polls, then sleeps; fails if rank 0's
        process, this worker's parent, is gone)."""
        m, want = self._map, self._seq + 1
        t0 = time.monotonic()
        nap, checked = 0.0, t0
        while struct.unpack_from("<Q", m, 0)[0] < want:
            now = time.monotonic()
            if now - t0 <= SPIN_S:
                time.sleep(0)  # a yield: rank 0 may share this core (a small CPU machine)
            else:
                nap = min(MAX_SLEEP_S, nap * 2 or 5e-5)
                time.sleep(nap)
                if now - checked > 1.0:
                    checked = now
                    if os.getppid() != self._parent:
                        raise RuntimeError("rank 0's process is gone")
        self._seq = want
