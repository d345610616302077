"""The FastAPI application: OpenAI routes, admin routes, utility routes (/tokenize, /detokenize,
/version, /v1/models/{id}), /health and /metrics around one engine loop."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from ft.server import admin_routes, errors, openai_routes, util_routes
from ft.server.engine_loop import EngineLoop
from ft.server.guard import Guard
from ft.server.metrics import Metrics


@dataclass
class ServerState:
    loop: EngineLoop
    model_name: str
    api_key: str | None = None
    admin_token: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    drain_s: float = 30.0
    body_timeout_s: float = 30.0  # a request body that stops arriving for this long gets a 408
    allow_client_chat_template: bool = False  # chat_template_kwargs.chat_template from clients (runs their Jinja)
    prompt_timeout_s: float = 30.0  # chat template + tokenization of one request, in a worker thread
    rebuilding: bool = False  # a rebuild is queued or running on the engine thread
    metrics: Metrics | None = None  # None: a registry whose series carry model_name (built here)
    started_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = Metrics(self.model_name, util_routes.build_info())

    @property
    def tokenizer(self):
        return self.loop.engine.tokenizer

    @property
    def context_limit(self) -> int:
        return self.loop.engine.context_limit if self.loop.engine else 0

    @property
    def servable_context(self) -> int:
        """Tokens a request admitted now can reach (`Engine.servable_context`; read-only arithmetic
        on the pools' sizes, safe off the engine thread)."""
        return self.loop.engine.servable_context if self.loop.engine else 0

    def context_reason(self, limit: int) -> str:
        return self.loop.engine.context_reason(limit) if self.loop.engine else "the engine is not ready"


def create_app(state: ServerState, start_loop: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if start_loop:
            state.loop.start()
        yield
        state.loop.stop(drain_s=state.drain_s)

    app = FastAPI(title="FreeToken", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ft = state
    # the admin cache state, published by the engine thread while `ft top` (GET /admin/events) reads it
    state.loop.publish_view("cache_state", "serving", state.model_name)
    errors.install(app)

    app.add_middleware(Guard, state=state, body_timeout_s=state.body_timeout_s)

    @app.get("/health")
    async def health():
        if state.loop.state == "serving":
            failure = getattr(state.loop.engine, "tp_failure", None)  # a tensor-parallel rank exited
            if failure:
                return JSONResponse({"status": "failed", "error": failure}, status_code=503)
            degraded = state.loop.engine.cache.degraded  # a str set on the engine thread: read as is
            return {"status": "degraded", "degraded": degraded} if degraded else {"status": "ok"}
        body = {"status": state.loop.state}
        if state.loop.error is not None:
            body["error"] = str(state.loop.error)
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics():
        # the figures the engine thread last published: a scrape never waits for a step
        snap = state.loop.stats() if state.loop.state == "serving" else None
        return Response(state.metrics.render(snap), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(openai_routes.router)
    app.include_router(util_routes.router)
    app.include_router(admin_routes.router)
    app.openapi = lambda: _openapi(app)
    return app


ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "integer"}}}},
}


ERROR_DESCRIPTIONS = {
    400: "Invalid request (malformed JSON, wrong types, values out of range, a field FreeToken refuses)",
    401: "Missing or wrong API key (/v1, /tokenize, /detokenize) or admin token (/admin)",
    404: "The model named is not this server's",
    408: "The request body did not arrive in time",
    409: "Another rebuild is running, the KV ladder is off, or the mamba pool is on demand",
    413: "The request body is over the limit",
    422: "The target is outside the reachable ranges (nothing was touched)",
    503: "The engine is not serving (loading, draining or failed), or the request or rebuild failed "
         "(a rebuild is rolled back)",
    504: "Running or queued requests still held what the resize needs when wait_s ended",
}
"""Every error status the server answers with the error shape, and when."""

ROUTE_ERRORS: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/completions"): (404,), ("post", "/v1/chat/completions"): (404,),
    ("post", "/tokenize"): (404,), ("post", "/detokenize"): (404,), ("get", "/v1/models/{model_id}"): (404,),
    ("post", "/admin/cache"): (409, 422, 503, 504), ("post", "/admin/ladder"): (409, 422, 503),
    ("get", "/admin/cache/history"): (503,), ("get", "/admin/requests"): (400, 503), ("get", "/admin/events"): (400,),
}
"""Statuses a route answers beyond those of its kind (`_error_codes`)."""

STREAMS = ("/v1/completions", "/v1/chat/completions", "/admin/events")
"""Routes that answer server-sent events (the completions when the body asks for `stream`)."""


def _error_codes(method: str, path: str) -> set[int]:
    """The error statuses of one operation: a body's limits and validation, the API key and the engine's
    state on /v1 and the tokenizer routes (`ft.server.guard`), the admin token, then ROUTE_ERRORS."""
    from ft.server.util_routes import API_KEY_PATHS

    codes = {400, 408, 413} if method in ("post", "put", "patch") else set()
    if path.startswith("/v1/") or path in API_KEY_PATHS:
        codes |= {401, 503}
    if path.startswith("/admin/"):
        codes.add(401)
    return codes | set(ROUTE_ERRORS.get((method, path), ()))


def _openapi(app: FastAPI) -> dict:
    """The OpenAPI document as the server answers: every error status an operation can answer, with
    the error shape (a body that does not validate is a 400: FastAPI would document a 422 with its own
    shape, which this server never sends), /metrics as Prometheus text, server-sent events as
    text/event-stream, /health's 503 with its own body, POST /admin/cache's 202."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)  # FastAPI's validation shape: never sent
            for code in sorted(_error_codes(method, path)):
                responses[str(code)] = {"description": ERROR_DESCRIPTIONS[code], **error}
            ok = responses.setdefault("200", {"description": "Successful Response"})
            if path in STREAMS:
                ok.setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
    paths = schema.get("paths", {})
    if "/metrics" in paths:
        paths["/metrics"]["get"]["responses"]["200"]["content"] = {
            "text/plain; version=0.0.4; charset=utf-8": {"schema": {"type": "string"}}}
    if "/health" in paths:
        paths["/health"]["get"]["responses"]["503"] = {
            "description": "Not serving: loading, draining or failed (with the reason)",
            "content": {"application/json": {"schema": HEALTH_SCHEMA}}}
        paths["/health"]["get"]["responses"]["200"]["content"] = {"application/json": {"schema": HEALTH_SCHEMA}}
    if "/admin/cache" in paths:
        paths["/admin/cache"]["post"]["responses"]["202"] = {
            "description": "The rebuild still runs after wait_s (watch GET /admin/cache)",
            "content": {"application/json": {"schema": ACCEPTED_SCHEMA}}}
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    comps.pop("HTTPValidationError", None)
    comps.pop("ValidationError", None)
    comps["Error"] = ERROR_SCHEMA
    app.openapi_schema = schema
    return schema


HEALTH_SCHEMA = {"type": "object", "required": ["status"], "properties": {
    "status": {"type": "string"}, "error": {"type": "string"}, "degraded": {"type": "string"}}}
ACCEPTED_SCHEMA = {"type": "object", "required": ["status", "message"], "properties": {
    "status": {"type": "string", "enum": ["accepted"]}, "message": {"type": "string"}}}
