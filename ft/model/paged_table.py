"""A table read from the checkpoint's files through the page cache: the n-gram table when the host lacks room for it.

Qwen3.8-Flash-Next's n-gram table is ~95 GiB in bf16, its NVFP4 experts ~63 GiB: more than the seed's 123 GB host
can pin. A step reads 16 rows of 320 bytes per token from it, so the table need not be in memory at all:
`PagedTable` maps the tensor (or its row-contiguous parts `<stem>.shard_{i}.weight`) straight from the
safetensors files, copy-on-write and with random-access advice (no read-ahead), and `gather` reads the rows a
step's tokens hash to on the host: the kernel keeps the rows that get read in its page cache, and gives
them back under pressure, so the table costs the memory its traffic earns and no more. The rows then travel
with the step's inputs (`ForwardBatch.ngram_rows`); the device cannot read a mapped file itself, which is
why a model with such a table computes its n-gram rows on the host, and why an overlapped decode step's rows are
read only once the step before it has sampled its tokens (the step itself is launched before that and waits for
its rows at the table's layer: `ft.engine.worker.buffers.RowsBuffer`, `ft.engine.worker.decode_launch`).
"""

from __future__ import annotations

import bisect
import json
import mmap
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ft.errors import CheckpointError

__all__ = ["ADVICE_LOOP_ROWS", "ADVISED_ROWS", "DTYPES", "PagedTable", "READERS"]

ADVISED_ROWS = 4096
"""Rows up to which a gather advises their pages first; more are copied by `READERS` threads."""
ADVICE_LOOP_ROWS = 64
"""Rows up to which `PagedTable.advice` finds its pages by a Python loop (numpy's fixed cost loses there)."""
READERS = 32
"""Threads that copy a large gather's rows (each waits on its own page faults: the disk sees that many reads
at once). 50,000 cold rows (bench/paged_table.py, this project's CPU machine): 0.74-0.79 s with 8, 0.50-0.55 s with
32, 0.51-0.55 s with 64."""
PAGE = mmap.PAGESIZE
_POOL: ThreadPoolExecutor | None = None


def _readers() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(READERS, thread_name_prefix="ft-table-read")
    return _POOL


DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
"""The safetensors dtypes a paged table may have."""


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> {dtype, shape, data_offsets}) and where its data begins."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


class PagedTable:
    """A [rows, width] table mapped from safetensors files, one or more row-contiguous parts in order.

    `gather(rows)` -> the rows' values [N, width] (a new CPU tensor); `shape`, `dtype`, `nbytes` (the bytes
    on disk, none of them held)."""

    def __init__(self, parts: list[torch.Tensor], maps: list[mmap.mmap],
                 where: list[tuple[mmap.mmap, int]] | None = None) -> None:
        self._parts, self._maps = parts, maps  # (the maps stay open while the parts' memory is theirs)
        self._where = where or []  # each part's map and the byte its data starts at (for the read advice)
        self.dtype = parts[0].dtype
        width = parts[0].shape[1]
        self.shape = (sum(p.shape[0] for p in parts), width)
        self.nbytes = sum(p.numel() * p.element_size() for p in parts)
        self._starts = torch.tensor([0] + [p.shape[0] for p in parts]).cumsum(0)
        self._windows: list[torch.Tensor] = []  # per map: [elements - width + 1, width], row i = elements i..
        self._part_map = self._part_base = None  # per part: its map's index, its first element there
        if self._where:
            # per part as numpy arrays (`advice`; the windows' selects take two of them): its first row, its map's
            # index and the byte its data starts at in that map
            at = {id(m): i for i, m in enumerate(self._maps)}
            self._advice = (self._starts.numpy(), np.array([at[id(m)] for m, _ in self._where], dtype=np.int64),
                            np.array([byte for _, byte in self._where], dtype=np.int64))
            self._advice_lists = tuple(a.tolist() for a in self._advice)  # (the loop's: Python ints read faster)
            self._index_maps(width)

    def _index_maps(self, width: int) -> None:
        """Each map as one view whose row i holds the `width` elements that begin at element i (strides (1, 1):
        overlapping rows, nothing copied), so that rows of any parts of one map are one `index_select`. A select
        a part cost ~10 us of small ops, and a token's 16 rows touch ~16 of the released table's 128 parts: with
        the spans read together too (`HostNgramReader.rows`), a decode step's rows 3.0 -> 0.27 ms at 8 sequences,
        21.7 -> 1.35 ms at 64 (bench/paged_table.py --decode, bench/RESULTS.md session 56)."""
        size = self.dtype.itemsize
        if any(byte % size for _, byte in self._where) or any(p.dtype != self.dtype for p in self._parts):
            return  # (a part off its dtype's alignment, or parts of mixed dtypes: each part is selected alone)
        for m in self._maps:
            flat = torch.frombuffer(m, dtype=self.dtype, count=len(m) // size)
            self._windows.append(flat.as_strided((flat.numel() - width + 1, width), (1, 1)))
        _, part_map, part_byte = self._advice
        self._part_map = torch.from_numpy(part_map)
        self._part_base = torch.from_numpy(part_byte // size)

    @classmethod
    def open(cls, files: list[tuple[Path, str]], shape: tuple[int, int]) -> "PagedTable":
        """The table whose parts are tensors `name` of files `path`, in row order ([(path, name), ...]);
        CheckpointError when they do not make `shape` or are not a float table."""
        maps: dict[Path, mmap.mmap] = {}
        parts, where = [], []
        for path, name in files:
            header, data = _header(path)
            entry = header.get(name)
            if entry is None or entry.get("dtype") not in DTYPES or len(entry.get("shape", ())) != 2:
                raise CheckpointError(f"tensor {name!r} in {path}: a paged table must be a 2-D bf16/fp16/fp32 tensor")
            if path not in maps:
                with open(path, "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # (copy-on-write: writable, file untouched)
                if hasattr(m, "madvise"):  # a step reads scattered rows: read-ahead would fetch what no one reads
                    m.madvise(mmap.MADV_RANDOM)
                maps[path] = m
            begin, end = entry["data_offsets"]
            dtype = DTYPES[entry["dtype"]]
            raw = torch.frombuffer(maps[path], dtype=torch.uint8, count=end - begin, offset=data + begin)
            parts.append(raw.view(dtype).view(entry["shape"]))
            where.append((maps[path], data + begin))
        table = cls(parts, list(maps.values()), where)
        if table.shape != tuple(shape):
            raise CheckpointError(f"the table {files[0][1]!r}: {len(parts)} part(s) make {list(table.shape)}, "
                                  f"expected {list(shape)}")
        return table

    def gather(self, rows: torch.Tensor, plain: bool = False) -> torch.Tensor:
        """rows [N] int64 (CPU) -> their values [N, width] in the table's dtype: each part reads its own rows
        (`plain`: one copy, no advice and no threads: bench/paged_table.py's baseline).

        Rows not in the page cache are read from disk: a page fault each, one at a time in a plain copy.
        A step's rows (up to `ADVISED_ROWS`) are first advised (MADV_WILLNEED: the kernel queues their
        reads together, and the copy then waits on reads in flight); more rows (a prefill chunk's) are
        copied by `READERS` threads, each faulting its own. On this project's CPU machine (a virtual disk,
        the page cache dropped; 320-byte rows of a 1.3 GB file; bench/paged_table.py): 16 cold rows 1.5-1.7
        -> 0.3-0.5 ms, 1,024 rows 55-56 -> ~10 ms, 50,000 rows 2.0-2.3 -> 0.50-0.55 s; cached rows cost ~1 us
        more each for the advice."""
        rows = rows.reshape(-1).to(torch.int64)
        if plain:
            return self._gather(rows)
        if rows.numel() > ADVISED_ROWS:
            pieces = rows.chunk(READERS)
            return torch.cat(list(_readers().map(self._gather, pieces)))
        self._advise(rows)
        return self._gather(rows)

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        if len(self._parts) == 1:
            return self._parts[0].index_select(0, rows)
        if self._windows:  # each row's first element in its map: one select a map the rows touch
            part = torch.searchsorted(self._starts, rows, right=True) - 1
            first = self._part_base[part] + (rows - self._starts[part]) * self.shape[1]
            if len(self._windows) == 1:
                return self._windows[0].index_select(0, first)
            where = self._part_map[part]
            out = torch.empty(rows.numel(), self.shape[1], dtype=self.dtype)
            for k in where.unique().tolist():
                at = (where == k).nonzero().reshape(-1)
                out[at] = self._windows[k].index_select(0, first[at])
            return out
        out = torch.empty(rows.numel(), self.shape[1], dtype=self.dtype)
        part = torch.searchsorted(self._starts, rows, right=True) - 1
        for p in part.unique().tolist():
            at = (part == p).nonzero().reshape(-1)
            out[at] = self._parts[p].index_select(0, rows[at] - self._starts[p])
        return out

    def _advise(self, rows: torch.Tensor) -> None:
        """MADV_WILLNEED on the pages of `rows` (`advice`), where the maps take advice."""
        if hasattr(mmap, "MADV_WILLNEED"):
            for m, at, length in self.advice(rows):
                self._maps[m].madvise(mmap.MADV_WILLNEED, at, length)

    def advice(self, rows: torch.Tensor) -> list[tuple[int, int, int]]:
        """The read advice for `rows` [N] int64: (map index, page-aligned byte offset, length) for each page that a
        row begins in, once, in the order of the rows, its length reaching the end of the first such row; [] without
        maps. Up to `ADVICE_LOOP_ROWS` rows by a Python loop, more with numpy (the decode step's host read, `python3
        bench/paged_table.py --decode`, this project's CPU machine, 1 / 8 / 32 / 64 sequences: 0.075 / 0.165 / 0.469 /
        0.897 ms with the loop alone, 0.092 / 0.156 / 0.365 / 0.664 with numpy alone, 0.071 / 0.157 / 0.365 / 0.682
        so; at 32 the advice 0.33 -> 0.19 ms, its system calls alone 0.18)."""
        if not self._where or not rows.numel():
            return []
        starts, part_map, part_byte = self._advice
        row_bytes = self.shape[1] * self.dtype.itemsize
        if rows.numel() <= ADVICE_LOOP_ROWS:
            out, seen = [], set()
            first_rows, maps_of, bytes_of = self._advice_lists
            for r in rows.reshape(-1).tolist():
                p = bisect.bisect_right(first_rows, r) - 1
                m, lo = maps_of[p], bytes_of[p] + (r - first_rows[p]) * row_bytes
                page = lo - lo % PAGE
                if (m, page) not in seen:
                    seen.add((m, page))
                    out.append((m, page, lo + row_bytes - page))
            return out
        r = rows.reshape(-1).to(torch.int64).numpy()
        part = np.searchsorted(starts, r, side="right") - 1
        lo = part_byte[part] + (r - starts[part]) * row_bytes
        page = lo - lo % PAGE
        maps = part_map[part]
        _, first = np.unique(maps * (1 << 48) + page, return_index=True)  # (a map's bytes stay under 2**48)
        first.sort()  # (the rows' order, as the loop gives it)
        return list(zip(maps[first].tolist(), page[first].tolist(), (lo + row_bytes - page)[first].tolist()))
