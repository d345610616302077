"""`AdminClient`: the admin API over httpx, answers parsed into `ft.schemas` objects.

Every failure is a `CtlError(message, exit_code)` whose message is one line that says what to do:
exit code 1 when the server refused (4xx), rolled back (503) or did not finish within the wait
(202/504), 2 for a malformed URL, 3 when the server cannot be reached. No torch, ever.
"""

from __future__ import annotations

import json
import os
from typing import Any, Self, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from ft.schemas import CacheState, History, RequestList, ResizePlan, ResizeRequest

DEFAULT_URL = "http://127.0.0.1:30000"
DEFAULT_TIMEOUT_S = 10.0
# Beyond the server's wait: the answer needs time to come back after the wait ends.
WAIT_MARGIN_S = 30.0
# A rebuild without an explicit wait (resize, ladder move) may block up to the longest wait the
# schema allows, so the HTTP read timeout must not cut it short.
MAX_WAIT_S = 3600.0

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3

M = TypeVar("M", bound=BaseModel)


class CtlError(Exception):
    """A failure to report in one line, with the process exit code that goes with it.

    `seed_line`: print the message as is, without the "ft ctl: " prefix (lines that scripts written
    for the seed match, such as ``HTTP 503: rebuild failed and was rolled back: ...``); `detail`:
    more lines printed after it."""

    def __init__(self, message: str, exit_code: int = EXIT_REFUSED, status: int | None = None, *,
                 seed_line: bool = False, detail: tuple[str, ...] = ()):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.status = status  # the HTTP status, when there was an answer
        self.seed_line = seed_line
        self.detail = detail


def default_url() -> str:
    return os.environ.get("FT_URL") or DEFAULT_URL


def default_token() -> str | None:
    return os.environ.get("FT_ADMIN_TOKEN") or None


def normalize_url(url: str) -> str:
    """'localhost:30000' -> 'http://localhost:30000'; trailing slashes dropped."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


def _one_line(text: str, limit: int = 2000) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_message(response: httpx.Response) -> str | None:
    """The readable message of an error body: ours ({"error": {"message"}}), FastAPI's
    ({"detail": str | [{"loc", "msg"}]}), or a text body itself; None for JSON without one."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return _one_line(err["message"])
        if isinstance(err, str) and err:
            return _one_line(err)
        detail = body.get("detail")
        if isinstance(detail, str) and detail:
            return _one_line(detail)
        if isinstance(detail, list) and detail:
            parts = []
            for d in detail:
                if isinstance(d, dict):
                    loc = [str(x) for x in d.get("loc", ()) if x != "body"]
                    msg = d.get("msg", "")
                    parts.append(f"{'.'.join(loc)}: {msg}" if loc else str(msg))
                else:
                    parts.append(str(d))
            return _one_line("; ".join(parts))
        if isinstance(body.get("message"), str):
            return _one_line(body["message"])
    if body is not None:
        return None
    text = response.text.strip()
    return _one_line(text, 300) if text else None


class AdminClient:
    """A client of one server's admin API.

    `transport` takes any httpx transport (tests pass `httpx.MockTransport`)."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 transport: httpx.BaseTransport | None = None):
        self.url = normalize_url(url or default_url())
        self.token = token
        self.timeout = float(timeout)
        self.last_json: Any = None  # the last successful answer's JSON, as the server sent it
        headers = {"Accept": "application/json", "User-Agent": "ft-ctl"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            self._http = httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout, transport=transport)
        except (httpx.InvalidURL, ValueError) as e:
            raise CtlError(f"bad server URL {self.url!r} ({e}); pass --url like http://127.0.0.1:30000", EXIT_USAGE)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the API ------------------------------------------------------------------------------

    def cache(self) -> CacheState:
        """GET /admin/cache."""
        return self._call("GET", "/admin/cache", CacheState)

    def resize(self, moe: int | None = None, kv: int | None = None, mamba: int | None = None,
               wait_s: float | None = None, dry_run: bool = False) -> CacheState | ResizePlan:
        """POST /admin/cache: a `CacheState` after the rebuild, or the `ResizePlan` of a dry run."""
        try:
            req = ResizeRequest(moe=moe, kv=kv, mamba=mamba, wait_s=wait_s, dry_run=dry_run)
        except ValidationError as e:
            msg = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise CtlError(f"bad resize request: {msg}", EXIT_USAGE) from None
        body = req.model_dump(exclude_none=True, exclude_defaults=True)
        if dry_run:
            timeout = self.timeout
        else:
            timeout = max(self.timeout, (MAX_WAIT_S if wait_s is None else wait_s) + WAIT_MARGIN_S)
        model = ResizePlan if dry_run else CacheState
        return self._call("POST", "/admin/cache", model, body=body, timeout=timeout, action="resize", wait_s=wait_s)

    def history(self) -> History:
        """GET /admin/cache/history."""
        return self._call("GET", "/admin/cache/history", History)

    def requests(self, limit: int | None = None) -> RequestList:
        """GET /admin/requests: the running and waiting requests (at most `limit`, else the server's default)."""
        path = "/admin/requests" if limit is None else f"/admin/requests?limit={int(limit)}"
        return self._call("GET", path, RequestList)

    def ladder(self, auto: bool | None = None, rung: int | str | None = None) -> CacheState:
        """POST /admin/ladder: turn the automatic ladder on or off and/or move to a rung
        (an index into the ladder's rungs, or "up" / "down")."""
        if isinstance(rung, str) and rung not in ("up", "down"):
            raise CtlError(f"bad rung {rung!r}: give an index, 'up' or 'down'", EXIT_USAGE)
        body: dict[str, Any] = {}
        if auto is not None:
            body["auto"] = bool(auto)
        if rung is not None:
            body["rung"] = rung
        timeout = max(self.timeout, MAX_WAIT_S + WAIT_MARGIN_S)  # a move (or auto's first step) rebuilds
        return self._call("POST", "/admin/ladder", CacheState, body=body, timeout=timeout, action="ladder")

    # -- plumbing -----------------------------------------------------------------------------

    def _call(self, method: str, path: str, model: type[M], body: dict | None = None,
              timeout: float | None = None, action: str | None = None, wait_s: float | None = None) -> M:
        timeout = self.timeout if timeout is None else timeout
        try:
            # a long wait for the answer, never a long wait to connect
            r = self._http.request(method, path, json=body,
                                   timeout=httpx.Timeout(timeout, connect=min(timeout, self.timeout)))
        except httpx.ConnectTimeout:
            raise CtlError(
                f"cannot reach the server at {self.url} (no connection within {self.timeout:g} s); check the URL "
                f"(--url / FT_URL) and that `ft serve` runs there", EXIT_UNREACHABLE) from None
        except httpx.TimeoutException:
            hint = " (a rebuild may still be running: check `ft ctl history`)" if action else ""
            raise CtlError(
                f"no answer from {self.url} within {timeout:g} s{hint}; check the URL (--url / FT_URL) "
                f"and that `ft serve` runs there", EXIT_UNREACHABLE) from None
        except httpx.UnsupportedProtocol as e:
            raise CtlError(f"bad server URL {self.url!r} ({e}); pass --url like http://127.0.0.1:30000",
                           EXIT_USAGE) from None
        except httpx.TransportError as e:
            reason = _one_line(str(e), 200) or type(e).__name__
            raise CtlError(
                f"cannot reach the server at {self.url} ({reason}); check the URL (--url / FT_URL) "
                f"and that `ft serve` runs there", EXIT_UNREACHABLE) from None
        except httpx.InvalidURL as e:
            raise CtlError(f"bad server URL {self.url!r} ({e}); pass --url like http://127.0.0.1:30000",
                           EXIT_USAGE) from None
        if r.status_code == 200:
            return self._parse(r, model, path)
        raise self._failure(r, path, action, wait_s)

    def _parse(self, r: httpx.Response, model: type[M], path: str) -> M:
        try:
            data = r.json()
        except ValueError:
            raise CtlError(f"the server at {self.url} answered {path} with something other than JSON; "
                           f"is --url pointing at `ft serve`?", EXIT_REFUSED, r.status_code) from None
        try:
            obj = model.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(map(str, first["loc"]))
            raise CtlError(f"unexpected answer to {path} ({where}: {first['msg']}); is the server the same "
                           f"ft version as this client?", EXIT_REFUSED, r.status_code) from None
        self.last_json = data
        return obj

    def _failure(self, r: httpx.Response, path: str, action: str | None, wait_s: float | None) -> CtlError:
        code = r.status_code
        msg = error_message(r)
        if msg is None:
            msg = "the rebuild is still running" if code in (202, 504) else (r.reason_phrase or f"HTTP {code}")
        if code in (401, 403):
            if self.token:
                what = "the admin token was rejected"
            else:
                what = "the server needs an admin token"
            return CtlError(f"unauthorized ({code}): {what}; pass --token or set FT_ADMIN_TOKEN", EXIT_REFUSED, code)
        if code == 202:
            waited = f" within --wait {wait_s:g} s" if wait_s is not None else ""
            return CtlError(f"not finished ({code}): the rebuild did not end{waited}: {msg}; it goes on in the "
                            f"server: follow it with `ft ctl history` or `ft ctl cache`", EXIT_REFUSED, code)
        if code == 504:  # the server stopped waiting for running requests: nothing was rebuilt
            return CtlError(f"not done (504): {msg}; nothing was changed", EXIT_REFUSED, code)
        if code == 404:
            return CtlError(f"not found (404): {self.url} has no {path} ({msg}); is --url pointing at `ft serve` "
                            f"of this version?", EXIT_REFUSED, code)
        if code == 409:
            hint = " (follow it with `ft ctl history`)" if "another rebuild" in msg else ""
            return CtlError(f"refused (409): {msg}{hint}", EXIT_REFUSED, code)
        if code in (400, 422):
            if action == "ladder":
                hint = "pick a rung of the ladder (`ft ctl cache` lists them)"
            elif action == "resize":
                hint = resize_hint(msg)
            else:
                hint = "check the request"
            return CtlError(f"refused ({code}): {msg}; {hint}", EXIT_REFUSED, code)
        if code == 501:
            what = "the automatic ladder" if action == "ladder" else "live resize"
            return CtlError(f"not supported (501): {msg}; this server does not implement {what} yet: restart "
                            f"`ft serve` with the sizes you want", EXIT_REFUSED, code)
        if code == 503 and (action or "rolled back" in msg):
            # the seed's line, which scripts match, then what to do
            return CtlError(f"HTTP 503: {msg}", EXIT_REFUSED, code, seed_line=True,
                            detail=("ft ctl: the server kept serving at the old sizes (`ft ctl history` has the "
                                    "details)",))
        if code == 503:
            return CtlError(f"unavailable (503): {msg}; the server is not ready: retry shortly", EXIT_REFUSED, code)
        if 400 <= code < 500:
            return CtlError(f"refused ({code}): {msg}", EXIT_REFUSED, code)
        return CtlError(f"server error ({code}): {msg}; see the `ft serve` log", EXIT_REFUSED, code)


def resize_hint(reason: str) -> str:
    """What to do about a refused resize, from the constraint its reason names."""
    if "running" in reason:
        return "requests hold that much now: retry with --wait, or when they end"
    if "floor" in reason or "below" in reason:
        return "the floor is what the server needs to keep serving: pick a size at or above it"
    if "above the experts" in reason:
        return "the model has no more experts than that"
    if "budget" in reason:
        return "the sizes together exceed the budget: shrink another pool in the same call, or pick smaller sizes"
    return "pick a size inside the range `ft ctl cache` shows"


def dumps(data: Any) -> str:
    """The pretty JSON that `--json` prints."""
    return json.dumps(data, indent=2, ensure_ascii=False)
