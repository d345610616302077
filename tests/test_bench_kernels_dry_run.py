"""`bench/kernels_nvfp4.py --dry-run`: the kernel benchmark's script on the CPU (Triton's interpreter,
shapes / 16, fp16 activations), with its correctness checks against the references at decode sizes
that take each path: the GEMV (M = 1), the 16-row tile (M = 8) and the 32-row tiles (M = 32)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_kernel_benchmark_dry_run_passes_its_correctness_checks():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "bench/kernels_nvfp4.py", "--dry-run", "--only", "decode", "--decode-m", "1,8,32"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "all correctness checks passed" in r.stdout
