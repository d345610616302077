"""The n-gram table read from disk (`ft.model.paged_table.PagedTable`): a gather's time with its rows out of the
page cache (cold) and in it (warm), for a decode step's rows and a prefill chunk's, with the gather's read
advice and reader threads and without them (a plain copy: one page fault at a time). Table last.

Usage: ``python3 bench/paged_table.py [--rows 16,1024,50000] [--table-rows 4000000] [--dir /tmp]``;
``--decode [--batches 1,8,32,64]``: a decode step's rows through `ft.model.ngram_reader.HostNgramReader` instead
(a sequence's new token each, hashed and gathered; the page cache warm), from a table stored in 128 parts as
the released checkpoint's is, the sequences' spans read one at a time and read together. Dropping
the page cache needs root (``/proc/sys/vm/drop_caches``); without it the "cold" column is whatever the cache
holds, and the script says so. The table (bf16 rows of 160, the released table's width; 1.3 GB at the
default size) is written once to --dir and removed at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import struct
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ft.model.paged_table import PagedTable  # noqa: E402

WIDTH = 160


def write_table(path: Path, rows: int) -> None:
    header = json.dumps({"t": {"dtype": "BF16", "shape": [rows, WIDTH], "data_offsets": [0, rows * WIDTH * 2]}}).encode()
    header += b" " * (-len(header) % 8)
    g = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        block = 1 << 18
        for a in range(0, rows, block):
            f.write(torch.randn((min(block, rows - a), WIDTH), generator=g).to(torch.bfloat16)
                    .view(torch.uint8).numpy().tobytes())


def write_parts(path: Path, rows: int, parts: int) -> list[str]:
    """A [rows, WIDTH] bf16 table in `parts` row-contiguous tensors `t.shard_{i}.weight` of one file; their names."""
    per = rows // parts
    names = [f"t.shard_{i}.weight" for i in range(parts)]
    header = json.dumps({n: {"dtype": "BF16", "shape": [per, WIDTH], "data_offsets": [i * per * WIDTH * 2,
                                                                                      (i + 1) * per * WIDTH * 2]}
                         for i, n in enumerate(names)}).encode()
    header += b" " * (-len(header) % 8)
    g = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for _ in names:
            f.write(torch.randn((per, WIDTH), generator=g).to(torch.bfloat16).view(torch.uint8).numpy().tobytes())
    return names


def decode_steps(args) -> None:
    """A decode step's rows (`HostNgramReader.rows`, each sequence one new token), span by span and together."""
    import random

    from ft.model.layers.engram import EngramHashing
    from ft.model.ngram_reader import HostNgramReader

    parts = 128
    hs = EngramHashing(vocab_size_base=args.table_rows // 16, divisible_by=parts, eos_token_id=1)
    path = Path(args.dir) / "ft-bench-paged-table-parts.safetensors"
    names = write_parts(path, hs.padded_rows, parts)
    out = []
    try:
        reader = HostNgramReader(hs, PagedTable.open([(path, n) for n in names], (hs.padded_rows, WIDTH)))
        rng = random.Random(0)
        for b in (int(x) for x in args.batches.split(",")):
            spans = [([rng.randrange(100_000) for _ in range(hs.context_len)], [rng.randrange(100_000)])
                     for _ in range(b)]
            times = {}
            for form, step in (("span by span", lambda: [reader.rows([s]) for s in spans]),
                               ("together", lambda: reader.rows(spans))):
                for _ in range(3):
                    step()  # (the rows into the page cache, torch's first calls)
                t0 = time.perf_counter()
                for _ in range(50):
                    step()
                times[form] = (time.perf_counter() - t0) / 50 * 1e3
            out.append((b, times["span by span"], times["together"]))
            print(f"batch {b}: span by span {times['span by span']:.3f} ms, together {times['together']:.3f} ms",
                  flush=True)
    finally:
        path.unlink(missing_ok=True)
    print(f"\ntable {hs.padded_rows * WIDTH * 2 / 1e9:.2f} GB in {parts} parts ({hs.padded_rows:,} rows of {WIDTH} "
          f"bf16), page cache warm; {hs.num_heads} rows a token")
    print("| decoding sequences | rows | span by span ms | together ms |\n|---:|---:|---:|---:|")
    for b, one, together in out:
        print(f"| {b} | {b * hs.num_heads:,} | {one:.3f} | {together:.3f} |")


def drop_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,1024,50000", help="rows a gather reads (a token reads 16)")
    ap.add_argument("--table-rows", type=int, default=4_000_000)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--decode", action="store_true", help="a decode step's rows through the host reader (above)")
    ap.add_argument("--batches", default="1,8,32,64", help="--decode: sequences a step")
    args = ap.parse_args()
    if args.decode:
        decode_steps(args)
        return
    path = Path(args.dir) / "ft-bench-paged-table.safetensors"
    write_table(path, args.table_rows)
    out = []
    try:
        torch.zeros(8, WIDTH).index_select(0, torch.tensor([1, 2]))  # (torch's first call, outside the rows)
        dropped = True
        for n in (int(r) for r in args.rows.split(",")):
            rows = torch.randint(0, args.table_rows, (n,), generator=torch.Generator().manual_seed(n + len(out)))
            for form in ("plain copy", "advised / threads"):
                # a fresh map each time: the kernel keeps a mapped page cached through drop_caches
                dropped &= drop_cache()
                table = PagedTable.open([(path, "t")], (args.table_rows, WIDTH))
                plain = form == "plain copy"

                def gather(rows):
                    return table.gather(rows, plain=plain)

                t0 = time.perf_counter()
                a = gather(rows)
                cold = time.perf_counter() - t0
                t0 = time.perf_counter()
                b = gather(rows)
                warm = time.perf_counter() - t0
                assert torch.equal(a, b)
                del table, gather
                gc.collect()
                out.append((n, form, cold * 1e3, warm * 1e3))
                print(f"{n} rows, {form}: cold {cold * 1e3:.2f} ms, warm {warm * 1e3:.3f} ms", flush=True)
    finally:
        path.unlink(missing_ok=True)
    size = args.table_rows * WIDTH * 2
    print(f"\ntable {size / 1e9:.2f} GB ({args.table_rows:,} rows of {WIDTH} bf16), page cache "
          + ("dropped before each cold gather" if dropped else "NOT dropped (not root): 'cold' is not cold"))
    print("| rows | gather | cold ms | warm ms |\n|---:|---|---:|---:|")
    for n, form, cold, warm in out:
        print(f"| {n:,} | {form} | {cold:.2f} | {warm:.3f} |")


if __name__ == "__main__":
    main()
