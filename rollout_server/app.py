"""The rollout server's FastAPI app: routes translate between ``common.wire.http`` and the engine.

    GET  /health                 HealthResponse; 200 only when status == "ok" (503 while loading,
                                 syncing or in error, body still a HealthResponse)
    POST /infer                  InferRequest -> InferResponse (ver of the whole batch)
    POST /sync/init|begin|commit|abort    the weight-sync state machine (rollout_server.sync)
    POST /sync/bucket            packed raw tensor bytes + X-Tandem-Bucket JSON header (SyncBucketHeader)
    POST /sync/update            NCCL bucket announcement (vLLM engine only)
    POST /sync/ipc               a bucket the server copies from the learner's shared buffer (SyncIpcRequest)
    GET  /sync/digest            SyncDigestResponse: exact weight digest per engine worker (409 mid-sync)
    GET  /metrics                Prometheus text (rollout_server.metrics)
    /v1/models, /v1/completions, /v1/chat/completions   OpenAI subset (rollout_server.openai_routes)

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

What this module does not know: how the engine generates, or how the fence is built (sync.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.wire.sync import (BUCKET_HEADER, MAX_VER_JUMP, SyncAbortRequest, SyncAbortResponse, SyncBeginRequest,
                              SyncBeginResponse, SyncBucketHeader, SyncBucketResponse, SyncCommitRequest,
                              SyncCommitResponse, SyncDigestResponse, SyncInitRequest, SyncInitResponse, SyncIpcRequest)
from common.wire.codec import SCHEMA_VERSION
from common.wire.http import ErrorResponse, HealthResponse, InferRequest, InferResponse
from common.wire.base import content_only, error_location
from common.tensors import packed as P
from rollout_server.engines.base import Engine, EngineInputError, check_prompt_lengths
from rollout_server.errors import ApiError, UnexpectedErrors, error_content
from rollout_server.fence import AdmissionTimeout, Fence
from rollout_server.guard import (CLIENT_CLOSED, Limits, RequestGuard, check_pixels, names_images, read_body,
                                  unless_disconnected)
from rollout_server.metrics import RequestCounter, ServerMetrics
from rollout_server.sync import SyncController

log = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 408, 409, 413, 422, 500, 503, 504)
}


#: ``POST /sync/bucket``'s header, as OpenAPI states it: required, a JSON :class:`SyncBucketHeader`.
BUCKET_HEADER_PARAMETER = {
    "name": BUCKET_HEADER, "in": "header", "required": True,
    "description": "The bucket's layout: a JSON SyncBucketHeader (names, dtypes, shapes, offsets into the body)",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SyncBucketHeader"}}},
}


class ServerState:
    """What /health reports besides the fence: engine loading, ready, or failed."""

    def __init__(self) -> None:
        self.status = "loading"
        self.error: str | None = None
        self.started_at = time.time()


def named_session(body: Any) -> str | None:
    """The ``session`` a /sync request names, read from a body (or a bucket header) that failed validation:
    a dict's string ``session``, or None when there is none to read."""
    if isinstance(body, (str, bytes)):  # a bucket header, or the text of a body that is not JSON
        try:
            body = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the parser's depth
            return None
    session = body.get("session") if isinstance(body, dict) else None
    return session if isinstance(session, str) else None


def _server_cfg(cfg: Any) -> Any:
    return getattr(cfg, "rollout_server", cfg)


def build_app(engine: Engine, cfg: Any, *, on_fatal: Callable[[str], None] | None = None,
              engine_started: bool = False) -> FastAPI:
    """The app around ``engine``; ``cfg`` is the whole Config or its ``rollout_server`` part.

    ``engine_started=True`` skips ``engine.start()`` (in-process tests that already started it).
    """
    srv = _server_cfg(cfg)
    limits = Limits.of(srv)
    metrics = ServerMetrics()
    fence = Fence(on_wait=metrics.admission_wait.observe)
    metrics.bind(fence)
    engine.on_cancelled_tokens = metrics.observe_cancelled_tokens
    sync = SyncController(engine, fence, idle_timeout_s=srv.sync_idle_timeout_s, metrics=metrics)
    state = ServerState()

    async def start_engine() -> None:
        try:
            if not engine_started:
                await engine.start()
            state.status = "ok"
            log.info("serving %s with the %s engine at ver %d", engine.model_path, engine.name, fence.ver)
            if not limits.auth_token:  # allowed on loopback only (common/config/server.py); say what it means
                log.info("/sync/* take no token (rollout_server.auth_token unset): any local process may push "
                         "weights; set a token on a machine shared with other users")
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
        return JSONResponse(error_content(request.url.path, body, status), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_json(request, exc.body, exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
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
            error = await sync.request_failed(named_session(getattr(exc, "body", None)), error)
        return error_json(request, error.body, error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = ErrorResponse(error="bad_request", message=f"{request.method} {request.url.path}: {exc.detail}")
        return error_json(request, body, exc.status_code, exc.headers)  # a 405's headers carry Allow

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
    async def infer(req: InferRequest, request: Request) -> Response:
        ticket, outputs = await generate(request, req.items, req.sampling, req.min_ver)
        body = InferResponse(ver=ticket.ver, outputs=outputs, engine=engine.name,
                             elapsed_s=time.monotonic() - ticket.admitted_at)
        # Serialized once, by pydantic's JSON encoder: FastAPI before 0.130 dumps the model to a dict, validates
        # it again, dumps that to JSON-able objects and json.dumps them (32 items x 128 tokens: 0.62 vs 0.10 ms).
        return Response(body.model_dump_json(), media_type="application/json")

    async def generate(request: Request, items: list[Any], sampling: Any, min_ver: int | None = None,
                       field: str = "items") -> tuple[Any, Any]:
        """/infer and /v1/*: the request's budgets, then the engine under an admission ticket, cancelled
        if the client disconnects; engine errors mapped to HTTP ones; tokens counted."""
        require_ready()
        if len(items) > limits.max_batch_items:
            raise ApiError(413, "bad_request", f"{len(items)} items exceed rollout_server.max_batch_items "
                           f"= {limits.max_batch_items}", field=field, hint="send smaller batches")
        if min_ver is not None and min_ver > fence.ver + MAX_VER_JUMP:  # no commit can bring ver there
            raise ApiError(400, "bad_request", f"min_ver {min_ver} is more than {MAX_VER_JUMP} above the server's "
                           f"ver {fence.ver}: one commit moves ver by at most that", field="min_ver",
                           hint="ask for a ver the learner has pushed (its ver_current)")
        try:  # before a ticket or an engine thread: a 1 M-id prompt costs no one anything
            check_prompt_lengths(items, sampling.max_tokens, engine.max_model_len, engine.max_request_tokens)
        except EngineInputError as exc:
            raise ApiError(exc.status, "bad_request", str(exc), field=exc.field,
                           hint="shorten the prompt or lower max_tokens") from None
        if any(names_images(it) for it in items):  # headers only, read on a thread; before a ticket is taken
            await asyncio.to_thread(check_pixels, items, limits)
        work = fence.run(lambda: engine.generate(items, sampling), min_ver=min_ver, timeout_s=srv.admission_timeout_s)
        try:
            ticket, outputs = await unless_disconnected(request.receive, work)
        except EngineInputError as exc:
            raise ApiError(exc.status, "bad_request", str(exc), field=exc.field,
                           hint="send smaller batches" if exc.status == 413 else None) from None
        except AdmissionTimeout as exc:
            raise ApiError(503, "not_ready", f"{request.url.path} {exc}", headers={"Retry-After": "1"}) from None
        except ApiError as exc:
            if exc.status == CLIENT_CLOSED:
                metrics.cancelled.labels(reason="client_disconnect").inc()
                log.info("%s: client %s disconnected; its batch of %d item(s) was cancelled", request.url.path,
                         request.client, len(items))
            raise
        metrics.observe_batch(len(outputs), sum(len(o.prompt_token_ids) for o in outputs),
                              sum(len(o.token_ids) for o in outputs), time.monotonic() - ticket.admitted_at)
        return ticket, outputs


    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format"}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    # ------------------------------------------------------------------ weight sync (admin)

    # The bearer token is checked by RequestGuard, before any body is read (FastAPI parses a body
    # before it runs a route's dependencies).
    admin = APIRouter(prefix="/sync", responses=_ERRORS)

    @admin.post("/init", response_model=SyncInitResponse)
    async def sync_init(req: SyncInitRequest) -> SyncInitResponse:
        require_ready()
        return await sync.init(req)

    @admin.post("/begin", response_model=SyncBeginResponse)
    async def sync_begin(req: SyncBeginRequest) -> SyncBeginResponse:
        return await sync.begin(req)

    @admin.post("/bucket", response_model=SyncBucketResponse,
                openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True},
                               "parameters": [BUCKET_HEADER_PARAMETER]})
    async def sync_bucket(request: Request) -> SyncBucketResponse:
        raw = request.headers.get(BUCKET_HEADER)
        if raw is None:
            raise await sync.request_failed(None, ApiError(
                400, "bad_request", f"missing the {BUCKET_HEADER} header (a JSON SyncBucketHeader)",
                field=BUCKET_HEADER))
        try:
            header = SyncBucketHeader.model_validate_json(raw)
        except ValidationError as exc:
            err = ErrorResponse.from_validation_error(exc)
            raise await sync.request_failed(named_session(raw), ApiError(
                400 if content_only(exc.errors()) else 422, "bad_request", f"{BUCKET_HEADER}: {err.message}",
                field=f"{BUCKET_HEADER}.{err.field}" if err.field else BUCKET_HEADER)) from None
        try:
            session = sync.check_bucket(header.session)  # 409 before a byte of the body is read
        except ApiError as exc:
            raise await sync.request_failed(header.session, exc) from None
        limit, key = limits.max_bucket_mb << 20, f"rollout_server.max_bucket_mb = {limits.max_bucket_mb}"
        hint = "lower rollout_matching.vllm.sync.bucket_mb"
        length = request.headers.get("content-length")
        length = int(length) if length is not None and length.isdigit() else None  # None: chunked
        # A stalled upload counts as idle: no chunk for sync_idle_timeout_s (or body_read_timeout_s, if
        # shorter), or the session's own deadline, ends the read and the session; the fence reopens.
        gap_s = min(limits.body_read_timeout_s, sync.idle_timeout_s)
        with sync.receiving(header.session):
            try:
                if length is not None and length > limit:
                    raise ApiError(413, "bad_request", f"bucket of {length} bytes exceeds {key}", field="body",
                                   hint=hint, headers={"Connection": "close"})
                body = await read_body(request.receive, limit=limit, limit_key=key, gap_s=gap_s,
                                       deadline=session.deadline, hint=hint,
                                       into=None if length is None else bytearray(length))
            except ApiError as exc:
                raise await sync.request_failed(header.session, exc) from None
        return await sync.bucket(header, P.from_bytes(body if isinstance(body, bytearray) else bytearray(body)))

    @admin.post("/ipc", response_model=SyncBucketResponse)
    async def sync_ipc(req: SyncIpcRequest) -> SyncBucketResponse:
        return await sync.ipc(req)

    @admin.post("/update", response_model=SyncBucketResponse)
    async def sync_update(header: SyncBucketHeader) -> SyncBucketResponse:
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

    from rollout_server.openai_routes import openai_router

    # /v1 before /sync: routes are matched in order, and every /v1 request would first be tried against
    # each /sync route (sync requests are a few per weight update).
    app.include_router(openai_router(engine, generate, require_ready))
    app.include_router(admin)
    app.add_middleware(RequestGuard, limits=limits)  # inside the counter: its 401/408/413s are counted
    app.add_middleware(UnexpectedErrors)  # inside the counter too: its 500s are counted
    app.add_middleware(RequestCounter, metrics=metrics)
    return app

