"""Every Triton kernel of the CUDA path compiles for Hopper (sm_90) with its default configurations,
on a machine without a GPU (tests/compile_kernels_sm90.py, in subprocesses without the interpreter).

The compile is ~100 s of one core's ptxas and Python. Once the test is collected, `conftest.py`
starts it in the background on the cores the rest of the suite leaves idle (`start_compile_jobs`),
and the test waits for its report; run alone, the test starts it itself, one process per core (under
pytest-xdist, one process, on the core its worker leaves idle while the test waits)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
_jobs: list[tuple[subprocess.Popen, object]] | None = None  # (process, its output file) per shard


def _has_nvidia_backend() -> bool:
    from triton.backends import backends

    return "nvidia" in backends


def start_compile_jobs(shards: int) -> None:
    """Start the compile cases in `shards` background processes (every shards-th case each), once."""
    global _jobs
    if _jobs is not None or not _has_nvidia_backend():
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    script = str(ROOT / "tests" / "compile_kernels_sm90.py")
    _jobs = []
    for i in range(shards):
        out = tempfile.TemporaryFile(mode="w+")  # NOTE: a file, not a pipe: nothing reads it until the test
        _jobs.append((subprocess.Popen([sys.executable, script, "--shard", f"{i}/{shards}"], env=env, stdout=out,
                                       stderr=subprocess.STDOUT, text=True), out))


def stop_compile_jobs() -> None:
    """Kill what is still running (the session ends without the test having waited for it)."""
    for proc, out in _jobs or []:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()


def test_kernels_compile_for_sm90():
    if not _has_nvidia_backend():
        pytest.skip("this triton has no NVIDIA backend")
    # run alone: started here, a process per core; under pytest-xdist one (the other workers hold the rest)
    start_compile_jobs(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(4, os.cpu_count() or 1)))
    reports = []
    for proc, out in _jobs:
        proc.wait(timeout=600)
        out.seek(0)
        reports.append((proc.returncode, out.read()[-20000:]))
    report = "".join(r for _, r in reports)
    assert all(code == 0 for code, _ in reports), report
    assert report.count("ok ") >= 18 and "FAILED" not in report, report
