"""The rollout server's FastAPI app: routes translate between ``common.protocol`` and the engine.

    GET  /health                 HealthResponse; 200 only when status == "ok" (503 while loading,
                                 syncing or in error, body still a HealthResponse)
    POST /infer                  InferRequest -> InferResponse (ver of the whole batch)
    POST /sync/init|begin|commit|abort    the weight-sync state machine (rollout_server.sync)
    POST /sync/bucket            safetensors body + X-Tandem-Bucket JSON header (SyncBucketHeader)
    POST /sync/update            NCCL bucket announcement (vLLM engine only)
    GET  /sync/digest            SyncDigestResponse: exact weight digest per engine worker (409 mid-sync)
    GET  /metrics                Prometheus text (rollout_server.metrics)
    /v1/models, /v1/completions, /v1/chat/completions   OpenAI subset (rollout_server.openai_routes)

Every error is an ``ErrorResponse``: validation problems are 4xx naming the dotted field; only an
engine failure on a valid request is a 500. ``/sync/*`` need ``Authorization: Bearer <token>``
when ``rollout_server.auth_token`` is set (checked before the body is looked at).

The engine starts in a background task of the lifespan, so the socket answers ``/health`` with
``loading`` while weights load; a failed start sets ``error`` and calls ``on_fatal`` (the entry
point stops the server with exit code 3).

What this module does not know: how the engine generates, or how the fence is built (sync.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.protocol import (
    BUCKET_HEADER,
    SCHEMA_VERSION,
    ErrorResponse,
    HealthResponse,
    InferRequest,
    InferResponse,
    SyncAbortRequest,
    SyncAbortResponse,
    SyncBeginRequest,
    SyncBeginResponse,
    SyncBucketHeader,
    SyncBucketResponse,
    SyncCommitRequest,
    SyncCommitResponse,
    SyncDigestResponse,
    SyncInitRequest,
    SyncInitResponse,
)
from rollout_server.engines.base import Engine, EngineInputError
from rollout_server.errors import ApiError
from rollout_server.fence import AdmissionTimeout, Fence
from rollout_server.metrics import RequestCounter, ServerMetrics
from rollout_server.sync import SyncController

log = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 409, 413, 422, 500, 503, 504)
}


class ServerState:
    """What /health reports besides the fence: engine loading, ready, or failed."""

    def __init__(self) -> None:
        self.status = "loading"
        self.error: str | None = None
        self.started_at = time.time()


def _server_cfg(cfg: Any) -> Any:
    return getattr(cfg, "rollout_server", cfg)


def build_app(engine: Engine, cfg: Any, *, on_fatal: Callable[[str], None] | None = None,
              engine_started: bool = False) -> FastAPI:
    """The app around ``engine``; ``cfg`` is the whole Config or its ``rollout_server`` part.

    ``engine_started=True`` skips ``engine.start()`` (in-process tests that already started it).
    """
    srv = _server_cfg(cfg)
    metrics = ServerMetrics()
    fence = Fence(on_wait=metrics.admission_wait.observe)
    metrics.bind(fence)
    sync = SyncController(engine, fence, idle_timeout_s=srv.sync_idle_timeout_s, metrics=metrics)
    state = ServerState()

    async def start_engine() -> None:
        try:
            if not engine_started:
                await engine.start()
            state.status = "ok"
            log.info("serving %s with the %s engine at ver %d", engine.model_path, engine.name, fence.ver)
        except Exception as exc:  # noqa: BLE001 - any start failure is fatal and reported
            state.status, state.error = "error", f"{type(exc).__name__}: {exc}"
            log.error("engine %s failed to start: %s", engine.name, state.error, exc_info=not isinstance(exc, ImportError))
            if on_fatal is not None:
                on_fatal(state.error)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [asyncio.create_task(start_engine(), name="engine-start"),
                 asyncio.create_task(sync.watchdog(), name="sync-watchdog")]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await sync.shutdown()
            await engine.stop()

    app = FastAPI(title="tandem rollout server", version=str(SCHEMA_VERSION), lifespan=lifespan)
    app.state.engine, app.state.fence, app.state.sync, app.state.metrics, app.state.server = (
        engine, fence, sync, metrics, state)

    # ------------------------------------------------------------------ errors

    def error_json(request: Request, body: ErrorResponse, status: int, headers: dict[str, str] | None = None):
        if request.url.path.startswith("/v1/"):  # OpenAI clients read {"error": {"message", ...}}
            content: dict[str, Any] = {"error": {"message": body.message, "type": "invalid_request_error"
                                                 if status < 500 else "server_error", "param": body.field,
                                                 "code": body.error}}
        else:
            content = body.model_dump()
        return JSONResponse(content, status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_json(request, exc.body, exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for e in exc.errors():
            loc = [str(p) for p in e.get("loc", ())]
            if loc and loc[0] == "body":
                loc = loc[1:]
            problems.append((".".join(loc) or "body", e.get("msg", "invalid"), e.get("type", "")))
        malformed = any(t == "json_invalid" for _, _, t in problems)
        if malformed:
            field, message = "body", "malformed JSON: " + "; ".join(m for _, m, t in problems if t == "json_invalid")
        else:
            field, message = problems[0][0], "; ".join(f"{f}: {m}" for f, m, _ in problems)
        body = ErrorResponse(error="bad_request", field=field, message=message,
                             hint="see the request schema at /docs" if not malformed else "send a JSON object")
        return error_json(request, body, 400 if malformed else 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = ErrorResponse(error="bad_request", message=f"{request.method} {request.url.path}: {exc.detail}")
        return error_json(request, body, exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        body = ErrorResponse(error="engine_error", message=f"{type(exc).__name__}: {exc}")
        return error_json(request, body, 500)

    def require_ready() -> None:
        if state.status != "ok" or sync.error:
            why = sync.error or state.error or "the engine is still loading"
            raise ApiError(503, "not_ready", f"{engine.name} engine not ready: {why}", headers={"Retry-After": "1"})

    # ------------------------------------------------------------------ serving

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health() -> JSONResponse:
        if state.status != "ok" or sync.error:
            status = "error" if (state.status == "error" or sync.error) else "loading"
        else:
            status = "syncing" if not fence.is_open else "ok"
        body = HealthResponse(status=status, engine=engine.name, model=engine.model_path, ver=fence.ver,
                              sync_state=sync.state, world_size=engine.world_size(),
                              engine_info=engine.health_info() if state.status == "ok" else {})
        return JSONResponse(body.model_dump(by_alias=True), status_code=200 if status == "ok" else 503)

    @app.post("/infer", response_model=InferResponse, responses=_ERRORS)
    async def infer(req: InferRequest) -> InferResponse:
        require_ready()
        if len(req.items) > srv.max_batch_items:
            raise ApiError(413, "bad_request", f"{len(req.items)} items exceed rollout_server.max_batch_items "
                           f"= {srv.max_batch_items}", field="items", hint="send smaller batches")
        ticket, outputs = await run_admitted(lambda: engine.generate(req.items, req.sampling), req.min_ver)
        return InferResponse(ver=ticket.ver, outputs=outputs, engine=engine.name,
                             elapsed_s=time.monotonic() - ticket.admitted_at)

    async def run_admitted(work: Callable[[], Any], min_ver: int | None = None) -> tuple[Any, Any]:
        """Run engine work under an admission ticket; map engine errors to HTTP ones; count tokens."""
        try:
            ticket, outputs = await fence.run(work, min_ver=min_ver, timeout_s=srv.admission_timeout_s)
        except EngineInputError as exc:
            raise ApiError(400, "bad_request", str(exc), field=exc.field) from None
        except AdmissionTimeout as exc:
            raise ApiError(503, "not_ready", f"/infer {exc}", headers={"Retry-After": "1"}) from None
        metrics.observe_batch(len(outputs), sum(len(o.prompt_token_ids) for o in outputs),
                              sum(len(o.token_ids) for o in outputs), time.monotonic() - ticket.admitted_at)
        return ticket, outputs


    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    # ------------------------------------------------------------------ weight sync (admin)

    async def require_token(request: Request) -> None:
        if not srv.auth_token:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), srv.auth_token.encode()):
            raise ApiError(401, "unauthorized", "/sync/* need 'Authorization: Bearer <rollout_server.auth_token>'"
                           + (" (the token given is wrong)" if token else " (none given)"),
                           field="Authorization", headers={"WWW-Authenticate": "Bearer"})

    admin = APIRouter(prefix="/sync", dependencies=[Depends(require_token)], responses=_ERRORS)

    @admin.post("/init", response_model=SyncInitResponse)
    async def sync_init(req: SyncInitRequest) -> SyncInitResponse:
        require_ready()
        return await sync.init(req)

    @admin.post("/begin", response_model=SyncBeginResponse)
    async def sync_begin(req: SyncBeginRequest) -> SyncBeginResponse:
        return await sync.begin(req)

    @admin.post("/bucket", response_model=SyncBucketResponse,
                openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}})
    async def sync_bucket(request: Request) -> SyncBucketResponse:
        raw = request.headers.get(BUCKET_HEADER)
        if raw is None:
            raise ApiError(400, "bad_request", f"missing the {BUCKET_HEADER} header (a JSON SyncBucketHeader)",
                           field=BUCKET_HEADER)
        try:
            header = SyncBucketHeader.model_validate_json(raw)
        except ValidationError as exc:
            err = ErrorResponse.from_validation_error(exc)
            raise ApiError(422, "bad_request", f"{BUCKET_HEADER}: {err.message}",
                           field=f"{BUCKET_HEADER}.{err.field}" if err.field else BUCKET_HEADER) from None
        limit = srv.max_bucket_mb * 2**20
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, "bad_request", f"bucket of {int(length)} bytes exceeds rollout_server.max_bucket_mb "
                           f"= {srv.max_bucket_mb}", field="body", hint="lower rollout_matching.vllm.sync.bucket_mb")
        with sync.receiving(header.session):
            blob = await request.body()
        return await sync.bucket(header, blob)

    @admin.post("/update", response_model=SyncBucketResponse)
    async def sync_update(header: SyncBucketHeader) -> SyncBucketResponse:
        if "nccl" not in sync.engine_transports():
            raise ApiError(400, "bad_request", f"/sync/update (NCCL) is not served by the {engine.name} engine; "
                           "send safetensors buckets to /sync/bucket", field="transport")
        return await sync.update(header)  # pragma: no cover - vLLM engine only

    @admin.post("/commit", response_model=SyncCommitResponse)
    async def sync_commit(req: SyncCommitRequest) -> SyncCommitResponse:
        return await sync.commit(req)

    @admin.post("/abort", response_model=SyncAbortResponse)
    async def sync_abort(req: SyncAbortRequest) -> SyncAbortResponse:
        return await sync.abort(req)

    def refuse_mid_sync(why: str) -> None:
        """409 while a session is open (weights may be half-staged or, with vLLM, half-loaded)."""
        s = sync.session
        if s is not None:
            raise ApiError(409, "sync_state", f"/sync/digest {why}: sync session {s.id} from {s.client!r} is "
                           f"{sync.state.value}, the weights are mid-update",
                           hint="retry once the session commits or aborts (GET /health says sync_state idle)")

    @admin.get("/digest", response_model=SyncDigestResponse, responses={501: {"model": ErrorResponse}})
    async def sync_digest() -> SyncDigestResponse:
        require_ready()
        refuse_mid_sync("is refused")
        ver = fence.ver
        try:
            digests = await engine.weights_digest()
        except NotImplementedError as exc:
            raise ApiError(501, "not_implemented", str(exc) or f"the {engine.name} engine has no weight digest",
                           hint="each commit's sampled fingerprint is in SyncCommitResponse and the log") from None
        # A session that opened, committed or failed while the engine read: the digest may mix versions.
        refuse_mid_sync("was overtaken")
        require_ready()
        if fence.ver != ver:
            raise ApiError(409, "sync_state", f"/sync/digest was overtaken: a commit moved ver {ver} -> {fence.ver} "
                           "while the weights were read", hint="retry")
        return SyncDigestResponse(engine=engine.name, ver=ver, digests=digests)

    app.include_router(admin)

    from rollout_server.openai_routes import openai_router

    app.include_router(openai_router(engine, run_admitted, require_ready))
    app.add_middleware(RequestCounter, metrics=metrics)
    return app

