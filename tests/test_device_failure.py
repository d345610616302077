"""A CUDA error that loses the context (an illegal memory access, injected here on the CPU by a step
that raises torch's message for it): the server does not go on as if healthy. The step's requests
and every other request fail with a clear error, /health answers 503 with the reason, new requests
get 503, and `ft serve` exits non-zero for a supervisor to restart it. Errors that do not lose the
device (out of memory, a bug in one step) still fail only their step (tests/test_request_isolation.py)."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from ft.engine.core.device_fault import device_fault
from inproc_server import AUTH, DEMO, complete, demo_app
from server_proc import ServerProcess, wait_for

ILLEGAL_ADDRESS = "Triton Error [CUDA]: an illegal memory access was encountered"


@pytest.mark.parametrize("exc, lost", [
    (RuntimeError(ILLEGAL_ADDRESS), True),
    (RuntimeError("CUDA error: device-side assert triggered\nCUDA kernel errors might be reported later"), True),
    (RuntimeError("CUDA error: unspecified launch failure"), True),
    (RuntimeError("CUDA error: misaligned address"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("The size of tensor a (4) must match the size of tensor b (5)"), False),
    (FloatingPointError("injected"), False),
])
def test_device_fault_tells_a_lost_context_from_a_failed_step(exc, lost):
    reason = device_fault(exc)
    assert (reason is not None) == lost
    if lost:
        assert "\n" not in reason and reason.startswith("RuntimeError: ")


def test_device_fault_follows_the_chain():
    try:
        try:
            raise RuntimeError(ILLEGAL_ADDRESS)
        except RuntimeError as inner:
            raise ValueError("the step could not finish") from inner
    except ValueError as e:
        assert device_fault(e) == f"RuntimeError: {ILLEGAL_ADDRESS}"


def test_a_lost_device_fails_every_request_and_health_says_why():
    with demo_app() as (client, state):
        loop = state.loop
        assert complete(client, "hello", 4).status_code == 200
        calls = []
        loop.on_failure = lambda: calls.append(1)
        runner = loop.engine.runner

        def run(work):
            raise RuntimeError(ILLEGAL_ADDRESS)

        runner.run = run
        r = complete(client, "hello again", 4)
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert "the GPU failed" in message and "illegal memory access" in message, message
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "failed" and "illegal memory access" in health.json()["error"]
        # ft serve's hook (it exits non-zero), called on the engine thread once the streams have their
        # errors: this thread may read the 503 first (CI's 2 cores under load met that)
        wait_for(lambda: calls, "the device-lost hook", timeout=10)
        assert calls == [1]
        r = client.post("/v1/chat/completions", headers=AUTH, json={
            "model": DEMO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 503 and r.headers.get("retry-after")
        assert client.get("/metrics").status_code == 200  # the exposition still answers (no engine values)


FAULTY_SERVE = textwrap.dedent("""
    import sys
    import ft.engine.worker.model_runner as mr

    real = mr.ModelRunner.run
    def run(self, work):  # the first decode step loses the device
        if not work.is_prefill:
            raise RuntimeError({msg!r})
        return real(self, work)
    mr.ModelRunner.run = run
    from ft.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_ft_serve_exits_non_zero_after_the_device_is_lost(serve_checkpoint, tmp_path):
    script = tmp_path / "faulty_serve.py"
    script.write_text(FAULTY_SERVE.format(msg=ILLEGAL_ADDRESS))
    server = ServerProcess("--model", str(serve_checkpoint), "--device", "cpu", launcher=[sys.executable, str(script)])
    try:
        r = server.post("/v1/completions", json={"model": "ft-tiny", "prompt": "hello", "max_tokens": 8,
                                                 "ignore_eos": True})
        assert r.status_code == 503 and "the GPU failed" in r.json()["error"]["message"]
        code = wait_for(lambda: server.proc.poll() is not None and server.proc.returncode is not None
                        and (server.proc.returncode,), "ft serve to exit", timeout=60)[0]
    finally:
        server.stop()
    assert code != 0, server.output()
    out = server.output()
    assert "the GPU failed in an engine step" in out and "illegal memory access" in out, out
