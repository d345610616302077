"""`ft serve`'s logging: one stderr handler for FreeToken's loggers (`ft.*`) and uvicorn's.

`--log-format text` writes `2026-01-02 10:11:12 INFO ft.stats: message`; a record logged with
`extra={"plain": True}` (the startup banner, the phase lines, "ready on ...") is its message
alone, as a console line. `--log-format json` writes one JSON object per line for every record:
`{"time", "level", "logger", "message"}` (+ "exception" with a traceback).

uvicorn's access log leaves out the GETs that monitors and `ft top` poll (/health, /metrics,
/admin/...) unless `--access-log-admin`; its "Waiting for application startup." and "Application
startup complete." lines are dropped (they come before the engine is loaded, and "complete" would
read as "ready": `ft serve` says "ready on ..." itself once /health answers 200).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime
from typing import IO

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
POLLED_PATHS = ("/health", "/metrics")  # and everything under /admin/
_UVICORN_STARTUP_NOISE = ("Waiting for application startup.", "Application startup complete.")


class TextFormatter(logging.Formatter):
    """Time, level, logger and message on one line; `plain` records are their message alone."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "plain", False):
            text = record.getMessage()
            return text + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in a message are escaped): time (ISO 8601
    with the local offset, milliseconds), level, logger, message, and exception when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "time": datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False)


class AccessLogFilter(logging.Filter):
    """On "uvicorn.access": drop GET /health, GET /metrics and GET /admin/... unless `include_admin`.
    Every other request (POST /admin/cache, a resize, included) is kept."""

    def __init__(self, include_admin: bool = False) -> None:
        super().__init__()
        self.include_admin = include_admin

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if self.include_admin or not isinstance(args, tuple) or len(args) < 3:
            return True
        method, path = args[1], str(args[2]).split("?", 1)[0]  # uvicorn: (client, method, path, version, status)
        polled = path in POLLED_PATHS or path == "/admin" or path.startswith("/admin/")
        return not (method == "GET" and polled)


class _FtHandler(logging.StreamHandler):
    """The root handler `configure` installs (its type marks it, so a later call replaces only its own)."""


class _StartupNoiseFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in _UVICORN_STARTUP_NOISE


def configure(level: str = "info", fmt: str = "text", access_log_admin: bool = False,
              stream: IO[str] | None = None) -> logging.Handler:
    """Route the root logger (so `ft.*` and uvicorn's loggers, which propagate to it) to one handler
    on `stream` (default stderr) in `fmt`, at `level` for FreeToken's and uvicorn's loggers alike.
    Calling it again replaces what an earlier call installed. Returns the handler."""
    lvl = getattr(logging, level.upper())
    handler = _FtHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _FtHandler)]:
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(lvl)
    logging.getLogger("ft").setLevel(lvl)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers.clear()  # uvicorn's own (colour) handlers, if its default config ran
        lg.propagate = True
        lg.setLevel(lvl)
        for f in [f for f in lg.filters if isinstance(f, (AccessLogFilter, _StartupNoiseFilter))]:
            lg.removeFilter(f)
    logging.getLogger("uvicorn.access").addFilter(AccessLogFilter(access_log_admin))
    logging.getLogger("uvicorn.error").addFilter(_StartupNoiseFilter())
    return handler
