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
    proc = subprocess.run([sys.executable, str(root / "tests" / "compile_kernels_sm90.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    report = proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    assert report.count("ok ") >= 18, report
