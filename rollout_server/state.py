"""What every route may use: :class:`ServerState`, built once by ``build_app`` (rollout_server/app.py) and kept
on ``app.state.server``, and :data:`Server`, the dependency that hands it to a handler.

The routers (``rollout_server/routes/``) hold no state and close over nothing: a handler names what it needs
in its signature (``server: Server``), as vLLM's entrypoints read ``request.app.state``. One typed object
rather than one attribute per component, so a handler's reach is written in its annotations and a test can
build the app twice in one process.

What this module does not know: routes, HTTP bodies, how the engine generates or how the fence is built.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Annotated, Literal

from fastapi import Depends, Request

from rollout_server.engines.base import Engine
from rollout_server.errors import ApiError
from rollout_server.fence import Fence
from rollout_server.guard import Limits
from rollout_server.metrics import ServerMetrics
from rollout_server.weight_sync.session import SyncController

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class ServerState:
    """The engine and what guards it, plus whether the engine is loading, ready, or failed to start."""

    engine: Engine
    fence: Fence
    sync: SyncController
    metrics: ServerMetrics
    limits: Limits
    admission_timeout_s: float
    """How long a request waits at a closed fence (or for its ``min_ver``) before a 503
    (rollout_server.admission_timeout_s)."""
    status: Literal["loading", "ok", "error"] = "loading"
    """The engine's start: ``loading`` until ``engine.start()`` returns, ``error`` if it raised."""
    error: str | None = None
    """Why the start failed (``error`` only)."""
    started_at: float = dataclasses.field(default_factory=time.time)

    async def start_engine(self, *, already_started: bool, on_fatal: Callable[[str], None] | None) -> None:
        """The lifespan's background start: ``ok`` once the engine is up; on failure ``error`` and ``on_fatal``."""
        engine = self.engine
        try:
            if not already_started:
                await engine.start()
            self.status = "ok"
            log.info("serving %s with the %s engine at ver %d", engine.model_path, engine.name, self.fence.ver)
            if not self.limits.auth_token:  # allowed on loopback only (common/config/server.py); say what it means
                log.info("/sync/* take no token (rollout_server.auth_token unset): any local process may push "
                         "weights; set a token on a machine shared with other users")
        except Exception as exc:  # noqa: BLE001 - any start failure is fatal and reported
            self.status, self.error = "error", f"{type(exc).__name__}: {exc}"
            log.error("engine %s failed to start: %s", engine.name, self.error,
                      exc_info=not isinstance(exc, ImportError))
            if on_fatal is not None:
                on_fatal(self.error)

    def require_ready(self) -> None:
        """A 503 (Retry-After: 1) unless the engine started and no sync failure left the weights unusable."""
        if self.status != "ok" or self.sync.error:
            why = self.sync.error or self.error or "the engine is still loading"
            raise ApiError(503, "not_ready", f"{self.engine.name} engine not ready: {why}",
                           headers={"Retry-After": "1"})


async def server_state(request: Request) -> ServerState:
    """The app's :class:`ServerState` (``async``: FastAPI runs a plain ``def`` dependency on a worker thread)."""
    return request.app.state.server


#: A handler parameter ``server: Server`` receives the app's :class:`ServerState`.
Server = Annotated[ServerState, Depends(server_state)]
