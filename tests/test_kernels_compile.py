"""Every Triton kernel of the CUDA path compiles for Hopper (sm_90) with its default configurations,
on a machine without a GPU (tests/compile_kernels_sm90.py, in a subprocess without the interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_kernels_compile_for_sm90():
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton has no NVIDIA backend")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    # NOTE: the cases in one process per core (ptxas is most of the time; CI has two cores)
    n = max(1, min(4, os.cpu_count() or 1))
    script = str(root / "tests" / "compile_kernels_sm90.py")
    procs = [subprocess.Popen([sys.executable, script, "--shard", f"{i}/{n}"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(n)]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        reports.append((proc.returncode, out + err[-2000:]))
    report = "".join(r for _, r in reports)
    assert all(code == 0 for code, _ in reports), report
    assert report.count("ok ") >= 18 and "FAILED" not in report, report
