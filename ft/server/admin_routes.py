"""Admin routes: cache state, resize (dry run, validation), history, live events, ladder, requests."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, WithJsonSchema

from ft.errors import RebuildFailed, RebuildRefused
from ft.schemas import CacheState, Event, History, JsonInt, LiveRates, RequestList, ResizePlan, ResizeRequest
from ft.server.closing_stream import ClosingStreamingResponse
from ft.server.errors import ApiError


def require_admin(request: Request) -> None:
    token = request.app.state.ft.admin_token
    if not token:
        return
    got = request.headers.get("authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
        raise ApiError(401, "admin routes need the admin token: Authorization: Bearer <token>", "authentication_error")


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


def _st(request: Request):
    return request.app.state.ft


async def _engine_call(st, name: str, *args) -> Any:
    """The engine's admin command `name` (`ft.engine.core.admin.EngineAdmin`) with plain data; 503 unless serving."""
    if st.loop.state != "serving":
        raise ApiError(503, f"the engine is {st.loop.state}", "server_unavailable")
    return await st.loop.command(name, *args)


@router.get("/cache", response_model=CacheState)
async def get_cache(request: Request) -> CacheState:
    st = _st(request)
    if st.loop.state != "serving":
        return CacheState(state="starting", model=st.model_name)
    return await _engine_call(st, "cache_state", _state_of(st), st.model_name)


def _state_of(st) -> str:
    return "rebuilding" if st.rebuilding else st.loop.state


@router.post("/cache", response_model=CacheState | ResizePlan)
async def post_cache(body: ResizeRequest, request: Request):
    """Resize live. 200 new state (dry run: the plan); 422 outside the reachable ranges (nothing
    touched); 503 rolled back; 409 while another rebuild runs, or for a mamba size when that pool is
    on demand; 202 when wait_s ends first."""
    st = _st(request)
    if body.mamba is not None and await _engine_call(st, "mamba_on_demand"):
        # NOTE: a manual size would be undone by the pool's own next shrink or grow (`MambaOnDemand`)
        raise ApiError(409, "the linear-attention pool is on demand (--mamba-on-demand): it grows for waiting "
                       "requests and gives idle slots back on its own; resize moe and kv only", "conflict")
    if body.dry_run:
        return await _engine_call(st, "resize_plan", body.moe, body.kv, body.mamba)
    try:
        state = await run_rebuild(st, ("resize", body.moe, body.kv, body.mamba, st.model_name), body.wait_s,
                                  ("fits_when_idle", body.moe, body.kv, body.mamba))
    except ApiError as refused:
        if refused.status == 422:  # the refusal names the rounded size: say where it came from
            notes = await _engine_call(st, "rounding_notes", body.kv)
            if notes:
                refused.message += f" ({'; '.join(notes)})"
        raise
    if isinstance(state, CacheState):
        state.notes = await _engine_call(st, "rounding_notes", body.kv)
    return state


class _WaitExpired(Exception):
    pass


async def run_rebuild(st, rebuild: tuple, wait_s: float | None, fits_when_idle: tuple | None = None):
    """Run a rebuild on the engine thread; shared by resizes and ladder moves. `rebuild`: the engine
    command and its arguments (`("resize", moe, kv, mamba, model)`, `("set_ladder", ...)`), which
    answers the state after it.

    A target that only running requests stand in the way of (the command `fits_when_idle`, with its
    arguments) waits for them, up to wait_s, with admission paused so that they drain; then 504 if
    they still hold it."""
    if st.rebuilding:
        raise ApiError(409, "another rebuild is running; retry when it ends", "conflict")
    if st.loop.state != "serving":
        raise ApiError(503, f"the engine is {st.loop.state}", "server_unavailable")
    st.rebuilding = True

    async def attempt():
        deadline = time.monotonic() + (wait_s or 0.0)
        try:
            while True:
                try:
                    return await st.loop.command(*rebuild)
                except RebuildRefused:
                    idle_fit = fits_when_idle is not None and wait_s and await st.loop.command(*fits_when_idle)
                    if not idle_fit:
                        raise
                    if time.monotonic() >= deadline:
                        raise _WaitExpired() from None
                    await st.loop.command("pause_admission", True)
                    await asyncio.sleep(0.05)
        finally:
            if st.loop.state == "serving":
                await st.loop.command("pause_admission", False)
            st.rebuilding = False

    task = asyncio.ensure_future(attempt())
    try:
        return await asyncio.wait_for(asyncio.shield(task), wait_s + 1.0) if wait_s is not None else await task
    except asyncio.TimeoutError:
        return JSONResponse({"status": "accepted", "message": f"the rebuild is still running after {wait_s} s; "
                             "watch GET /admin/cache or /admin/cache/history"}, status_code=202)
    except _WaitExpired:
        raise ApiError(504, f"waited {wait_s:g} s but running or queued requests still hold what the target "
                       "needs; retry later or with a longer wait", "timeout") from None
    except RebuildRefused as e:
        raise ApiError(422, str(e), "out_of_range") from None
    except RebuildFailed as e:
        raise ApiError(503, f"rebuild failed and was rolled back: {e}", "rebuild_failed") from None


@router.get("/cache/history", response_model=History)
async def get_history(request: Request) -> History:
    st = _st(request)
    return await _engine_call(st, "history")


@router.get("/requests", response_model=RequestList)
async def get_requests(request: Request, limit: int = Query(200, ge=1, le=10000)) -> RequestList:
    """The running requests (batch order), then the waiting ones (queue order): id, state (waiting,
    prefill, decode), prompt and generated tokens, KV pages held and age; none before serving."""
    st = _st(request)
    if st.loop.state != "serving":
        return RequestList()
    return await _engine_call(st, "requests", limit)


class LadderRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # `{"rung": true}` is not rung 1
    auto: bool | None = None
    # an index from 0, or a step; the schema's enum says what validation takes (`""` is neither)
    rung: JsonInt | Annotated[str, WithJsonSchema({"type": "string", "enum": ["up", "down"]})] | None = None


@router.post("/ladder", response_model=CacheState)
async def post_ladder(body: LadderRequest, request: Request):
    """Auto on/off and manual rung moves (a rung move is a rebuild: same 422/503/409 answers)."""
    st = _st(request)
    if isinstance(body.rung, str) and body.rung not in ("up", "down"):
        raise ApiError(400, f"rung must be an index, 'up' or 'down', got {body.rung!r}")
    enabled = await _engine_call(st, "ladder_enabled")
    if not enabled:
        raise ApiError(409, "the KV ladder is off: start ft serve with --enable-kv-ladder", "conflict")
    if body.rung is None:
        await _engine_call(st, "set_ladder", body.auto, None, st.model_name)
        return await _engine_call(st, "cache_state", _state_of(st), st.model_name)
    return await run_rebuild(st, ("set_ladder", body.auto, body.rung, st.model_name), None)


@router.get("/events")
async def events(request: Request):
    """Server-sent events: a snapshot on connect, a `change` when the geometry or state changes,
    and a `tick` with live rates at least once a second."""
    st = _st(request)
    try:
        interval = max(0.1, float(request.query_params.get("interval", 1.0)))
    except ValueError:
        raise ApiError(400, f"interval must be a number of seconds, got {request.query_params.get('interval')!r}") \
            from None

    async def sample() -> tuple[CacheState, Any]:
        # what the engine thread published (`EngineLoop.view`, `stats`): a tick never waits for a step;
        # the first one (nothing published yet) asks the engine once
        cache, stats = st.loop.view(), st.loop.stats()
        if cache is None:
            cache = await st.loop.command("cache_state", "serving", st.model_name)
        state = _state_of(st)
        return (cache if cache.state == state else cache.model_copy(update={"state": state})), stats

    async def stream():
        last_key, last, last_t = None, None, time.monotonic()
        kind = "snapshot"
        # it ends when the server begins to shut down: an open dashboard must not hold the exit back
        while not st.loop.draining and not await request.is_disconnected():
            if st.loop.state != "serving":
                ev = Event(kind=kind, cache=CacheState(state="starting", model=st.model_name))
            else:
                cache, stats = await sample()
                now = time.monotonic()
                rates = LiveRates(kv_usage=stats.kv_used_tokens / max(1, stats.kv_tokens))
                if last is not None:
                    dt = max(1e-6, now - last_t)
                    rates.decode_tokens_per_s = (stats.generation_tokens - last.generation_tokens) / dt
                    rates.prompt_tokens_per_s = (stats.prompt_tokens - last.prompt_tokens) / dt
                    dh, dm = stats.hits - last.hits, stats.misses - last.misses
                    rates.expert_hit_rate = dh / (dh + dm) if dh + dm else cache.pools.moe.hit_rate
                    busy = sum(stats.step_seconds.values()) - sum(last.step_seconds.values())
                    rates.engine_busy = min(1.0, max(0.0, busy / dt))  # (the figures' own instants differ a little)
                    rates.slow_steps = max(0, sum(stats.slow_steps.values()) - sum(last.slow_steps.values()))
                last, last_t = stats, now
                key = (cache.state, cache.pools.moe.size, cache.pools.kv.size, cache.pools.mamba.size)
                if kind != "snapshot" and key != last_key:
                    kind = "change"
                last_key = key
                ev = Event(kind=kind, cache=cache, rates=rates)
            yield f"event: {ev.kind}\ndata: {json.dumps(ev.model_dump(mode='json', by_alias=True))}\n\n"
            kind = "tick"
            for _ in range(max(1, round(interval / 0.1))):  # (a drain that begins meanwhile ends it within 0.1 s)
                if st.loop.draining:
                    break
                await asyncio.sleep(interval / max(1, round(interval / 0.1)))

    # closed as soon as the client leaves (as the generation streams), not when the collector finds it
    return ClosingStreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
