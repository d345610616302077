"""HTTP errors in OpenAI's shape: {"error": {"message", "type", "code"}}, and the handlers that
turn validation failures and unexpected exceptions into 4xx/5xx bodies (never a bare 500 page)."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("ft.server")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type_, headers


def json_error(status: int, message: str, type_: str = "invalid_request_error", headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "code": status}}, status_code=status,
                        headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        msg = err.get("msg", "invalid")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "invalid request: " + "; ".join(parts[:5])


def _allowed_methods(request: Request) -> list[str]:
    """The methods every route of the request's path takes (Starlette's partial matches)."""
    from starlette.routing import Match

    def walk(routes) -> set[str]:
        found: set[str] = set()
        for route in routes:
            inner = getattr(route, "original_router", None)  # an included router (FastAPI's wrapper)
            if inner is not None:
                found |= walk(inner.routes)
                continue
            match, _ = route.matches(request.scope)
            if match in (Match.FULL, Match.PARTIAL):
                found |= set(getattr(route, "methods", None) or ())
        return found

    return sorted(walk(request.app.router.routes))


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return json_error(exc.status, exc.message, exc.type, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return json_error(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        # NOTE: exc.headers carries `Allow` on a 405 (HTTP requires it): Starlette names the first route
        # of the path alone; every route of the path is asked here (GET and POST /admin/cache)
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            methods = _allowed_methods(request)
            if methods:
                headers["Allow"] = ", ".join(methods)
        return json_error(exc.status_code, str(exc.detail),
                          "not_found_error" if exc.status_code == 404 else "invalid_request_error",
                          headers=headers or None)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        # NOTE: the body says nothing about the code (no exception type, no paths); the log has it all
        ref = uuid.uuid4().hex[:12]
        log.exception("unexpected error (ref %s)", ref)
        return json_error(500, f"internal error (ref {ref}: the server log has the details)", "internal_error")
