"""The one exception routes raise to answer with an :class:`common.protocol.ErrorResponse`, and its JSON."""

from __future__ import annotations

from typing import Any

from common.protocol import ErrorResponse


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
