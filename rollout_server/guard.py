"""The rollout server's trust boundary: who may sync, how much a request may send, how long it may take.

:class:`RequestGuard` is pure ASGI middleware in front of every route, so its checks run before
FastAPI reads or parses a byte of the body::

    request ──► /sync* without the bearer token (when one is set) ─────────────► 401, body never read
        │   ──► /sync/bucket ───► the route (routes/sync.py) checks header and session, then streams the body
        │                         itself through read_body under the session's deadlines
        │   ──► any other body ─► read_body: size cap counted as bytes arrive (chunked or not; a larger
        │                         Content-Length is refused before reading), a gap of body_read_timeout_s
        │                         between chunks is a 408; then the route sees the buffered body
        ▼
    route ──► check_pixels (headers only, before admission) ──► the fence ──► the engine (token budget)
          └─► unless_disconnected: a client that goes away cancels its batch, waiting or generating

What this module does not know: sessions, the fence or engines (app.py wires them), or where the
limits come from (``rollout_server.*``; :class:`Limits`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi.responses import JSONResponse

from common.data.images import InputError, image_pixels
from common.wire.http import InferItem
from rollout_server.errors import ApiError, error_content

T = TypeVar("T")

#: Status logged and counted for a client that disconnected before its answer (nginx's convention).
CLIENT_CLOSED = 499


@dataclasses.dataclass(frozen=True)
class Limits:
    """The request limits of ``rollout_server.*`` (defaults = the schema's, for cfg stand-ins in tests)."""

    auth_token: str | None = None
    max_request_mb: int = 64
    max_bucket_mb: int = 2048
    body_read_timeout_s: float = 30.0
    max_request_megapixels: float = 256.0
    max_image_megapixels: float = 40.0
    max_batch_items: int = 256

    @classmethod
    def of(cls, srv: Any) -> Limits:
        return cls(**{f.name: getattr(srv, f.name, f.default) for f in dataclasses.fields(cls)})

    @property
    def max_request_pixels(self) -> int:
        return int(self.max_request_megapixels * 1e6)

    @property
    def max_image_pixels(self) -> int:
        return int(self.max_image_megapixels * 1e6)


def _is_sync(path: str) -> bool:
    return path == "/sync" or path.startswith("/sync/")


def _auth_problem(scope: dict, token: str) -> str | None:
    """None when the request carries ``Authorization: Bearer <token>``, else what is wrong with it."""
    raw = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
    scheme, _, given = raw.partition(b" ")
    if scheme.lower() == b"bearer" and hmac.compare_digest(given, token.encode()):
        return None
    return "the token given is wrong" if raw else "none given"


async def read_body(receive: Callable[[], Awaitable[dict]], *, limit: int, limit_key: str, gap_s: float,
                    deadline: float | None = None, hint: str | None = None, into: bytearray | None = None) -> bytes:
    """The whole request body, read chunk by chunk: 413 past ``limit`` bytes (counted as they arrive,
    whatever the framing), 408 when no chunk arrives for ``gap_s`` (or past the monotonic ``deadline``),
    499 when the client disconnects. ``limit_key`` is the config key named in the 413.

    ``into``: a preallocated buffer of the declared length (a sync bucket): chunks are copied into it as
    they arrive (no list of chunks, no join) and it is returned; a body of another length is a 400."""
    chunks, n = [], 0
    view = memoryview(into) if into is not None else None
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        try:  # asyncio.timeout, not wait_for: no task per chunk (3.11's wait_for wraps receive() in one)
            async with asyncio.timeout(max(0.0, gap_s if left is None else min(gap_s, left))):
                message = await receive()
        except TimeoutError:
            why = f"nothing for {gap_s:g}s" if left is None or left > gap_s else "its deadline passed"
            raise ApiError(408, "request_timeout", f"the request body stopped arriving after {n} bytes ({why})",
                           field="body", hint="send the body without pauses (rollout_server.body_read_timeout_s)",
                           headers={"Connection": "close"}) from None
        if message["type"] == "http.disconnect":
            raise ApiError(CLIENT_CLOSED, "client_closed", f"the client disconnected after {n} bytes of the body")
        body = message.get("body", b"")
        n += len(body)
        if n > limit:
            raise ApiError(413, "bad_request", f"request body over {limit} bytes ({limit_key})", field="body",
                           hint=hint, headers={"Connection": "close"})
        if view is not None:
            if n > len(view):
                raise ApiError(400, "bad_request", f"the body is longer than its Content-Length ({len(view)})",
                               field="body", headers={"Connection": "close"})
            view[n - len(body):n] = body
        else:
            chunks.append(body)
        if not message.get("more_body", False):
            if view is None:
                return b"".join(chunks)
            if n != len(view):
                raise ApiError(400, "bad_request", f"the body ended after {n} of its {len(view)} declared bytes",
                               field="body")
            return into  # type: ignore[return-value]


def declared_length(scope: dict) -> int | None:
    raw = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
    return int(raw) if raw is not None and raw.isdigit() else None


class RequestGuard:
    """Pure ASGI middleware: the bearer token on /sync*, then every body but /sync/bucket's read under
    a size cap and a read deadline before the route runs (see the module docstring)."""

    def __init__(self, app: Any, limits: Limits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        try:
            body = await self._admit(scope, receive, path)
        except ApiError as exc:
            response = JSONResponse(error_content(path, exc.body, exc.status), status_code=exc.status,
                                    headers=exc.headers)
            await response(scope, receive, send)
            return
        if body is None:  # no body, or /sync/bucket: the route streams its own (routes/sync.py)
            await self.app(scope, receive, send)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: http.disconnect when the client goes away

        await self.app(scope, replay, send)

    async def _admit(self, scope: dict, receive: Any, path: str) -> bytes | None:
        """The token check, then the body under its cap and read deadline; None = leave the body to the route."""
        lim = self.limits
        if _is_sync(path) and lim.auth_token and (problem := _auth_problem(scope, lim.auth_token)):
            raise ApiError(401, "unauthorized", f"/sync/* need 'Authorization: Bearer <rollout_server.auth_token>' "
                           f"({problem})", field="Authorization",
                           headers={"WWW-Authenticate": "Bearer", "Connection": "close"})
        has_body = any(k in (b"content-length", b"transfer-encoding") for k, _ in scope.get("headers", ()))
        if path == "/sync/bucket" or not has_body:
            return None
        # /sync/* JSON is capped like the rest: an NCCL /sync/update lists every tensor of the model
        # (MoE checkpoints: tens of thousands), and only a caller with the token gets this far.
        limit, key = lim.max_request_mb << 20, f"rollout_server.max_request_mb = {lim.max_request_mb}"
        if (length := declared_length(scope)) is not None and length > limit:
            raise ApiError(413, "bad_request", f"request body of {length} bytes over {limit} bytes ({key})",
                           field="body", hint="send smaller batches", headers={"Connection": "close"})
        return await read_body(receive, limit=limit, limit_key=key, gap_s=lim.body_read_timeout_s,
                               hint="send smaller batches")


async def _until_disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass  # a stray empty body chunk: keep listening


async def unless_disconnected(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it, wait until it stopped (an engine's
    generate returns only once it no longer computes for the call), then raise a 499 ApiError."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # the client went away (or our caller was cancelled): stop the work
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled():
        raise ApiError(CLIENT_CLOSED, "client_closed", "the client disconnected; its generation was cancelled")
    return task.result()


def names_images(item: InferItem) -> bool:
    """Whether ``item`` refers to an image (``images``, or a chat part's inline ``image``): what
    :func:`check_pixels` reads. A text-only item has nothing to check, so no thread hop is spent on it."""
    return bool(item.images) or any(not isinstance(m.content, str) and any(p.image is not None for p in m.content)
                                    for m in item.messages or ())


def check_pixels(items: Sequence[InferItem], limits: Limits) -> None:
    """413 naming the limit when one image is over ``rollout_server.max_image_megapixels`` or a request's
    images together are over ``max_request_megapixels``; sizes come from the image headers (nothing is
    decoded). An unreadable image is a 400; one over PIL's decompression-bomb bound (2 x
    ``PIL.Image.MAX_IMAGE_PIXELS``, 179 MP) a 413 whatever the limits say."""
    per_image, budget, total = limits.max_image_pixels, limits.max_request_pixels, 0
    image_key = f"rollout_server.max_image_megapixels = {limits.max_image_megapixels:g}"
    for i, item in enumerate(items):
        refs = [(f"items.{i}.images.{j}", r) for j, r in enumerate(item.images or [])]
        for m, msg in enumerate(item.messages or []):
            if not isinstance(msg.content, str):
                refs += [(f"items.{i}.messages.{m}.content.{k}.image", p.image)
                         for k, p in enumerate(msg.content) if p.image is not None]
        for field, ref in refs:
            try:
                n = image_pixels(ref, field)
            except InputError as exc:
                if exc.status == 413:  # over Pillow's bomb bound: far over ours too, so ours is what we quote
                    raise ApiError(413, "bad_request", f"image over {image_key} (Pillow reads only its header, "
                                   f"and refuses it: {exc})", field=exc.field,
                                   hint="downscale it before sending") from None
                raise ApiError(exc.status, "bad_request", str(exc), field=exc.field) from None
            if n > per_image:
                raise ApiError(413, "bad_request", f"image of {n} pixels, over {image_key}", field=field,
                               hint="downscale it before sending")
            total += n
            if total > budget:
                raise ApiError(413, "bad_request", f"images up to {field} decode to {total} pixels, over "
                               f"rollout_server.max_request_megapixels = {limits.max_request_megapixels:g} "
                               f"({budget} pixels)", field=field, hint="send fewer or smaller images per request")
