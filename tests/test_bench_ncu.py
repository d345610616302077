"""bench/ncu_kernels.py's reader of Nsight Compute raw CSVs (the drivers need a GPU)."""

from __future__ import annotations

import csv
import io

import pytest

from bench.ncu_kernels import METRICS, summary_rows


def _csv(rows: list[dict]) -> list[str]:
    header = ["ID", "Kernel Name", *METRICS]
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    w.writerow(header)
    w.writerow(["", "", "ns", "%", "%", "register/thread", "%", "", ""])  # ncu's units row
    for i, r in enumerate(rows):
        w.writerow([str(i), r["name"], r["ns"], r["dram"], r["sm"], r["regs"], r["occ"], r["grid"], "128"])
    return ["==PROF== Connected to process 1", "some program output", *out.getvalue().splitlines()]


def test_summary_sums_by_kernel_weighting_rates_by_duration():
    lines = _csv([
        {"name": "_moe", "ns": "1,000", "dram": "80", "sm": "50", "regs": "72", "occ": "40", "grid": "7,040"},
        {"name": "_moe", "ns": "3,000", "dram": "40", "sm": "70", "regs": "72", "occ": "20", "grid": "7,040"},
        {"name": "_dot", "ns": "2,000", "dram": "25", "sm": "60", "regs": "140", "occ": "15", "grid": "512"},
    ])
    rows = summary_rows(lines)
    assert [r[0] for r in rows] == ["_moe", "_dot"]  # the longest total first
    name, n, us, share, dram, sm, regs, occ, grid = rows[0]
    assert (n, us, regs, grid) == (2, 4.0, 72, "7,040 x 128")
    assert share == pytest.approx(4 / 6)
    assert dram == pytest.approx((80 * 1 + 40 * 3) / 4) and sm == pytest.approx((50 + 210) / 4)
    assert occ == pytest.approx((40 + 60) / 4)
    assert rows[1][1:4] == (1, 2.0, pytest.approx(2 / 6))


def test_summary_says_what_is_missing():
    with pytest.raises(ValueError, match="no ncu raw CSV header"):
        summary_rows(["nothing", "here"])
    with pytest.raises(ValueError, match="lacks gpu__dram_throughput.*launch__grid_size"):
        summary_rows(['"ID","Kernel Name","gpu__time_duration.sum"', '"","",""'])
