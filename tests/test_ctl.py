"""`ft ctl`: the text views, the admin client against an in-process fake server, exit codes,
and that it never loads torch."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

from ft.ctl import cli
from ft.ctl.client import AdminClient, CtlError
from ft.ctl.format import (format_cache, format_change, format_geometry, format_history, format_plan,
                           format_range, format_rungs)
from ft.schemas import CacheState, History, LadderState, ResizePlan

GiB, MiB = 1024**3, 1024**2

# The numbers of `ft ctl cache` in the rebuild-OOM issue.
MOE_B, KV_B, MAMBA_B = 1395864371, int(1.9 * GiB), 925138534
SEED = {
    "state": "serving", "model": "Qwen3.8-Flash-Next-NVFP4",
    "budget_bytes": int(4.8 * GiB), "allocated_bytes": MOE_B + KV_B + MAMBA_B,
    "context_limit": 262144,
    "pools": {
        "moe": {"size": 512, "bytes": MOE_B, "min": 512, "max": 1843, "policy": "lru", "backend": "offload",
                "total_experts": 24576, "resident": 512, "hit_rate": 0.9},
        "kv": {"size": 262144, "bytes": KV_B, "min": 64, "max": 648194, "page_size": 64, "pages": 4096, "used": 0},
        "mamba": {"size": 8, "bytes": MAMBA_B, "min": 4, "max": 44, "used": 0},
    },
    "ladder": {"enabled": False},
    "running": 0, "waiting": 0, "uptime_s": 12.5,
}

SEED_TEXT = """\
state=serving, 4.1 GiB allocated (rebuild budget 4.8 GiB)
  moe    512 slots (lru, 2.1%)   1.3 GiB    512..1843
  kv     262144 tok (4096 x 64)  1.9 GiB    64..648194
  mamba  8 slots                 882.3 MiB  4..44"""

PLAN = {
    "target": {"kv": 65536, "moe": 1024},
    "steps": [
        {"action": "shrink kv", "pool": "kv", "delta_bytes": -int(1.4 * GiB),
         "total_bytes": MOE_B + MAMBA_B + int(0.5 * GiB)},
        {"action": "grow moe", "pool": "moe", "delta_bytes": MOE_B,
         "total_bytes": 2 * MOE_B + MAMBA_B + int(0.5 * GiB)},
    ],
    "peak_bytes": 2 * MOE_B + MAMBA_B + int(0.5 * GiB), "budget_bytes": int(4.8 * GiB), "fits": True,
}

T0 = 1_700_000_000.0
HISTORY = {"entries": [
    {"id": 1, "time": T0, "trigger": "startup", "from": {}, "to": {"moe": 512, "kv": 262144, "mamba": 8},
     "peak_bytes": SEED["allocated_bytes"], "status": "ok", "phases": {"total_s": 9.12}},
    {"id": 2, "time": T0 + 300, "trigger": "manual", "from": {"moe": 512, "kv": 262144, "mamba": 8},
     "to": {"moe": 1024, "kv": 65536, "mamba": 8}, "peak_bytes": int(4.6 * GiB), "status": "rolled_back",
     "error": "OutOfMemoryError('CUDA out of memory. Tried to allocate 800.00 MiB.\n ...')",
     "phases": {"total_s": 2.31}},
]}


def norm(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines()]


def err_body(message: str, type_: str = "invalid_request_error", code=None) -> dict:
    return {"error": {"message": message, "type": type_, "code": code}}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("FT_URL", raising=False)
    monkeypatch.delenv("FT_ADMIN_TOKEN", raising=False)


# --------------------------------------------------------------------------------------------
# formatting


def test_format_cache_matches_the_seed():
    text = format_cache(CacheState.model_validate(SEED))
    assert text == SEED_TEXT + "\n  ladder off"
    assert norm(text)[:4] == norm(SEED_TEXT)


def test_format_cache_columns_line_up_for_any_numbers():
    s = json.loads(json.dumps(SEED))
    s["pools"]["moe"].update(size=12345, bytes=17 * GiB, min=7, max=24576)
    s["pools"]["kv"].update(size=64, pages=1, page_size=64, bytes=5 * 1024, min=64, max=64)
    s["pools"]["mamba"].update(size=1000, bytes=999, min=1, max=123456789)
    lines = format_cache(CacheState.model_validate(s)).splitlines()[1:4]
    assert [line.split()[0] for line in lines] == ["moe", "kv", "mamba"]
    for token in ("GiB", "KiB", " B "):
        assert any(token in line for line in lines)
    # each column starts at the same offset on every row
    starts = [[m.start() for m in re.finditer(r"(?<=  )\S", line)] for line in lines]
    assert starts[0] == starts[1] == starts[2] and len(starts[0]) == 4
    assert lines[0].endswith("7..24576") and lines[2].endswith("1..123456789")


def test_format_cache_says_where_the_prefix_states_are():
    s = json.loads(json.dumps(SEED))
    assert "prefix cache" not in format_cache(CacheState.model_validate(s))  # states in device slots
    s["pools"]["mamba"].update(host_states=3, host_bytes=3 * 115 * 2**20)
    assert ("  prefix cache: 3 cached prefixes keep their linear-attention state in host memory (345.0 MiB), "
            "copied to a slot on a hit") in format_cache(CacheState.model_validate(s)).splitlines()


def test_format_cache_ladder_and_states():
    s = json.loads(json.dumps(SEED))
    s["state"] = "rebuilding"
    s["ladder"] = {"enabled": True, "auto": True, "rungs": [65536 + 32768 * i for i in range(7)], "current": 1,
                   "step": 32768, "last_decision": "request needs 90000 tokens:\n grew kv to 98304"}
    lines = format_cache(CacheState.model_validate(s)).splitlines()
    assert lines[0].startswith("state=rebuilding, 4.1 GiB allocated")
    assert lines[4:] == ["  ladder auto on: 65536 [98304] 131072 ... 262144 (step 32768)",
                         "    last: request needs 90000 tokens: grew kv to 98304"]
    assert format_cache(CacheState()).splitlines()[0] == "state=starting, 0 B allocated"
    assert not any("n-gram" in line for line in format_cache(CacheState()).splitlines())
    table = int(95.4 * 2**30)
    assert "  host: n-gram table 95.4 GiB in host memory" in format_cache(
        CacheState(host_table_bytes=table, host_tables={"n-gram table": table}))
    assert "  host: n-gram table 95.4 GiB, embedding 1.2 GiB in host memory" in format_cache(
        CacheState(host_table_bytes=table + int(1.2 * 2**30), host_tables={"n-gram table": table,
                                                                           "embedding": int(1.2 * 2**30)}))
    assert "  host: tables 95.4 GiB in host memory" in format_cache(CacheState(host_table_bytes=table))  # older servers
    on_disk = format_cache(CacheState(host_table_bytes=int(1.2 * 2**30), host_tables={"embedding": int(1.2 * 2**30)},
                                      disk_tables={"n-gram table": table}))
    assert "  host: embedding 1.2 GiB in host memory" in on_disk
    assert "  disk: n-gram table 95.4 GiB read from the checkpoint's files through the page cache" in on_disk
    assert not any(line.startswith("  host memory:") for line in on_disk.splitlines())  # (servers before the plan sent none)
    gib = 2**30
    planned = format_cache(CacheState.model_validate({"host_memory": {
        "parts": {"routed experts": int(63.3 * gib), "embedding": int(1.2 * gib), "prefix states": int(0.9 * gib)},
        "available_bytes": int(124.1 * gib), "available_from": "MemAvailable"}}))
    assert ("  host memory: routed experts 63.3 GiB, embedding 1.2 GiB, prefix states 921.6 MiB of 124.1 GiB "
            "available (MemAvailable) before loading") in planned.splitlines()


@pytest.mark.parametrize("rungs,current,expected", [
    ([1, 2, 3, 4, 5, 6, 7], 0, "[1] 2 ... 7"),
    ([1, 2, 3, 4, 5, 6, 7], 6, "1 ... 6 [7]"),
    ([1, 2, 3, 4, 5, 6, 7], 3, "1 2 3 [4] 5 6 7"),  # one hidden rung is shown, not '...'
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "1 ... 4 [5] 6 ... 9"),
    ([1, 2, 3, 4, 5, 6, 7], None, "1 2 ... 7"),
    ([8], 0, "[8]"),
])
def test_format_rungs(rungs, current, expected):
    assert format_rungs(LadderState(enabled=True, rungs=rungs, current=current)) == expected


def test_format_helpers():
    assert format_range(64, 648194) == "64..648194"
    assert format_geometry({"mamba": 4, "kv": 8192, "moe": 1400}) == "moe 1400 kv 8192 mamba 4"
    assert format_geometry({}) == "-"
    assert format_change({"moe": 512, "kv": 262144, "mamba": 8}, {"moe": 1024, "kv": 65536, "mamba": 8}) \
        == "moe 512->1024 kv 262144->65536"
    assert format_change({}, {"moe": 512, "kv": 64}) == "moe 512 kv 64"
    assert format_change({"kv": 64}, {"kv": 64}) == "no change"


def test_format_plan():
    text = format_plan(ResizePlan.model_validate(PLAN))
    assert text == (
        "dry run: moe 1024 kv 65536\n"
        "  1.  shrink kv  -1.4 GiB  total 2.7 GiB\n"
        "  2.  grow moe   +1.3 GiB  total 4.0 GiB\n"
        "peak 4.0 GiB of 4.8 GiB budget: fits"
    )
    bad = ResizePlan.model_validate({**PLAN, "fits": False, "peak_bytes": 5 * GiB, "reason": "moe grows\nfirst"})
    assert format_plan(bad).splitlines()[-1] == "peak 5.0 GiB of 4.8 GiB budget: does not fit (moe grows first)"
    assert norm(format_plan(ResizePlan(target={"kv": 64}, fits=True)))[1] == "(nothing to change)"


def test_format_history_newest_first_with_errors():
    t1, t2 = (time.strftime("%H:%M:%S", time.localtime(t)) for t in (T0, T0 + 300))
    text = format_history(History.model_validate(HISTORY))
    assert norm(text) == [
        "id time trigger change status took peak",
        f"2 {t2} manual moe 512->1024 kv 262144->65536 rolled_back 2.3 s 4.6 GiB",
        "error: OutOfMemoryError('CUDA out of memory. Tried to allocate 800.00 MiB. ...')",
        f"1 {t1} startup moe 512 kv 262144 mamba 8 ok 9.1 s 4.1 GiB",
    ]
    lines = text.splitlines()
    assert lines[0].index("change") == lines[1].index("moe") == lines[3].index("moe")
    assert lines[2].index("error:") == lines[0].index("time") + 2 and lines[2].startswith(" ")
    assert format_history(History()) == "no rebuilds yet"


# --------------------------------------------------------------------------------------------
# the client against a fake server


class FakeServer:
    """Answers by (method, path); records every request."""

    def __init__(self, routes: dict | None = None):
        self.routes = routes or {}
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        route = self.routes.get((request.method, request.url.path))
        if route is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        if callable(route):
            return route(request)
        status, body = route
        return httpx.Response(status, json=body)

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)

    def body(self, i: int = -1) -> dict:
        return json.loads(self.requests[i].content)


def run_ctl(capsys, server: FakeServer, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv), transport=server.transport)
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


def test_cache_shows_state(capsys):
    srv = FakeServer({("GET", "/admin/cache"): (200, SEED)})
    rc, out, err = run_ctl(capsys, srv, "cache")
    assert rc == 0 and err == ""
    assert out == SEED_TEXT + "\n  ladder off\n"
    req = srv.requests[0]
    assert str(req.url) == "http://127.0.0.1:30000/admin/cache" and "authorization" not in req.headers


def test_url_and_token_from_flags_and_env(capsys, monkeypatch):
    srv = FakeServer({("GET", "/admin/cache"): (200, SEED), ("GET", "/admin/cache/history"): (200, HISTORY)})
    assert run_ctl(capsys, srv, "--url", "gpu-box:31000/", "--token", "s3cret", "cache")[0] == 0
    assert str(srv.requests[-1].url) == "http://gpu-box:31000/admin/cache"
    assert srv.requests[-1].headers["authorization"] == "Bearer s3cret"
    # after the sub-command too
    assert run_ctl(capsys, srv, "--url", "http://a:1", "history", "--url", "http://b:2", "--token", "t2")[0] == 0
    assert str(srv.requests[-1].url) == "http://b:2/admin/cache/history"
    assert srv.requests[-1].headers["authorization"] == "Bearer t2"
    monkeypatch.setenv("FT_URL", "http://envhost:9")
    monkeypatch.setenv("FT_ADMIN_TOKEN", "fromenv")
    assert run_ctl(capsys, srv, "cache")[0] == 0
    assert str(srv.requests[-1].url) == "http://envhost:9/admin/cache"
    assert srv.requests[-1].headers["authorization"] == "Bearer fromenv"


def test_json_round_trips_the_schema(capsys):
    srv = FakeServer({("GET", "/admin/cache"): (200, SEED), ("GET", "/admin/cache/history"): (200, HISTORY)})
    rc, out, _ = run_ctl(capsys, srv, "cache", "--json")
    assert rc == 0 and json.loads(out) == SEED and "\n  " in out
    assert CacheState.model_validate_json(out) == CacheState.model_validate(SEED)
    rc, out, _ = run_ctl(capsys, srv, "history", "--json")
    assert rc == 0 and json.loads(out) == HISTORY
    assert History.model_validate_json(out).entries[1].from_ == {"moe": 512, "kv": 262144, "mamba": 8}


def test_history_text(capsys):
    srv = FakeServer({("GET", "/admin/cache/history"): (200, HISTORY)})
    rc, out, _ = run_ctl(capsys, srv, "history")
    assert rc == 0 and out.splitlines()[1].split()[0] == "2" and "rolled_back" in out


def test_resize_sends_targets_and_prints_the_new_state(capsys):
    new = json.loads(json.dumps(SEED))
    new["pools"]["kv"].update(size=65536, pages=1024, bytes=int(0.48 * GiB))
    srv = FakeServer({("POST", "/admin/cache"): (200, new)})
    rc, out, err = run_ctl(capsys, srv, "cache", "--moe", "1024", "--kv", "65536", "--wait", "300")
    assert rc == 0 and err == ""
    assert srv.body() == {"moe": 1024, "kv": 65536, "wait_s": 300.0}
    assert norm(out)[2] == "kv 65536 tok (1024 x 64) 491.5 MiB 64..648194"
    # the HTTP read timeout outlives the server's wait; connecting still fails fast
    timeout = srv.requests[-1].extensions["timeout"]
    assert timeout["read"] > 300 and timeout["connect"] <= 10


def test_resize_without_wait_does_not_time_out_early(capsys):
    srv = FakeServer({("POST", "/admin/cache"): (200, SEED)})
    assert run_ctl(capsys, srv, "cache", "--mamba", "4")[0] == 0
    assert srv.body() == {"mamba": 4}
    assert srv.requests[-1].extensions["timeout"]["read"] > 3600


def test_dry_run(capsys):
    srv = FakeServer({("POST", "/admin/cache"): (200, PLAN)})
    rc, out, err = run_ctl(capsys, srv, "cache", "--kv", "65536", "--moe", "1024", "--dry-run")
    assert rc == 0 and err == ""
    assert srv.body() == {"moe": 1024, "kv": 65536, "dry_run": True}
    assert out.startswith("dry run: moe 1024 kv 65536\n") and out.endswith("budget: fits\n")
    srv.routes[("POST", "/admin/cache")] = (200, {**PLAN, "fits": False, "reason": "peak over budget"})
    rc, out, err = run_ctl(capsys, srv, "cache", "--kv", "65536", "--moe", "1024", "--dry-run")
    assert rc == 1 and out.splitlines()[-1].endswith("does not fit (peak over budget)")
    # the reason once (the plan's last line), then what to do (issue 41, item 9)
    assert one_line(err) == ("ft ctl: the plan does not fit; the sizes together exceed the budget: "
                             "shrink another pool in the same call, or pick smaller sizes")
    srv.routes[("POST", "/admin/cache")] = (200, {**PLAN, "fits": False, "reason": "moe 2 is below the expert floor 4"})
    rc, out, err = run_ctl(capsys, srv, "cache", "--moe", "2", "--dry-run")
    assert rc == 1 and "pick smaller" not in err and "at or above it" in one_line(err)
    rc, out, err = run_ctl(capsys, srv, "cache", "--kv", "65536", "--dry-run", "--json")
    assert rc == 1 and ResizePlan.model_validate_json(out).fits is False
    assert "does not fit: moe 2 is below the expert floor 4;" in one_line(err)  # (no plan text: the reason here)


@pytest.mark.parametrize("status,body,expected", [
    (422, err_body("kv 9000000 is outside 64..648194"),
     "ft ctl: refused (422): kv 9000000 is outside 64..648194; pick a size inside the range `ft ctl cache` shows"),
    (422, {"detail": [{"type": "greater_than_equal", "loc": ["body", "kv"],
                       "msg": "Input should be greater than or equal to 0", "input": -1}]},
     "ft ctl: refused (422): kv: Input should be greater than or equal to 0; pick a size inside the range `ft ctl cache` shows"),
    (409, err_body("another rebuild is running; retry when it ends", "conflict", 409),
     "ft ctl: refused (409): another rebuild is running; retry when it ends (follow it with `ft ctl history`)"),
    (501, err_body("live resize is not implemented", "not_implemented", 501), None),
    (504, err_body("waited 5 s but running or queued requests still hold what the target needs; retry later "
                   "or with a longer wait", "timeout", 504),
     ("ft ctl: not done (504): waited 5 s but running or queued requests still hold what the target needs; retry "
      "later or with a longer wait; nothing was changed")),
    (202, err_body("rebuild still running after 5 s", "accepted", 202), None),
    (500, {"detail": "boom"}, "ft ctl: server error (500): boom; see the `ft serve` log"),
])
def test_resize_failures_exit_1_with_one_line(capsys, status, body, expected):
    srv = FakeServer({("POST", "/admin/cache"): (status, body)})
    rc, out, err = run_ctl(capsys, srv, "cache", "--kv", "9000000", "--wait", "5")
    assert rc == 1 and out == ""
    line = one_line(err)
    if expected is not None:
        assert line == expected
    assert line.startswith("ft ctl: ")
    if status == 202:
        assert "--wait 5 s" in line and "ft ctl history" in line
    if status == 501:
        assert "restart `ft serve`" in line


def test_rollback_prints_the_seed_line(capsys):
    """Scripts written for the seed match `HTTP 503: rebuild failed and was rolled back: <error>`: that
    line comes first, as it was; what to do follows on its own line."""
    body = err_body("rebuild failed and was rolled back: OutOfMemoryError('CUDA out of memory. Tried to allocate "
                    "800.00 MiB.')", "rebuild_failed", 503)
    srv = FakeServer({("POST", "/admin/cache"): (503, body)})
    rc, out, err = run_ctl(capsys, srv, "cache", "--moe", "1024", "--kv", "65536", "--wait", "300")
    assert rc == 1 and out == ""
    lines = err.splitlines()
    assert lines[0] == ("HTTP 503: rebuild failed and was rolled back: OutOfMemoryError('CUDA out of memory. "
                        "Tried to allocate 800.00 MiB.')")
    assert lines[1] == "ft ctl: the server kept serving at the old sizes (`ft ctl history` has the details)"


def test_ladder_off_409_does_not_blame_another_rebuild(capsys):
    srv = FakeServer({("POST", "/admin/ladder"): (409, err_body(
        "the KV ladder is off: start ft serve with --enable-kv-ladder", "conflict", 409))})
    rc, _, err = run_ctl(capsys, srv, "ladder", "--up")
    assert rc == 1 and one_line(err) == "ft ctl: refused (409): the KV ladder is off: start ft serve with --enable-kv-ladder"


def test_accepted_with_a_state_body(capsys):
    busy = {**SEED, "state": "rebuilding"}
    srv = FakeServer({("POST", "/admin/cache"): (202, busy)})
    rc, out, err = run_ctl(capsys, srv, "cache", "--kv", "65536", "--wait", "0")
    assert rc == 1 and out == ""
    assert one_line(err) == (
        "ft ctl: not finished (202): the rebuild did not end within --wait 0 s: the rebuild is still running; "
        "it goes on in the server: follow it with `ft ctl history` or `ft ctl cache`")


def test_unauthorized(capsys):
    srv = FakeServer({("GET", "/admin/cache"): (401, err_body("missing admin token", "unauthorized", 401))})
    rc, out, err = run_ctl(capsys, srv, "cache")
    line = one_line(err)
    assert rc == 1 and out == "" and "needs an admin token" in line
    assert "--token" in line and "FT_ADMIN_TOKEN" in line
    rc, _, err = run_ctl(capsys, srv, "cache", "--token", "wrong")
    assert rc == 1 and "rejected" in one_line(err)


def test_unreachable_exits_3(capsys):
    def refuse(request):
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    rc, out, err = run_ctl(capsys, FakeServer({("GET", "/admin/cache"): refuse}), "--url", "http://h:1", "cache")
    line = one_line(err)
    assert rc == 3 and out == "" and "http://h:1" in line and "ft serve" in line and "--url" in line

    def slow(request):
        raise httpx.ReadTimeout("timed out", request=request)

    rc, _, err = run_ctl(capsys, FakeServer({("GET", "/admin/cache/history"): slow}), "history")
    assert rc == 3 and "no answer from http://127.0.0.1:30000" in one_line(err)


def test_really_closed_port_exits_3(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = cli.main(["--url", f"http://127.0.0.1:{port}", "--timeout", "2", "cache"])
    assert rc == 3 and f"127.0.0.1:{port}" in one_line(capsys.readouterr().err)


def test_not_our_server(capsys):
    srv = FakeServer({("GET", "/admin/cache"): lambda r: httpx.Response(200, text="<html>hi</html>")})
    rc, _, err = run_ctl(capsys, srv, "cache")
    assert rc == 1 and "other than JSON" in one_line(err)
    rc, _, err = run_ctl(capsys, FakeServer(), "history")
    assert rc == 1 and "404" in one_line(err)


def test_ladder(capsys):
    lad = json.loads(json.dumps(SEED))
    lad["ladder"] = {"enabled": True, "auto": False, "rungs": [65536, 98304, 131072], "current": 2, "step": 32768}
    srv = FakeServer({("POST", "/admin/ladder"): (200, lad), ("GET", "/admin/cache"): (200, lad)})
    rc, out, _ = run_ctl(capsys, srv, "ladder", "--auto", "on", "--up")
    assert rc == 0 and srv.body() == {"auto": True, "rung": "up"}
    assert "  ladder auto off: 65536 98304 [131072] (step 32768)" in out.splitlines()
    assert run_ctl(capsys, srv, "ladder", "--down")[0] == 0 and srv.body() == {"rung": "down"}
    # rungs are counted from 1 on the command line (as `ft top` and the banner count them); the API takes an index
    assert run_ctl(capsys, srv, "ladder", "--rung", "1", "--json")[0] == 0 and srv.body() == {"rung": 0}
    rc, _, err = run_ctl(capsys, srv, "ladder", "--rung", "0")
    assert rc == 2 and "counted from 1" in err
    assert run_ctl(capsys, srv, "ladder", "--auto", "off")[0] == 0 and srv.body() == {"auto": False}
    assert run_ctl(capsys, srv, "ladder")[0] == 0 and srv.requests[-1].method == "GET"
    srv.routes[("POST", "/admin/ladder")] = (422, err_body("rung 9 is outside 1..3"))
    rc, _, err = run_ctl(capsys, srv, "ladder", "--rung", "9")
    assert rc == 1 and srv.body() == {"rung": 8}
    assert one_line(err).startswith("ft ctl: refused (422): rung 9 is outside 1..3; pick a rung")


@pytest.mark.parametrize("argv", [
    [], ["cache", "--kv", "-5"], ["cache", "--kv", "lots"], ["cache", "--dry-run"], ["cache", "--wait", "3"],
    ["cache", "--kv", "64", "--wait", "9999"], ["cache", "--kv", "64", "--wait", "3", "--dry-run"],
    ["ladder", "--up", "--down"], ["ladder", "--up", "--rung", "2"], ["ladder", "--auto", "maybe"],
    ["frobnicate"], ["cache", "--bogus"],
])
def test_usage_errors_exit_2(capsys, argv):
    srv = FakeServer({("GET", "/admin/cache"): (200, SEED)})
    assert cli.main(argv, transport=srv.transport) == 2
    assert srv.requests == [] and capsys.readouterr().err


def test_help_exits_0(capsys):
    assert cli.main(["--help"]) == 0 and "exit codes" in capsys.readouterr().out
    assert cli.main(["cache", "--help"]) == 0 and "--dry-run" in capsys.readouterr().out


def test_client_api_directly():
    srv = FakeServer({("GET", "/admin/cache"): (200, SEED), ("POST", "/admin/cache"): (200, PLAN),
                      ("GET", "/admin/cache/history"): (200, HISTORY)})
    with AdminClient("http://x:1", token="t", transport=srv.transport) as c:
        assert isinstance(c.cache(), CacheState)
        assert isinstance(c.resize(kv=64, dry_run=True), ResizePlan)
        assert c.history().entries[0].trigger == "startup"
        with pytest.raises(CtlError) as e:
            c.resize(kv=-1)
        assert e.value.exit_code == 2
        with pytest.raises(CtlError) as e:
            c.ladder(rung="sideways")
        assert e.value.exit_code == 2


def test_wired_into_ft_cli(capsys, monkeypatch):
    """Through the top-level `ft` parser, as ft/cli.py registers it."""
    from ft import cli as ft_cli

    monkeypatch.setitem(ft_cli.COMMANDS, "ctl", ("ft.ctl.cli", "inspect and resize a running server's caches"))
    srv = FakeServer({("GET", "/admin/cache"): (200, SEED)})
    monkeypatch.setattr(cli, "TRANSPORT", srv.transport)
    assert ft_cli.main(["ctl", "--token", "t", "cache", "--url", "http://h:2"]) == 0
    assert capsys.readouterr().out == SEED_TEXT + "\n  ladder off\n"
    assert str(srv.requests[-1].url) == "http://h:2/admin/cache"
    assert ft_cli.main(["ctl"]) == 2
    with pytest.raises(SystemExit) as e:
        ft_cli.main(["ctl", "cache", "--kv", "x"])
    assert e.value.code == 2


def test_never_imports_torch():
    code = (
        "import sys\n"
        "import ft.ctl.cli\n"
        "from ft.ctl.cli import main\n"
        "rc = main(['--url', 'http://127.0.0.1:9', '--timeout', '1', 'history'])\n"
        "print(rc, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["3", "False"]


def test_cache_says_how_ranges_read_and_notes_rounding(capsys):
    state = json.loads(json.dumps(SEED))
    state["exchange"] = {"kv_tokens_per_expert_slot": 27.4, "mamba_slots_per_expert_slot": 0.13}
    srv = FakeServer({("GET", "/admin/cache"): (200, state)})
    rc, out, _ = run_ctl(capsys, srv, "cache")
    assert rc == 0 and out.splitlines()[-1] == ("  ranges: each with the other pools at their current sizes; "
                                                "1 expert slot = 27 kv tokens = 0.13 mamba slots")
    resized = {**state, "notes": ["kv 100 rounded up to 128 tokens (whole pages of 64)"]}
    srv = FakeServer({("POST", "/admin/cache"): (200, resized)})
    rc, out, _ = run_ctl(capsys, srv, "cache", "--kv", "100")
    assert rc == 0 and out.splitlines()[-1] == "note: kv 100 rounded up to 128 tokens (whole pages of 64)"


def test_format_cache_says_the_kv_dtype_and_read_through():
    s = json.loads(json.dumps(SEED))
    s["pools"]["kv"]["dtype"] = "float8_e4m3fn"
    s["pools"]["moe"].update(read_through=True, landed=1234, host_bytes=3 * 2**30)
    text = format_cache(CacheState.model_validate(s))
    assert "kv cache float8_e4m3fn: x / scale" in text
    assert "read-through); 1234 landed, 3.0 GiB read from host" in text
    seed = format_cache(CacheState.model_validate(SEED)).splitlines()
    assert text.splitlines()[: len(seed)] == seed  # the seed's lines stay, in the seed's order


REQUESTS = {
    "requests": [
        {"id": "cmpl-a", "state": "decode", "prompt_tokens": 812, "generated_tokens": 40, "kv_pages": 14, "age_s": 3.2},
        {"id": "cmpl-b", "state": "waiting", "prompt_tokens": 120, "generated_tokens": 0, "kv_pages": 0, "age_s": 0.4},
    ],
    "running": 1, "waiting": 3, "truncated": True, "uptime_s": 10.0, "started_at": 1.0,
}


def test_requests_lists_running_then_waiting(capsys):
    srv = FakeServer({("GET", "/admin/requests"): (200, REQUESTS)})
    rc, out, err = run_ctl(capsys, srv, "requests", "--limit", "2")
    assert rc == 0 and err == ""
    assert srv.requests[-1].url.params["limit"] == "2"
    lines = out.splitlines()
    assert lines[0].split() == ["id", "state", "prompt", "generated", "kv", "pages", "age"]
    assert lines[1].split() == ["cmpl-a", "decode", "812", "40", "14", "3.2", "s"]
    assert lines[2].split()[:2] == ["cmpl-b", "waiting"]
    assert lines[3] == "1 running, 3 waiting (first 2 shown)"
    rc, out, _ = run_ctl(capsys, srv, "requests", "--json")
    assert rc == 0 and json.loads(out) == REQUESTS
    assert srv.requests[-1].url.params["limit"] == "200"  # the flag's default


def test_requests_empty_and_bad_limit(capsys):
    empty = {"requests": [], "running": 0, "waiting": 0, "truncated": False, "uptime_s": 1.0, "started_at": 1.0}
    srv = FakeServer({("GET", "/admin/requests"): (200, empty)})
    rc, out, _ = run_ctl(capsys, srv, "requests")
    assert rc == 0 and out == "0 running, 0 waiting\n"
    rc, _, err = run_ctl(capsys, srv, "requests", "--limit", "0")
    assert rc == 2 and "--limit" in one_line(err)
