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
from ft.server.metrics import Metrics, engine_snapshot


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
        snap = await state.loop.acall(engine_snapshot) if state.loop.state == "serving" else {}
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


def _openapi(app: FastAPI) -> dict:
    """The OpenAPI document as the server answers: a body that does not validate is a 400 with the
    error shape (FastAPI would document a 422 with its own shape, which this server never sends)."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path in schema.get("paths", {}).values():
        for op in path.values():
            responses = op.setdefault("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = {"description": "Invalid request (malformed JSON, wrong types, values out of "
                                                   "range)", **error}
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    comps.pop("HTTPValidationError", None)
    comps.pop("ValidationError", None)
    comps["Error"] = ERROR_SCHEMA
    app.openapi_schema = schema
    return schema
