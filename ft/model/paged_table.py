"""A table read from the checkpoint's files through the page cache: the n-gram table when the host lacks room for it.

Qwen3.8-Flash-Next's n-gram table is ~95 GiB in bf16, its NVFP4 experts ~63 GiB: more than the seed's 123 GB host
can pin. A step reads 16 rows of 320 bytes per token from it, so the table need not be in memory at all:
`PagedTable` maps the tensor (or its row-contiguous parts `<stem>.shard_{i}.weight`) straight from the
safetensors files, copy-on-write and with random-access advice (no read-ahead), and `gather` reads the rows a
step's tokens hash to on the host: the kernel keeps the rows that get read in its page cache, and gives
them back under pressure, so the table costs the memory its traffic earns and no more. The rows then travel
with the step's inputs (`ForwardBatch.ngram_rows`); the device cannot read a mapped file itself, which is
why a model with such a table computes its n-gram rows on the host and its decode steps are not overlapped
(the tokens must be known before the step is queued).
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

from ft.errors import CheckpointError

__all__ = ["PagedTable"]

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

    def __init__(self, parts: list[torch.Tensor], maps: list[mmap.mmap]) -> None:
        self._parts, self._maps = parts, maps  # (the maps stay open while the parts' memory is theirs)
        self.dtype = parts[0].dtype
        width = parts[0].shape[1]
        self.shape = (sum(p.shape[0] for p in parts), width)
        self.nbytes = sum(p.numel() * p.element_size() for p in parts)
        self._starts = torch.tensor([0] + [p.shape[0] for p in parts]).cumsum(0)

    @classmethod
    def open(cls, files: list[tuple[Path, str]], shape: tuple[int, int]) -> "PagedTable":
        """The table whose parts are tensors `name` of files `path`, in row order ([(path, name), ...]);
        CheckpointError when they do not make `shape` or are not a float table."""
        maps: dict[Path, mmap.mmap] = {}
        parts = []
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
        table = cls(parts, list(maps.values()))
        if table.shape != tuple(shape):
            raise CheckpointError(f"the table {files[0][1]!r}: {len(parts)} part(s) make {list(table.shape)}, "
                                  f"expected {list(shape)}")
        return table

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N] int64 (CPU) -> their values [N, width] in the table's dtype: each part reads its own rows."""
        rows = rows.reshape(-1).to(torch.int64)
        if len(self._parts) == 1:
            return self._parts[0].index_select(0, rows)
        out = torch.empty(rows.numel(), self.shape[1], dtype=self.dtype)
        part = torch.searchsorted(self._starts, rows, right=True) - 1
        for p in part.unique().tolist():
            at = (part == p).nonzero().reshape(-1)
            out[at] = self._parts[p].index_select(0, rows[at] - self._starts[p])
        return out
