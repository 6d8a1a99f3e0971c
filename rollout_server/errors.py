"""How the server answers errors: the one exception routes raise (an :class:`common.wire.http.ErrorResponse`
with a status), the statuses OpenAPI lists for a route, its JSON, and the middleware that turns any other
exception into a 500 of the same shape. The handlers that map FastAPI's own errors are rollout_server/app.py's."""

from __future__ import annotations

import logging
from typing import Any

from common.wire.http import ErrorResponse

log = logging.getLogger(__name__)

#: The error statuses a tandem route may answer, as OpenAPI states them (every one an ``ErrorResponse``).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 408, 409, 413, 422, 500, 503, 504)
}


class ApiError(Exception):
    """An HTTP error with a protocol body: ``status`` + ``ErrorResponse(error, message, field, hint)``."""

    def __init__(self, status: int, error: str, message: str, *, field: str | None = None, hint: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=error, message=message, field=field, hint=hint)  # type: ignore[arg-type]
        self.headers = headers or {}


def error_content(path: str, body: ErrorResponse, status: int) -> dict[str, Any]:
    """The JSON of an error on ``path``: OpenAI's envelope under ``/v1/`` (OpenAI clients read
    ``{"error": {"message", ...}}``), the ``ErrorResponse`` itself everywhere else."""
    if path.startswith("/v1/"):
        return {"error": {"message": body.message, "type": "invalid_request_error" if status < 500 else "server_error",
                          "param": body.field, "code": body.error}}
    return body.model_dump()


class UnexpectedErrors:
    """Pure ASGI middleware: an exception no route handled becomes a 500 ``ErrorResponse`` here.

    Not ``app.exception_handler(Exception)``: Starlette sends that handler's response from its outermost
    middleware and then re-raises the exception, so uvicorn logs "Exception in ASGI application" and
    closes the keep-alive connection a client may reuse. Answered here, the exception ends with the
    response, the connection stays open, and the traceback is logged once. A response that had already
    started cannot be replaced: then the exception propagates (the server closes that connection).
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the one place unexpected errors become 500s
            path = scope.get("path", "")
            log.exception("%s %s failed", scope.get("method"), path)
            if started:
                raise
            from fastapi.responses import JSONResponse  # the app imports it anyway; errors.py stays light

            body = ErrorResponse(error="engine_error", message=f"{type(exc).__name__}: {exc}")
            await JSONResponse(error_content(path, body, 500), status_code=500)(scope, receive, send)
