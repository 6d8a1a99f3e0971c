"""``POST /infer`` (``InferRequest`` -> ``InferResponse``, the ``ver`` of the whole batch), and :func:`generate`,
the serving path it shares with ``/v1/*`` (rollout_server/routes/openai.py)::

    require_ready ──► max_batch_items, min_ver reachable, prompt lengths (413/400: before any ticket)
        ──► image headers against the pixel budget (on a thread) ──► fence.run: a ticket under one ver,
        waiting at a closed fence at most admission_timeout_s (503) ──► engine.generate, cancelled if
        the client disconnects (499, counted) ──► tokens counted

What this module does not know: how the engine generates, or when the fence closes (rollout_server/weight_sync/session.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from common.wire.http import InferRequest, InferResponse
from common.weight_sync.messages import MAX_VER_JUMP
from rollout_server.engines.base import EngineInputError, check_prompt_lengths
from rollout_server.errors import ERROR_RESPONSES, ApiError
from rollout_server.fence import AdmissionTimeout
from rollout_server.guard import CLIENT_CLOSED, check_pixels, names_images, unless_disconnected
from rollout_server.state import Server, ServerState

log = logging.getLogger(__name__)

router = APIRouter()


@router.post("/infer", response_model=InferResponse, responses=ERROR_RESPONSES)
async def infer(req: InferRequest, request: Request, server: Server) -> Response:
    ticket, outputs = await generate(server, request, req.items, req.sampling, req.min_ver)
    body = InferResponse(ver=ticket.ver, outputs=outputs, engine=server.engine.name,
                         elapsed_s=time.monotonic() - ticket.admitted_at)
    # Serialized once, by pydantic's JSON encoder: FastAPI before 0.130 dumps the model to a dict, validates
    # it again, dumps that to JSON-able objects and json.dumps them (32 items x 128 tokens: 0.62 vs 0.10 ms).
    return Response(body.model_dump_json(), media_type="application/json")


async def generate(server: ServerState, request: Request, items: list[Any], sampling: Any, min_ver: int | None = None,
                   field: str = "items") -> tuple[Any, Any]:
    """/infer and /v1/*: the request's budgets, then the engine under an admission ticket, cancelled
    if the client disconnects; engine errors mapped to HTTP ones; tokens counted."""
    engine, fence, limits, metrics = server.engine, server.fence, server.limits, server.metrics
    server.require_ready()
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
    work = fence.run(lambda: engine.generate(items, sampling), min_ver=min_ver, timeout_s=server.admission_timeout_s)
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
