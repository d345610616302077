"""Concurrent streaming clients while the caches are resized live and the ladder moves: no request
is lost, and every text equals the one the same request gets alone (greedy)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.server_proc import HTTP_TIMEOUT, SERVE_MODEL, ServerProcess

pytestmark = pytest.mark.slow

CLIENTS = 8
NEW = 24


def _stream(url: str, prompt: list[int]) -> tuple[str, str | None]:
    text, finish = [], None
    with httpx.stream("POST", url + "/v1/completions", timeout=HTTP_TIMEOUT, json={
        "model": SERVE_MODEL, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
        "stream": True,
    }) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            assert "error" not in event, event
            text.append(event["choices"][0]["text"])
            finish = event["choices"][0]["finish_reason"] or finish
    return "".join(text), finish


def test_no_request_lost_under_live_resizes_and_ladder_moves(serve_checkpoint):
    srv = ServerProcess("--model", str(serve_checkpoint), "--max-running-requests", "4", "--enable-kv-ladder",
                        "--ladder-step-size", "256", "--max-seq-len-override", "2048", "--mamba-cache-size", "8")
    try:
        prompts = [[30 + (7 * i + j) % 250 for j in range(20 + 9 * i)] for i in range(CLIENTS)]
        alone = [_stream(srv.url, p) for p in prompts]
        assert all(f == "length" for _, f in alone)
        results: list = [None] * CLIENTS
        statuses: list[int] = []

        def client(i: int) -> None:
            results[i] = _stream(srv.url, prompts[i])

        def admin() -> None:
            for body in ({"rung": 2}, {"rung": 0}, {"rung": "up"}):
                statuses.append(srv.post("/admin/ladder", json=body).status_code)
            g = srv.get("/admin/cache").json()["pools"]
            for moe in (g["moe"]["min"], g["moe"]["size"]):
                statuses.append(srv.post("/admin/cache", json={"moe": moe, "wait_s": 60}).status_code)
            statuses.append(srv.post("/admin/cache", json={"mamba": 6, "wait_s": 60}).status_code)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)] + [threading.Thread(target=admin)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HTTP_TIMEOUT.read)
        assert results == alone
        assert statuses and all(s in (200, 422) for s in statuses), statuses  # done, or refused outright
        assert 200 in statuses
        hist = srv.get("/admin/cache/history").json()["entries"]
        assert any(h["status"] == "ok" and h["trigger"] != "startup" for h in hist)
    finally:
        srv.stop()
