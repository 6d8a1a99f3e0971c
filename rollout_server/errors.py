"""The one exception routes raise to answer with an :class:`common.protocol.ErrorResponse`."""

from __future__ import annotations

from common.protocol import ErrorResponse


class ApiError(Exception):
    """An HTTP error with a protocol body: ``status`` + ``ErrorResponse(error, message, field, hint)``."""

    def __init__(self, status: int, error: str, message: str, *, field: str | None = None, hint: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=error, message=message, field=field, hint=hint)  # type: ignore[arg-type]
        self.headers = headers or {}
