"""``GET /health`` and ``GET /metrics``: whether the server can serve, and what it has done.

``/health`` answers a :class:`common.wire.http.HealthResponse` with 200 only when ``status == "ok"``; while the
engine loads, a sync session holds the fence closed, or the engine or a sync failed, it answers the same body
with a 503, so a load balancer's plain status check is enough. ``/metrics`` is Prometheus text
(rollout_server/metrics.py names every series).

What this module does not know: how the engine starts (rollout_server/state.py) or what a sync does.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from common.wire.http import HealthResponse
from rollout_server.state import Server

router = APIRouter()


@router.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
async def health(server: Server) -> JSONResponse:
    engine, fence, sync = server.engine, server.fence, server.sync
    if server.status != "ok" or sync.error:
        status = "error" if (server.status == "error" or sync.error) else "loading"
    else:
        status = "syncing" if not fence.is_open else "ok"
    body = HealthResponse(status=status, engine=engine.name, model=engine.model_path, ver=fence.ver,
                          sync_state=sync.state, world_size=engine.world_size(),
                          engine_info=engine.health_info() if server.status == "ok" else {})
    return JSONResponse(body.model_dump(by_alias=True), status_code=200 if status == "ok" else 503)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition format"}})
async def prometheus(server: Server) -> Response:
    return Response(server.metrics.render(), media_type=server.metrics.content_type)
