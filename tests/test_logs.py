"""`ft serve`'s logs: the stats line (format and interval arithmetic), the JSON format, the level
of FreeToken's loggers, and the access-log filter that leaves out admin polling."""

from __future__ import annotations

import io
import json
import logging
import sys
from types import SimpleNamespace

import pytest
from server_proc import WAIT_S, wait_for

from ft.server import logs
from ft.server.stats_log import StatsLogger, StatsSample, format_stats


def _sample(at, *, running=1, waiting=0, prompt=0, gen=0, kv_used=0, kv=1000, hits=0, misses=0, rung=None, rungs=0):
    return StatsSample(at, running, waiting, prompt, gen, kv_used, kv, hits, misses, rung, rungs)


def test_stats_line_format():
    prev = _sample(100.0, prompt=1000, gen=50, hits=100, misses=100)
    cur = _sample(110.0, running=2, waiting=1, prompt=6120, gen=435, kv_used=125, hits=1012, misses=188, rung=1,
                  rungs=5)
    assert format_stats(prev, cur) == ("running 2, waiting 1, prompt 512.0 tok/s, generation 38.5 tok/s, kv 12.5%, "
                                       "expert hits 91.2%, rung 2/5")


def test_stats_line_without_lookups_experts_or_ladder():
    prev, cur = _sample(0.0), _sample(4.0, gen=10)
    assert format_stats(prev, cur) == ("running 1, waiting 0, prompt 0.0 tok/s, generation 2.5 tok/s, kv 0.0%, "
                                       "expert hits -")
    resident = _sample(4.0, gen=10, hits=None, misses=None)
    assert "expert" not in format_stats(_sample(0.0, hits=None, misses=None), resident)
    assert format_stats(prev, _sample(4.0, rung=None, rungs=3)).endswith("rung -/3")  # between rungs


class _FakeEngine:
    """An engine as the engine loop and the stats line see it: `stats()` gives its figures (here the
    object itself, whose `EngineStats` fields the test sets)."""

    def __init__(self):
        self.running = self.waiting = self.prompt_tokens = self.generation_tokens = self.kv_used_tokens = 0
        self.kv_tokens, self.offloaded, self.hits, self.misses, self.rung, self.rungs = 1024, True, 0, 0, None, 0
        self.cache = SimpleNamespace(degraded=None)
        self.has_work = False
        self.context_limit = 1024

    def stats(self):
        return self


def test_stats_interval_arithmetic():
    now = [0.0]
    lines = []
    e = _FakeEngine()
    s = StatsLogger(10.0, clock=lambda: now[0], emit=lines.append)
    assert s.tick(e.stats) is None  # the first tick only takes the baseline
    e.generation_tokens = 40
    now[0] = 9.99
    assert s.tick(e.stats) is None  # not due yet
    now[0] = 12.5
    e.running = 1
    e.hits, e.misses = 3, 1
    assert s.tick(e.stats) == "running 1, waiting 0, prompt 0.0 tok/s, generation 3.2 tok/s, kv 0.0%, expert hits 75.0%"
    now[0] = 20.0
    assert s.tick(e.stats) is None  # 7.5 s after the last sample: not due
    e.running = 0
    now[0] = 30.0
    assert s.tick(e.stats) is None  # nothing ran, nothing counted: idle, no line
    e.prompt_tokens = 200
    e.kv_used_tokens = 256
    now[0] = 45.0
    assert s.tick(e.stats) == "running 0, waiting 0, prompt 13.3 tok/s, generation 0.0 tok/s, kv 25.0%, expert hits -"
    assert len(lines) == 2
    off = StatsLogger(0.0, clock=lambda: now[0], emit=lines.append)
    assert not off.due(1e9) and off.tick(e.stats) is None


def test_engine_loop_writes_stats_lines(caplog):
    """The engine thread ticks the stats logger from the moment the engine is up: tokens counted
    after that show up as a line in ft.stats."""
    from ft.server.engine_loop import EngineLoop

    e = _FakeEngine()
    loop = EngineLoop(lambda: e, stats_interval_s=0.05)
    with caplog.at_level(logging.INFO, logger="ft.stats"):
        loop.start()
        try:
            assert loop.ready.wait(WAIT_S)

            def bump(engine):
                engine.generation_tokens += 5

            loop.call_sync(bump, timeout=WAIT_S)
            wait_for(lambda: any("generation" in r.getMessage() for r in caplog.records if r.name == "ft.stats"),
                     "a stats line")
        finally:
            loop.stop()


@pytest.fixture
def restore_logging():
    """configure() changes process-wide logging: put back what it touches."""
    names = ("", "ft", "uvicorn", "uvicorn.error", "uvicorn.access")
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers), list(logging.getLogger(n).filters),
                 logging.getLogger(n).propagate) for n in names}
    yield
    for n, (level, handlers, filters, propagate) in saved.items():
        lg = logging.getLogger(n)
        lg.setLevel(level)
        lg.handlers[:] = handlers
        lg.filters[:] = filters
        lg.propagate = propagate


def test_json_format_is_one_object_per_line(restore_logging):
    out = io.StringIO()
    logs.configure("info", "json", stream=out)
    logging.getLogger("ft.engine").info("two\nlines %d", 2)
    logging.getLogger("ft.serve").info("banner", extra={"plain": True})
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("ft.server").exception("failed")
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(rows) == 3
    assert {k: rows[0][k] for k in ("level", "logger", "message")} == {"level": "INFO", "logger": "ft.engine",
                                                                        "message": "two\nlines 2"}
    assert rows[1]["message"] == "banner" and "T" in rows[0]["time"]
    assert rows[2]["level"] == "ERROR" and "ValueError: boom" in rows[2]["exception"]


def test_text_format_and_log_level_reach_ft_loggers(restore_logging):
    out = io.StringIO()
    logs.configure("warning", "text", stream=out)
    logging.getLogger("ft.engine").info("hidden")
    logging.getLogger("ft.cache").warning("shown %s", "here")
    logging.getLogger("ft.serve").warning("  ready on x", extra={"plain": True})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].endswith(" WARNING ft.cache: shown here") and lines[1] == "  ready on x"
    out2 = io.StringIO()
    logs.configure("debug", "text", stream=out2)  # a second call replaces the first's handler
    logging.getLogger("ft.engine").debug("now shown")
    assert "now shown" in out2.getvalue() and "now shown" not in out.getvalue()


def _access(method, path, status=200):
    """A record as uvicorn's access logger makes it."""
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5000", method, path, "1.1", status), None)


@pytest.mark.parametrize("method,path,polled", [
    ("GET", "/health", True), ("GET", "/metrics", True), ("GET", "/admin/cache", True),
    ("GET", "/admin/events?since=3", True), ("POST", "/admin/cache", False), ("GET", "/v1/models", False),
    ("POST", "/v1/chat/completions", False), ("GET", "/healthz", False),
])
def test_access_log_filter(method, path, polled):
    assert logs.AccessLogFilter().filter(_access(method, path)) is not polled
    assert logs.AccessLogFilter(include_admin=True).filter(_access(method, path))


def test_access_log_filter_is_installed_on_uvicorn_access(restore_logging):
    out = io.StringIO()
    logs.configure("info", "text", stream=out)
    for method, path in (("GET", "/health"), ("GET", "/v1/models")):
        logging.getLogger("uvicorn.access").handle(_access(method, path))
    logging.getLogger("uvicorn.error").info("Application startup complete.")
    text = out.getvalue()
    assert "/v1/models" in text and "/health" not in text and "startup complete" not in text
    out = io.StringIO()
    logs.configure("info", "text", access_log_admin=True, stream=out)
    logging.getLogger("uvicorn.access").handle(_access("GET", "/health"))
    assert "/health" in out.getvalue()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_engine_figures_that_fail_are_reported_once_and_serving_goes_on(caplog):
    """An `Engine.stats` that raises (a bug) is logged once with its traceback, not every 20 ms, and
    commands still run (the engine thread keeps serving; /metrics keeps the last figures)."""
    from ft.server.engine_loop import EngineLoop

    class Broken(_FakeEngine):
        def stats(self):
            raise RuntimeError("broken figures")

    loop = EngineLoop(Broken)
    with caplog.at_level(logging.ERROR, logger="ft.server"):
        loop.start()
        try:
            assert loop.ready.wait(WAIT_S) and loop.state == "serving"
            for _ in range(5):
                assert loop.call_sync(lambda e: e.context_limit, timeout=WAIT_S) == 1024
        finally:
            loop.stop()
    failed = [r for r in caplog.records if "taking the engine's figures failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None and loop.stats() is None
