"""Start a real `ft serve` subprocess on a free loopback port and wait until it serves; the small
checkpoint it serves in tests that do not need the demo model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import httpx

# Bounds for conditions that are polled: generous, so that a loaded machine is slow, not failing.
WAIT_S = 300.0
HTTP_TIMEOUT = httpx.Timeout(WAIT_S + 60.0, connect=10.0)  # outlives any wait_s the tests send


# The demo's layout (hybrid layers, routed and shared experts, its tokenizer, an 8192-token context)
# at a fraction of its size, in unquantized bfloat16: decode is ~10x cheaper than the demo's.
SERVE_MODEL = "ft-tiny"
SERVE_OVERRIDES = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, full_attention_interval=2,
    layer_types=["linear_attention", "full_attention"] * 2, head_dim=16, linear_key_head_dim=16,
    linear_value_head_dim=16, num_experts=16, moe_intermediate_size=32, shared_expert_intermediate_size=64,
)


def write_serve_checkpoint(parent: Path) -> Path:
    """`parent/SERVE_MODEL`, a checkpoint folder that `ft serve` serves under the id SERVE_MODEL."""
    from safetensors.torch import save_file

    from ft.tools.demo import DEMO_CONFIG, build_weights, write_tokenizer_files

    cfg = {**DEMO_CONFIG, **SERVE_OVERRIDES}
    path = write_tokenizer_files(Path(parent) / SERVE_MODEL)
    save_file(build_weights(cfg, seed=1), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable[[], object], what: str, timeout: float = WAIT_S, poll: float = 0.05):
    """Poll `cond` until it returns something truthy (returned); AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(poll)
    return value


class ServerProcess:
    """`ft serve ARGS` on a free port, healthy on return. One torch thread, like the tests (conftest.py);
    the output goes to a file (a pipe nobody reads would block the server once full)."""

    def __init__(self, *args: str, timeout: float = WAIT_S, launcher: list[str] | None = None) -> None:
        """`launcher`: the command that takes ft's arguments (default `python -m ft.cli`; a test's
        wrapper script that patches something first)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [*(launcher or [sys.executable, "-m", "ft.cli"]), "serve", "--port", str(self.port),
               "--log-level", "warning", *args]
        env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            wait_for(self._healthy, "ft serve to become healthy", timeout, poll=0.2)
        except BaseException:
            self.stop()
            raise

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"ft serve exited {self.proc.returncode}:\n{self.output()}")
        try:
            return httpx.get(self.url + "/health", timeout=HTTP_TIMEOUT).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, sig=None) -> int:
        """Terminate (or send `sig`) and wait for the exit; killed only if it is still up after WAIT_S."""
        if self.proc.poll() is None:
            self.proc.terminate() if sig is None else self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=HTTP_TIMEOUT, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self.url + path, timeout=HTTP_TIMEOUT, **kw)
