"""A paged n-gram table's rows for a step's tokens, read on the host (`ft.model.paged_table`).

With the table mapped from disk the device cannot gather its rows: the host hashes each step's new tokens (the
same `EngramHashing.rows_of_windows` the device's kernels are tested against) and reads their rows into the
step's inputs (`ForwardBatch.ngram_rows`). A long prompt's next chunk is read ahead (`read_ahead`) on a thread
while the device computes this one, so that its page faults (cold rows come from disk) overlap the chunk
before it instead of delaying the next step; a step whose span was read ahead takes those rows.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ft.model.layers.engram import EngramHashing
from ft.model.paged_table import PagedTable

__all__ = ["HostNgramReader", "Span"]

Span = tuple[list[int], list[int]]
"""(the `context_len` ids before a sequence's new tokens, the EOS id where there are none; the new ids)."""

READ_AHEAD_SPANS = 8
"""Spans read ahead and not yet taken that a reader keeps (the oldest go first)."""


class HostNgramReader:
    """`rows(spans)` -> [T, heads * width] in the table's dtype (CPU), T the spans' new ids in order;
    `read_ahead(spans)`: start reading those spans' rows now (`taken` counts the spans a step took so).
    `rows_read`: the table rows `rows` returned (read then or ahead); `read_s`: seconds the caller spent in `rows`
    (its reads and its waits for reads ahead: the time a step's inputs waited on the table; `/metrics`)."""

    def __init__(self, hashing: EngramHashing, table: PagedTable) -> None:
        self.hashing, self.table = hashing, table
        self.width = hashing.num_heads * table.shape[1]
        self._ahead: OrderedDict[tuple, Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None  # (its own thread: a read ahead waits on the table's readers)
        self.taken = 0
        self.rows_read = 0
        self.read_s = 0.0

    @property
    def waiting(self) -> int:
        """Spans read ahead that no step took yet."""
        return len(self._ahead)

    def _table_rows(self, spans: list[Span]) -> torch.Tensor:
        """The spans' table row ids [T, heads] int64."""
        c, n = self.hashing.context_len, self.hashing.ngram_size
        windows = []  # [T, n]: each new token and the ones before it
        for ctx, ids in spans:
            ext = list(ctx) + list(ids)
            windows.extend([ext[c + t - s] for s in range(n)] for t in range(len(ids)))
        if not windows:
            return torch.empty(0, self.hashing.num_heads, dtype=torch.int64)
        return self.hashing.rows_of_windows(torch.tensor(windows, dtype=torch.int64))

    def _read(self, spans: list[Span]) -> torch.Tensor:
        rows = self._table_rows(spans)
        return self.table.gather(rows).reshape(rows.shape[0], self.width)

    def rows(self, spans: list[Span]) -> torch.Tensor:
        start = time.perf_counter()
        try:
            out = self._rows(spans)
        finally:
            self.read_s += time.perf_counter() - start
        self.rows_read += out.shape[0] * self.hashing.num_heads
        return out

    def _rows(self, spans: list[Span]) -> torch.Tensor:
        # the spans not read ahead are read together: one hash and one gather (a decode step's rows: a span a
        # sequence; span by span, 64 of them took 9.0 ms a step against 1.35, bench/paged_table.py --decode)
        out: list = []  # per piece, in order: rows (a tensor), a read ahead (a Future) or an index into `unread`
        unread: list[Span] = []
        for span in spans:
            rest = self._take_ahead(span, out)
            if rest is not None and rest[1]:
                out.append(len(unread))
                unread.append(rest)
        if not spans:
            return torch.empty(0, self.width, dtype=self.table.dtype)
        read = self._read(unread) if unread else None
        if unread and len(unread) == len(out):  # (nothing read ahead: a decode step's spans, read in order)
            return read
        at = [0]
        for _, ids in unread:
            at.append(at[-1] + len(ids))
        return torch.cat([read[at[x]: at[x + 1]] if isinstance(x, int) else x.result() if isinstance(x, Future) else x
                          for x in out])

    def _take_ahead(self, span: Span, out: list) -> Span | None:
        """Append to `out` what was read ahead of `span` and return the part of it still to read (None: none).
        A read ahead assumed the next chunk as long as the one before; a step may cut it otherwise (a mixed
        step's token budget): its rows are taken as far as they match, the rest of a longer one is kept for the
        step that asks for it, and only the part never read ahead is read now."""
        ahead = self._ahead.pop(_key(span), None)
        if ahead is not None:
            self.taken += 1
            out.append(ahead)
            return None
        ctx, ids = tuple(span[0]), tuple(span[1])
        for key in list(self._ahead):  # (at most READ_AHEAD_SPANS)
            n = min(len(key[1]), len(ids))
            if key[0] != ctx or not n or key[1][:n] != ids[:n]:
                continue
            rows = self._ahead.pop(key).result()
            self.taken += 1
            out.append(rows[:n])
            c = self.hashing.context_len
            after = (ctx + ids[:n])[len(ctx) + n - c:]  # the context of what follows the n ids
            if len(key[1]) > n:
                kept: Future = Future()
                kept.set_result(rows[n:])
                self._ahead[(after, key[1][n:])] = kept
            return (list(after), list(ids[n:])) if len(ids) > n else None
        return span

    def read_ahead(self, spans: list[Span]) -> None:
        for span in spans:
            key = _key(span)
            if not span[1] or key in self._ahead:
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ft-ngram-ahead")
            self._ahead[key] = self._pool.submit(self._read, [span])
            while len(self._ahead) > READ_AHEAD_SPANS:
                self._ahead.popitem(last=False)


def _key(span: Span) -> tuple:
    return tuple(span[0]), tuple(span[1])
