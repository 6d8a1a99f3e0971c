"""The rollout server's FastAPI app: :func:`build_app` assembles the engine, the fence, the sync controller,
the trust boundary, metrics, error handling and the routers (``rollout_server/routes/``), which translate
between ``common.wire.http`` and the engine.

    GET  /health, GET /metrics   routes/health.py   HealthResponse (200 only when status == "ok"); Prometheus text
    POST /infer                  routes/infer.py    InferRequest -> InferResponse (ver of the whole batch)
    /v1/models, /v1/completions, /v1/chat/completions   routes/openai.py   OpenAI subset
    /sync/init|begin|bucket|update|ipc|commit|abort, GET /sync/digest   routes/sync.py   weight sync (admin)

Routers hold nothing: each handler gets the app's :class:`rollout_server.state.ServerState` through the
``Server`` dependency (``app.state.server``), as vLLM's entrypoints read ``request.app.state``.

Every error is an ``ErrorResponse``: a body that breaks the published schema is a 422 naming the dotted
field, one that fits it but breaks a rule JSON Schema cannot state a 400; only an engine failure on a
valid request is a 500 (answered by ``errors.UnexpectedErrors``, so the connection stays open). A failed
``/sync/*`` request goes through the one failure rule, ``SyncController.request_failed``: when it names
the open session, the session ends and the fence reopens. The trust boundary runs before any route
(``rollout_server/guard.py``): ``/sync/*`` need ``Authorization: Bearer <token>`` when
``rollout_server.auth_token`` is set (checked before a byte of the body is read), every body is read
under a size cap and a read deadline, a request's images under a pixel budget, and a client that
disconnects cancels its generation.

The engine starts in a background task of the lifespan, so the socket answers ``/health`` with
``loading`` while weights load; a failed start sets ``error`` and calls ``on_fatal`` (the entry
point stops the server with exit code 3).

What this module does not know: how the engine generates, how the fence is built (sync.py), or what a
route does with a request (routes/).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.wire.base import content_only, error_location
from common.wire.codec import SCHEMA_VERSION
from common.wire.http import ErrorResponse
from rollout_server.engines.base import Engine
from rollout_server.errors import ApiError, UnexpectedErrors, error_content
from rollout_server.fence import Fence
from rollout_server.guard import Limits, RequestGuard
from rollout_server.metrics import RequestCounter, ServerMetrics
from rollout_server.routes import health, infer, openai, sync as sync_routes
from rollout_server.state import ServerState
from rollout_server.weight_sync.session import SyncController


def build_app(engine: Engine, cfg: Any, *, on_fatal: Callable[[str], None] | None = None,
              engine_started: bool = False) -> FastAPI:
    """The app around ``engine``; ``cfg`` is the whole Config or its ``rollout_server`` part.

    ``engine_started=True`` skips ``engine.start()`` (in-process tests that already started it).
    """
    srv = getattr(cfg, "rollout_server", cfg)
    limits = Limits.of(srv)
    metrics = ServerMetrics()
    fence = Fence(on_wait=metrics.admission_wait.observe)
    metrics.bind(fence)
    engine.on_cancelled_tokens = metrics.observe_cancelled_tokens
    sync = SyncController(engine, fence, idle_timeout_s=srv.sync_idle_timeout_s, metrics=metrics)
    server = ServerState(engine=engine, fence=fence, sync=sync, metrics=metrics, limits=limits,
                         admission_timeout_s=srv.admission_timeout_s)

    app = FastAPI(title="tandem rollout server", version=str(SCHEMA_VERSION),
                  lifespan=functools.partial(lifespan, already_started=engine_started, on_fatal=on_fatal))
    app.state.server = server
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    # Routes are matched in order: /v1 before /sync, or every /v1 request would first be tried against each
    # /sync route (sync requests are a few per weight update).
    for routes in (health, infer, openai, sync_routes):
        app.include_router(routes.router)
    app.add_middleware(RequestGuard, limits=limits)  # inside the counter: its 401/408/413s are counted
    app.add_middleware(UnexpectedErrors)  # inside the counter too: its 500s are counted
    app.add_middleware(RequestCounter, metrics=metrics)
    return app


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI, *, already_started: bool,
                   on_fatal: Callable[[str], None] | None) -> AsyncIterator[None]:
    """Start the engine and the sync watchdog in the background; on shutdown end an open session, stop the engine."""
    server: ServerState = app.state.server
    tasks = [asyncio.create_task(server.start_engine(already_started=already_started, on_fatal=on_fatal),
                                 name="engine-start"),
             asyncio.create_task(server.sync.watchdog(), name="sync-watchdog")]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.sync.shutdown()
        await server.engine.stop()


# ---------------------------------------------------------------------- errors


def error_json(request: Request, body: ErrorResponse, status: int,
               headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_content(request.url.path, body, status), status_code=status, headers=headers)


async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_json(request, exc.body, exc.status, exc.headers)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = []
    for e in exc.errors():
        loc = error_location(e)
        if loc and loc[0] == "body":
            loc = loc[1:]
        problems.append((".".join(loc) or "body", e.get("msg", "invalid"), e.get("type", "")))
    malformed = any(t == "json_invalid" for _, _, t in problems)
    if malformed:
        field, message = "body", "malformed JSON: " + "; ".join(m for _, m, t in problems if t == "json_invalid")
    else:
        field, message = problems[0][0], "; ".join(f"{f}: {m}" for f, m, _ in problems)
    # 422: the body breaks the published schema; 400: it fits the schema but breaks a rule between
    # fields that JSON Schema cannot state (common.wire.base.ContentError), or is not JSON at all.
    status = 400 if malformed or content_only(exc.errors()) else 422
    error = ApiError(status, "bad_request", message, field=field,
                     hint="see the request schema at /openapi.json" if not malformed else "send a JSON object")
    if request.url.path.startswith("/sync/"):  # a session's request that fails validation ends it too
        sync: SyncController = request.app.state.server.sync
        error = await sync.request_failed(sync_routes.named_session(getattr(exc, "body", None)), error)
    return error_json(request, error.body, error.status)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    body = ErrorResponse(error="bad_request", message=f"{request.method} {request.url.path}: {exc.detail}")
    return error_json(request, body, exc.status_code, exc.headers)  # a 405's headers carry Allow
