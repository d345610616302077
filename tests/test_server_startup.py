"""Startup: in-process, /health is 503 while the engine starts, and a failed start (the engine's
start is held by an event, never by a timer); as a process, user errors are one line before
anything binds, and "ready on" comes only once /health answers 200."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from server_proc import WAIT_S, free_port, wait_for

from ft.server.app import ServerState, create_app
from ft.server.engine_loop import EngineLoop


class _FakeEngine:
    has_work = False
    context_limit = 16
    cache = SimpleNamespace(degraded=None)  # /health reads why the server is degraded, if it is


def _get(app, path):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get(path)

    return asyncio.run(go())


def test_health_is_503_until_the_engine_is_up():
    release = threading.Event()

    def build():
        release.wait()
        return _FakeEngine()

    loop = EngineLoop(build)
    app = create_app(ServerState(loop, "m"), start_loop=False)
    loop.start()
    try:
        r = _get(app, "/health")
        assert r.status_code == 503 and r.json()["status"] == "starting"
        assert _get(app, "/v1/models").status_code == 503
    finally:
        release.set()
    assert loop.ready.wait(WAIT_S)
    assert _get(app, "/health").status_code == 200
    loop.stop()


def test_failed_start_is_reported():
    def build():
        raise ValueError("no config.json at /nowhere")

    loop = EngineLoop(build)
    app = create_app(ServerState(loop, "m"), start_loop=False)
    loop.start()
    assert loop.ready.wait(WAIT_S)
    r = _get(app, "/health")
    assert r.status_code == 503 and "no config.json" in r.json()["error"]


# ------------------------------------------------------- `ft serve` as a process: errors, readiness
def _serve(*args: str, timeout: float = WAIT_S) -> subprocess.CompletedProcess:
    """`ft serve ARGS` run to its exit (user errors end it at once)."""
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "ft.cli", "serve", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


def _user_error_cases(tmp: Path, ckpt: Path) -> dict[str, tuple[list[str], str]]:
    llama = tmp / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    no_tok = tmp / "no-tokenizer"
    no_tok.mkdir()
    (no_tok / "config.json").write_text((ckpt / "config.json").read_text())
    for f in ckpt.glob("*.safetensors"):
        (no_tok / f.name).symlink_to(f)
    no_weights = tmp / "no-weights"
    no_weights.mkdir()
    for f in ckpt.iterdir():
        if not f.name.endswith(".safetensors"):
            (no_weights / f.name).write_bytes(f.read_bytes())
    import torch

    gpu = {} if torch.cuda.is_available() else {
        "--device cuda without a GPU": ([str(ckpt), "--device", "cuda"], "--device cuda: no CUDA GPU is available")}
    return {
        **gpu,
        "no weights": ([str(no_weights)], f"no safetensors weights in {no_weights}"),
        "missing model directory": ([str(tmp / "nope")], f"model directory {tmp / 'nope'} does not exist"),
        "unsupported architecture": ([str(llama)], "unsupported architecture ['LlamaForCausalLM']"),
        "bad --chat-template path": ([str(ckpt), "--chat-template", str(tmp / "t.jinja")], "--chat-template: no file"),
        "no tokenizer.json": ([str(no_tok)], "tokenizer.json not found"),
        "missing --tokenizer directory": ([str(ckpt), "--tokenizer", str(tmp / "tok")], "--tokenizer: directory"),
        "--memory-ratio out of range": ([str(ckpt), "--memory-ratio", "2"], "--memory-ratio must be in (0, 1], got 2.0"),
        "--max-model-len below one": ([str(ckpt), "--max-model-len", "-5"], "--max-model-len must be >= 1"),
    }


def test_user_errors_are_one_line_before_anything_binds(serve_checkpoint, tmp_path):
    """Each user error: a non-zero exit and one line on stderr. They are found before the port is
    bound: given a port that is in use, the error is still the model's, not the port's."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for name, (args, message) in _user_error_cases(tmp_path, serve_checkpoint).items():
            p = _serve(*args, "--port", str(port))
            lines = p.stderr.strip().splitlines()
            assert p.returncode != 0 and len(lines) == 1, f"{name}: {p.stderr}"
            assert lines[0].startswith("ft serve: error: ") and message in lines[0], f"{name}: {lines[0]}"
            assert p.stdout == "", name


def test_port_in_use_is_one_line_before_the_engine_loads(serve_checkpoint):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = _serve(str(serve_checkpoint), "--port", str(port))
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and lines == [f"ft serve: error: port {port} is in use on 127.0.0.1 (another server? "
                                           "choose one with --port)"], p.stderr


def test_ready_line_comes_when_health_is_ok_and_polling_stays_out_of_the_access_log(serve_checkpoint, tmp_path):
    """"ready on URL" is written once the engine is up: /health answers 200 to whoever reads it.
    A "listening" line, if any, comes before it; uvicorn's "Application startup complete." and
    "Uvicorn running on" (which would read as ready) are not there; GET /health is not in the
    access log, GET /v1/models is."""
    port = free_port()
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ft.cli", "serve", str(serve_checkpoint), "--port", str(port),
                                 "--num-tokens", "1024", "--log-level", "info"], stdout=out, stderr=subprocess.STDOUT,
                                text=True, env=env)
    try:
        def ready():
            assert proc.poll() is None, (tmp_path / "log").read_text()
            return f"  ready on http://127.0.0.1:{port}" in (tmp_path / "log").read_text()

        wait_for(ready, "the ready line", poll=0.01)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=WAIT_S).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=WAIT_S).status_code == 200
        wait_for(lambda: "/v1/models" in (tmp_path / "log").read_text(), "the access log line")
    finally:
        proc.terminate()
        proc.wait(WAIT_S)
    text = (tmp_path / "log").read_text()
    if "listening on" in text:  # said only while the engine still loads (this small one may be up first)
        assert f"ft serve: listening on http://127.0.0.1:{port}; /health answers 503" in text
        assert text.index("listening on") < text.index("ready on")
    assert "Application startup complete" not in text and "Uvicorn running" not in text
    assert '"GET /v1/models HTTP/1.1" 200' in text and "/health" not in text.split("ready on")[1]


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_out_of_range_is_one_line(port):
    p = _serve("demo", "--port", port)
    assert p.returncode != 0 and p.stderr.strip().splitlines() == [
        f"ft serve: error: --port must be in 0..65535 (0: any free port), got {port}"], p.stderr
