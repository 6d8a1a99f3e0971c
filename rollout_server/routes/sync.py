"""``/sync/*``: the weight-sync routes learner rank 0 calls; :class:`rollout_server.weight_sync.session.SyncController`
is the state machine behind them (one session at a time, the fence closed from begin to commit or abort).

    POST /sync/init|begin|commit|abort    the session's steps (common.weight_sync.messages's request/response models)
    POST /sync/bucket            packed raw tensor bytes + X-Tandem-Bucket JSON header (SyncBucketHeader)
    POST /sync/update            NCCL bucket announcement (vLLM engine only)
    POST /sync/ipc               a bucket the server copies from the learner's shared buffer (SyncIpcRequest)
    GET  /sync/digest            SyncDigestResponse: exact weight digest per engine worker (409 mid-sync)

A failed request goes through the one failure rule, ``SyncController.request_failed``: when it names the open
session, the session ends and the fence reopens (a body that fails validation too: rollout_server/app.py reads
its ``session`` with :func:`named_session`). The bearer token is checked by ``rollout_server.guard.RequestGuard``
before any body is read (FastAPI parses a body before it runs a route's dependencies). The bucket stream that
shares the port is rollout_server/weight_sync/stream.py.

What this module does not know: how a session moves between states, or how an engine stages weights.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from common.weight_sync import packed as P
from common.wire.base import content_only
from common.wire.http import ErrorResponse
from common.weight_sync.messages import (BUCKET_HEADER, SyncAbortRequest, SyncAbortResponse, SyncBeginRequest,
                                         SyncBeginResponse, SyncBucketHeader, SyncBucketResponse, SyncCommitRequest,
                                         SyncCommitResponse, SyncDigestResponse, SyncInitRequest, SyncInitResponse,
                                         SyncIpcRequest)
from rollout_server.errors import ERROR_RESPONSES, ApiError
from rollout_server.guard import read_body
from rollout_server.state import Server, ServerState

#: ``POST /sync/bucket``'s header, as OpenAPI states it: required, a JSON :class:`SyncBucketHeader`.
BUCKET_HEADER_PARAMETER = {
    "name": BUCKET_HEADER, "in": "header", "required": True,
    "description": "The bucket's layout: a JSON SyncBucketHeader (names, dtypes, shapes, offsets into the body)",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SyncBucketHeader"}}},
}

router = APIRouter(prefix="/sync", responses=ERROR_RESPONSES)


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


@router.post("/init", response_model=SyncInitResponse)
async def sync_init(req: SyncInitRequest, server: Server) -> SyncInitResponse:
    server.require_ready()
    return await server.sync.init(req)


@router.post("/begin", response_model=SyncBeginResponse)
async def sync_begin(req: SyncBeginRequest, server: Server) -> SyncBeginResponse:
    return await server.sync.begin(req)


@router.post("/bucket", response_model=SyncBucketResponse,
             openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True},
                            "parameters": [BUCKET_HEADER_PARAMETER]})
async def sync_bucket(request: Request, server: Server) -> SyncBucketResponse:
    sync, limits = server.sync, server.limits
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
    hint = "lower weight_sync.bucket_mb"
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


@router.post("/ipc", response_model=SyncBucketResponse)
async def sync_ipc(req: SyncIpcRequest, server: Server) -> SyncBucketResponse:
    return await server.sync.ipc(req)


@router.post("/update", response_model=SyncBucketResponse)
async def sync_update(header: SyncBucketHeader, server: Server) -> SyncBucketResponse:
    return await server.sync.update(header)  # pragma: no cover - vLLM engine only


@router.post("/commit", response_model=SyncCommitResponse)
async def sync_commit(req: SyncCommitRequest, server: Server) -> SyncCommitResponse:
    return await server.sync.commit(req)


@router.post("/abort", response_model=SyncAbortResponse)
async def sync_abort(req: SyncAbortRequest, server: Server) -> SyncAbortResponse:
    return await server.sync.abort(req)


def refuse_mid_sync(server: ServerState, why: str) -> None:
    """409 while a session is open (weights may be half-staged or, with vLLM, half-loaded)."""
    s = server.sync.session
    if s is not None:
        raise ApiError(409, "sync_state", f"/sync/digest {why}: sync session {s.id} from {s.client!r} is "
                       f"{server.sync.state.value}, the weights are mid-update",
                       hint="retry once the session commits or aborts (GET /health says sync_state idle)")


@router.get("/digest", response_model=SyncDigestResponse, responses={501: {"model": ErrorResponse}})
async def sync_digest(server: Server) -> SyncDigestResponse:
    engine, fence = server.engine, server.fence
    server.require_ready()
    refuse_mid_sync(server, "is refused")
    ver = fence.ver
    try:
        digests = await engine.weights_digest()
    except NotImplementedError as exc:
        raise ApiError(501, "not_implemented", str(exc) or f"the {engine.name} engine has no weight digest",
                       hint="each commit's sampled fingerprint is in SyncCommitResponse and the log") from None
    # A session that opened, committed or failed while the engine read: the digest may mix versions.
    refuse_mid_sync(server, "was overtaken")
    server.require_ready()
    if fence.ver != ver:
        raise ApiError(409, "sync_state", f"/sync/digest was overtaken: a commit moved ver {ver} -> {fence.ver} "
                       "while the weights were read", hint="retry")
    return SyncDigestResponse(engine=engine.name, ver=ver, digests=digests)
