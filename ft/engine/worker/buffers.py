"""The model runner's persistent device buffers: a buffer loaded from a host staging twin each step
(`StagedBuffer`) and the batch's page table (`PageTableBuffer`). Fixed addresses from step to step,
what a CUDA graph capture needs. Buffers carved from one `StagingArena` reach the device in one copy
per step (a decode step's inputs: one host-to-device copy instead of one per input). `RowsBuffer` holds the
rows the host reads for a step (a paged n-gram table's), a decode step's taken through a gate on CUDA."""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import numpy as np
import torch

from ft.memory.host_flag import HostFlag

log = logging.getLogger(__name__)

_ALIGN = 64  # bytes between the regions of an arena (any dtype's alignment)


class StagingArena:
    """One pinned host block and one device block, cut into regions that buffers use as their
    host twin and device buffer. Loads that defer (`StagedBuffer.load(values, defer=True)`) only
    write the host block; `flush()` queues one copy of the span they wrote, then the follow-ups
    queued with `then` (the page table's spread into its rows). Contract: flush before anything
    reads the deferred buffers on the device; as with every staging here, the host block is
    rewritten only after the step that read it ended (the runner waits for each step)."""

    def __init__(self, region_bytes: list[int], device: torch.device) -> None:
        self._offsets, at = [], 0
        for n in region_bytes:
            self._offsets.append(at)
            at += -(-max(1, n) // _ALIGN) * _ALIGN
        self._sizes = list(region_bytes)
        self.host = torch.zeros(max(1, at), dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device_block = torch.zeros(max(1, at), dtype=torch.uint8, device=device)
        self._lo: int | None = None
        self._hi = 0
        self._then: list[Callable[[], None]] = []
        self.flushes = 0  # copies queued by `flush` (tests)

    def region(self, i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Region i as (host view, device view) of `dtype`."""
        lo = self._offsets[i]
        n = self._sizes[i] // torch.empty((), dtype=dtype).element_size()
        hi = lo + n * torch.empty((), dtype=dtype).element_size()
        return self.host[lo:hi].view(dtype), self.device_block[lo:hi].view(dtype)

    def mark(self, host_view: torch.Tensor, nbytes: int) -> None:
        """`nbytes` from the start of `host_view` (a view of this arena's host block) were written."""
        lo = host_view.data_ptr() - self.host.data_ptr()
        self._lo = lo if self._lo is None else min(self._lo, lo)
        self._hi = max(self._hi, lo + nbytes)

    def then(self, fn: Callable[[], None]) -> None:
        """Queue `fn` (device work reading a deferred region) right after the next flush's copy."""
        self._then.append(fn)

    def flush(self) -> None:
        """One copy of the written span to the device, then the follow-ups, in stream order."""
        if self._lo is not None:
            lo, hi = self._lo, self._hi
            self.device_block[lo:hi].copy_(self.host[lo:hi], non_blocking=True)
            self.flushes += 1
        self._lo, self._hi = None, 0
        then, self._then = self._then, []
        for fn in then:
            fn()


class StagedBuffer:
    """A persistent device buffer [capacity] and its host staging twin (pinned on CUDA); in a region
    of a `StagingArena` when given one (`arena`, region index), where loads may defer their copy."""

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device,
                 arena: tuple[StagingArena, int] | None = None) -> None:
        self.dtype, self.device = dtype, device
        self._arena: StagingArena | None = None
        if arena is not None:
            a, i = arena
            self.host, self.device_buffer = a.region(i, dtype)
            if self.host.numel() >= max(1, capacity):
                self._arena, self.capacity = a, self.host.numel()
                self._host_np = self.host.numpy()
                return
        self._alloc(max(1, capacity))

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self._arena = None  # NOTE: a grown buffer leaves its arena: its loads copy at once
        self.device_buffer = torch.zeros(capacity, dtype=self.dtype, device=self.device)
        self.host = torch.zeros(capacity, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        self._host_np = self.host.numpy()

    def reserve(self, n: int) -> None:
        # NOTE: the only reallocation: a batch larger than the buffer (the constructor's sizes
        # were too small). The address changes, so a captured graph would have to be recaptured.
        if n > self.capacity:
            self._alloc(max(n, 2 * self.capacity))

    def load(self, values, defer: bool = False) -> torch.Tensor:
        """Copy `values` (a list of numbers, or a 1-D tensor already on the device: copied there, in
        stream order) into the buffer's prefix; returns that prefix [n]. With `defer` and an arena,
        a list's copy waits for the arena's `flush`."""
        n = len(values)
        if isinstance(values, torch.Tensor):
            self.reserve(n)
            out = self.device_buffer[:n]
            out.copy_(values)
            return out
        self.reserve(n)
        self._host_np[:n] = values
        out = self.device_buffer[:n]
        if defer and self._arena is not None:
            self._arena.mark(self.host, n * self.host.element_size())
        else:
            out.copy_(self.host[:n], non_blocking=True)
        return out


class PageTableBuffer:
    """The page table [rows, cols] int64 of a batch: row i holds sequence i's KV pages.

    Only the block [B, w] a batch uses travels: packed in the host staging, copied in one copy to
    a flat device scratch, then spread into the table's rows on the device (fixed addresses). With
    an arena (`arena`, region index) the staging and the scratch are its region, and a deferred
    load's copy and spread wait for the arena's `flush`.

    Decode steps (`load_rows`) write only what changed: each row remembers the page list it holds
    (the list object itself, and how many of its pages are in the row). The scheduler appends a
    decoding sequence's new pages to its list in place and replaces the list for any other change
    (a rebuild's page moves, a fork, a release), so a row whose list is the same object needs only
    the pages past those it holds: nothing on 63 of 64 steps at pages of 64 tokens, where the whole
    row cost ~37 us of host time per 2,048 pages (a 128K context) every step. `load` (prefill)
    forgets every row."""

    def __init__(self, rows: int, cols: int, device: torch.device,
                 arena: tuple[StagingArena, int] | None = None) -> None:
        self.device = device
        self._arena_region = arena
        self._alloc(max(1, rows), max(1, cols))

    @staticmethod
    def arena_bytes(rows: int, cols: int) -> int:
        """The arena region a table of rows x cols needs (its staging and scratch)."""
        return max(1, rows) * max(1, cols) * 8

    def _alloc(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols
        # per row: (page list, pages of it in the row, the last of them: a check against in-place edits)
        self._held: list[tuple[list[int], int, int] | None] = []
        self.table = torch.zeros(rows, cols, dtype=torch.int64, device=self.device)
        self._arena = None
        if self._arena_region is not None:
            a, i = self._arena_region
            host, scratch = a.region(i, torch.int64)
            if host.numel() >= rows * cols:
                self._arena, self._host, self._scratch = a, host, scratch
        if self._arena is None:  # NOTE: no arena, or grown past its region: copies at once
            self._arena_region = None
            self._scratch = torch.zeros(rows * cols, dtype=torch.int64, device=self.device)
            self._host = torch.zeros(rows * cols, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._host_np = self._host.numpy()

    def reserve(self, rows: int, cols: int) -> None:
        # NOTE: reallocates (new addresses) only when a batch exceeds the constructor's sizes.
        if rows > self.rows or cols > self.cols:
            self._alloc(max(rows, self.rows), max(cols, self.cols))

    def load_rows(self, pages: list[list[int]], defer: bool = False) -> torch.Tensor:
        """Write each sequence's pages into its row; returns table[:B] (its full width). Only the
        pages a row does not hold yet travel (see the class): as (flat index, page) pairs in the
        staging, scattered into the table on the device; nothing when no row changed."""
        b, w = len(pages), max(1, max(map(len, pages), default=0))
        self.reserve(b, w)
        held = self._held + [None] * (b - len(self._held))
        writes = []  # (row, first column, its pages from there)
        for i, row in enumerate(pages):
            h = held[i]
            same = h is not None and h[0] is row and h[1] <= len(row) and (h[1] == 0 or row[h[1] - 1] == h[2])
            start = h[1] if same else 0
            if start < len(row) or not same:
                writes.append((i, start, row[start:]))
        n = sum(len(v) for _, _, v in writes)
        if n and not (defer and self._arena is not None and 2 * n <= self._host.numel()):
            self.load(pages, defer)  # (forgets every row)
            held = [None] * b
        elif n:
            idx = self._host_np[:n]
            val = self._host_np[n: 2 * n]
            k = 0
            for i, c0, v in writes:
                idx[k: k + len(v)] = np.arange(i * self.cols + c0, i * self.cols + c0 + len(v))
                val[k: k + len(v)] = v
                k += len(v)
            scratch, table = self._scratch, self.table

            def scatter() -> None:
                table.view(-1).index_copy_(0, scratch[:n], scratch[n: 2 * n])

            self._arena.mark(self._host, 2 * n * 8)
            self._arena.then(scatter)
        for i, row in enumerate(pages):
            held[i] = (row, len(row), row[-1] if row else -1)
        self._held = held
        return self.table[:b]

    def load(self, pages: list[list[int]], defer: bool = False) -> list[torch.Tensor]:
        """Write each sequence's pages into its row; returns the views table[i, :len(pages[i])]."""
        b, w = len(pages), max(1, max(map(len, pages), default=0))
        self.reserve(b, w)
        self._held = []
        block = self._host_np[: b * w].reshape(b, w)
        for i, row in enumerate(pages):
            block[i, : len(row)] = row

        def spread() -> None:
            self.table[:b, :w].copy_(self._scratch[: b * w].view(b, w))

        if defer and self._arena is not None:
            self._arena.mark(self._host, b * w * 8)
            self._arena.then(spread)
        else:
            self._scratch[: b * w].copy_(self._host[: b * w], non_blocking=True)
            spread()
        return [self.table[i, : len(row)] for i, row in enumerate(pages)]


_FAILED_FLAGS: list[HostFlag] = []


def _host_flag(device: torch.device) -> HostFlag | None:
    """The gate's flag, or None (with a log line) where the driver refuses it or a stream never sees it set
    (`HostFlag.works`): the steps then wait for their rows before they are launched, as before the gate."""
    try:
        flag = HostFlag(device)
        if flag.works():
            return flag
        _FAILED_FLAGS.append(flag)  # NOTE: kept: its side stream may still pass and clear it (its memory stays its)
        why = "a stream waiting on it did not see the host set it"
    except Exception as e:  # noqa: BLE001 - whatever fails (the driver, the bindings' import): no gate, said once
        why = f"{type(e).__name__}: {e}"
    log.warning("n-gram rows: no host flag on %s (%s): each decode step waits for its rows before launch", device, why)
    return None


class RowsBuffer:
    """A persistent device buffer [capacity, width] and its host staging twin (pinned on CUDA) for rows the
    host reads for a step (a paged n-gram table's, `ForwardBatch.ngram_rows`). A load waits for the last
    load's copy to have read the staging before it rewrites it (an event, not a device sync).

    A decode step on CUDA takes its rows through a gate instead (`gate`, `stage`, `mark`; `settle` after a step
    that failed): the step's stream waits, just before the rows are read, for the host to `stage` them
    (`ft.memory.host_flag.HostFlag`), and then copies them in. So an overlapped decode step whose graph is
    already captured is launched before its rows are known (the tokens they hash come from the step still in
    flight): the host reads them while the device runs the layers before the table's
    (`ft.engine.worker.decode_launch`). A gated step that was never staged would wait forever: `owed` says one
    is, `stage` always lets the step go (even when reading its rows failed: the step's output is then dropped
    with its error)."""

    def __init__(self, capacity: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.width, self.dtype, self.device = width, dtype, device
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self.flag = _host_flag(device) if device.type == "cuda" else None
        self.owed = False  # a gate queued (or about to be) and its rows not staged yet
        self._alloc(max(1, capacity))

    @property
    def gated(self) -> bool:
        """Whether decode steps take their rows through the gate (CUDA)."""
        return self.flag is not None

    @staticmethod
    def shape_for(model, capacity: int) -> tuple[int, int, torch.dtype] | None:
        """(capacity, width, dtype) of the buffer for `model`'s paged n-gram table (`model.paged_table`, each
        token's rows of every hash head side by side), or None when the model reads no rows on the host."""
        table = model.paged_table
        if table is None:
            return None
        return max(1, capacity), model.hashing.num_heads * table.shape[1], table.dtype

    @staticmethod
    def device_bytes(model, capacity: int) -> int:
        """Device bytes of `model`'s buffer of `capacity` rows (0 without one): the budget counts them beside
        the activations, since the buffer is allocated after the budget is measured."""
        shape = RowsBuffer.shape_for(model, capacity)
        return 0 if shape is None else shape[0] * shape[1] * shape[2].itemsize

    def _alloc(self, capacity: int) -> None:
        # NOTE: a grown buffer has a new address: graphs keyed by it are captured again
        self.capacity = capacity
        self.device_buffer = torch.zeros(capacity, self.width, dtype=self.dtype, device=self.device)
        self.host = torch.zeros(capacity, self.width, dtype=self.dtype, pin_memory=self.device.type == "cuda")

    def load(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, width] (CPU) in the buffer's prefix; returns that prefix [n, width] on the device."""
        n = rows.shape[0]
        if self._copied is not None:
            self._copied.synchronize()  # (the last load's copy has read the staging; at once if none ran)
        if n > self.capacity:
            self._alloc(max(n, 2 * self.capacity))
        self.host[:n].copy_(rows)
        out = self.device_buffer[:n]
        out.copy_(self.host[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return out

    def gated_view(self, n: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """A gated decode step of n rows: (the device rows it reads [n, width], its `ForwardBatch.ngram_gate`).
        The step owes a `stage` from now on."""
        if n > self.capacity:
            raise ValueError(f"a gated step of {n} rows, the buffer holds {self.capacity}")
        self.owed = True
        return self.device_buffer[:n], functools.partial(self.gate, n)

    def gate(self, n: int) -> None:
        """On the current stream (a capture records it): wait until the host staged the step's rows, then copy
        the staging's first n rows in (rows past what was staged: the last step's, a graph's padding rows)."""
        self.flag.pass_when_set()
        self.device_buffer[:n].copy_(self.host[:n], non_blocking=True)

    def stage(self, rows: torch.Tensor | Callable[[], torch.Tensor]) -> None:
        """Stage a gated step's rows [m, width] (CPU; or a callable that reads them) and let its gate pass,
        whatever happens: the flag is set in a ``finally``. Waits for the last step's copy to have read the
        staging (`mark`) before it writes it."""
        try:
            if callable(rows):
                rows = rows()
            if self._copied is not None:
                self._copied.synchronize()
            self.host[: rows.shape[0]].copy_(rows)
        finally:
            self.owed = False
            self.flag.set()

    def release(self, count: int, timeout_s: float = 60.0) -> None:
        """Let `count` gated steps queued without a `stage` go, one after another, each with the rows staged
        last (a benchmark that replays a decode graph back to back): set the flag, wait for the device to
        pass and clear it, again. The device time then includes each pass's wait for the host (microseconds)."""
        for i in range(count):
            self.flag.set()
            deadline = time.monotonic() + timeout_s
            while self.flag.is_set:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gated step {i + 1} of {count} did not pass its gate in {timeout_s:g} s")

    def settle(self, timeout_s: float = 10.0) -> None:
        """After a gated decode step failed somewhere between its `gated_view` and its launch's end: leave the
        flag clear with nothing queued waiting on it, as a step that ran would have. A step that queued its
        pass but was never staged is let go first (its output is dropped with its error); then the device's
        queued work is waited for (a pass still waiting after a second, its set merged with another, is let go
        again), and a set that no pass consumed (a step staged before its launch, which then failed before its
        gate was queued) is taken back. Without this, every later step's gate would pass on the set before its
        own: each would read the staging before the host had written its rows. A stream that does not drain in
        `timeout_s` (a device lost or stuck on other work) leaves the flag as it is, with a log line: the step's
        own error says the rest."""
        if self.flag is None:
            return
        if self.owed:
            self.flag.set()
        self.owed = False
        if self.device.type == "cuda":
            try:
                done = torch.cuda.Event()
                done.record()  # (the stream the gates are queued on)
                start = since = time.monotonic()
                while not done.query():
                    if time.monotonic() - start > timeout_s:  # (e.g. a collective whose peer is gone: not ours)
                        raise TimeoutError(f"the stream did not drain in {timeout_s:g} s")
                    if time.monotonic() - since > 1.0:  # a pass still waits (a set the flag merged): let it go
                        self.flag.set()
                        since = time.monotonic()
                    time.sleep(1e-4)
            except Exception as e:  # noqa: BLE001 - a lost device or a stuck stream: the failure is said elsewhere
                log.warning("n-gram rows: the flag left as it is after a failed step (%s: %s)", type(e).__name__, e)
                return
        if self.flag.is_set:
            self.flag.clear()

    def mark(self) -> None:
        """After a gated step is queued (and staged): the event the next staging waits for."""
        if self._copied is not None:
            self._copied.record()
