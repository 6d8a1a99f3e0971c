"""The HTTP sync's data plane: bucket bytes read straight into their buffer, on the server's own port.

uvicorn hands a request body to the app as a stream of small messages (~0.4-0.5 GB/s on a 2-core box
whatever the client does, docs/benchmarks.md section 11); a socket read into a preallocated buffer runs
at ~2 GB/s. So a learner's buckets (``learner/weight_sync/session.py``, ``SyncSession.send_packed``) go over a
connection to the SAME port that starts with :data:`MAGIC` instead of an HTTP request line: the
server's HTTP protocol (:func:`sniffing_protocol`, given to uvicorn by ``rollout_server/serve.py``)
sees the first bytes and hands such a connection to :class:`BucketStream`, an asyncio
``BufferedProtocol`` that reads each bucket's bytes into their own buffer and stages them through the
same ``SyncController.bucket`` as ``POST /sync/bucket``. Everything else stays HTTP.

Frames on a stream connection (lengths little-endian uint32)::

    learner:  MAGIC, then per bucket:  len | JSON {"token": ..., "bucket": SyncBucketHeader}  | raw bytes
    server:   per bucket:              len | JSON {"status": 200|4xx|5xx, "body": SyncBucketResponse|ErrorResponse}

The token is the session's ``data_token`` from ``/sync/init`` (which needs the bearer token), so a
stream can only feed the session of the client that opened it. A frame that fails a check gets its
error frame and the connection closes; a bucket that stops arriving (``sync_idle_timeout_s``, or the
session's deadline) ends the session as an idle HTTP upload would. Every refusal is logged with the peer.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import struct
import time
from typing import Any

import torch
from pydantic import ValidationError

from common.weight_sync.messages import STREAM_MAGIC as MAGIC
from common.weight_sync.messages import SyncBucketHeader
from rollout_server.errors import ApiError

log = logging.getLogger(__name__)

MAX_HEADER = 32 << 20  # a 7B layout is ~100 KB of JSON


def frame(obj: dict) -> bytes:
    raw = json.dumps(obj).encode()
    return struct.pack("<I", len(raw)) + raw


class BucketStream(asyncio.BufferedProtocol):
    """One learner's stream connection (module docstring); the transport is handed over by the HTTP protocol."""

    def __init__(self, sync: Any, max_bytes: int, on_close: Any = None) -> None:
        self.sync, self.max_bytes, self.on_close = sync, max_bytes, on_close
        self.head = bytearray()
        self.scratch = bytearray(1 << 16)
        self.body: memoryview | None = None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.pos = 0
        self.header: SyncBucketHeader | None = None
        self.last = time.monotonic()
        self.deadline = float("inf")  # the session's, while a bucket arrives
        self.transport: Any = None
        self.watch: asyncio.Task | None = None

    def start(self, transport: Any, first: bytes) -> None:
        self.transport = transport
        transport.set_protocol(self)
        self.watch = asyncio.get_running_loop().create_task(self._watchdog())
        if first:
            self._feed(first)

    # ---------------------------------------------------------------- BufferedProtocol

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.body is not None:
            return self.body[self.pos:]
        return memoryview(self.scratch)

    def buffer_updated(self, nbytes: int) -> None:
        self.last = time.monotonic()
        if self.body is not None:
            self.pos += nbytes
            if self.pos == len(self.body):
                self._complete()
        else:
            self._feed(bytes(self.scratch[:nbytes]))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.watch is not None:
            self.watch.cancel()
        if self.on_close is not None:
            self.on_close(exc)
        if self.body is not None and self.header is not None:  # dropped mid-bucket: the session ends now
            self._receiving(False)
            asyncio.get_running_loop().create_task(self.sync.request_failed(
                self.header.session, ApiError(499, "client_closed", "the stream closed mid-bucket")))

    # ---------------------------------------------------------------- frames

    def _feed(self, data: bytes) -> None:
        self.head += data
        if len(self.head) < 4:
            return
        (n,) = struct.unpack("<I", self.head[:4])
        if n > MAX_HEADER:
            return self._refuse(ApiError(413, "bad_request", f"stream header of {n} bytes (max {MAX_HEADER})"))
        if len(self.head) < 4 + n:
            return
        raw, rest = bytes(self.head[4:4 + n]), bytes(self.head[4 + n:])
        self.head = bytearray()
        try:
            msg = json.loads(raw)
            header = SyncBucketHeader.model_validate(msg["bucket"])
            token = str(msg["token"])
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            return self._refuse(ApiError(400, "bad_request", f"stream header: {str(exc)[:300]}", field="bucket"))
        try:
            session = self.sync.check_bucket(header.session)
        except ApiError as exc:
            return self._refuse_in_session(header.session, exc)
        if not hmac.compare_digest(token, session.data_token or ""):  # not proven the holder: its session stays
            return self._refuse(ApiError(401, "unauthorized", "wrong data token for this sync session"))
        nbytes = header.offsets[-1][1] if header.offsets else 0
        if nbytes > self.max_bytes:
            return self._refuse_in_session(header.session, ApiError(
                413, "bad_request", f"bucket of {nbytes} bytes exceeds rollout_server.max_bucket_mb",
                hint="lower weight_sync.bucket_mb"))
        # torch.empty, not bytearray(n): no zero-fill pass over a buffer the socket is about to fill
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.header, self.body, self.pos = header, memoryview(self.tensor.numpy()) if nbytes else memoryview(b""), 0
        self.deadline = session.deadline
        self._receiving(True)
        if rest:
            take = rest[:nbytes]
            self.body[:len(take)] = take
            self.pos = len(take)
            if len(rest) > nbytes:
                return self._refuse_in_session(header.session, ApiError(
                    400, "bad_request", "bytes after a bucket before its reply"))
        if self.pos == nbytes:
            self._complete()

    def _receiving(self, on: bool) -> None:
        """The session counts as busy while a bucket arrives (as for an HTTP body): the controller's idle
        watchdog leaves it to this stream's own gap deadline."""
        if on:
            self._busy = self.sync.receiving(self.header.session)
            self._busy.__enter__()
        elif getattr(self, "_busy", None) is not None:
            self._busy.__exit__(None, None, None)
            self._busy = None

    def _complete(self) -> None:
        header, body = self.header, self.tensor
        self._receiving(False)
        self.header, self.body, self.pos = None, None, 0
        self.transport.pause_reading()
        asyncio.get_running_loop().create_task(self._stage(header, body))

    async def _stage(self, header: SyncBucketHeader, body: torch.Tensor) -> None:
        try:
            resp = await self.sync.bucket(header, body)
        except ApiError as exc:
            return self._refuse(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the learner; the connection closes
            log.exception("sync stream: staging bucket %d failed", header.index)
            return self._refuse(ApiError(500, "engine_error", f"{type(exc).__name__}: {exc}"))
        if not self.transport.is_closing():
            self.transport.write(frame({"status": 200, "body": resp.model_dump(mode="json")}))
            self.transport.resume_reading()

    def _refuse_in_session(self, session_id: str, exc: ApiError) -> None:
        """Refuse a bucket its session's holder sent: the failure rule of /sync/* decides whether the
        session ends (``SyncController.request_failed``), then the error frame goes out."""
        self.transport.pause_reading()

        async def decide() -> None:
            self._refuse(await self.sync.request_failed(session_id, exc))

        asyncio.get_running_loop().create_task(decide())

    def _refuse(self, exc: ApiError) -> None:
        """The error frame, then the connection closes (logged: a refused stream is not counted as an HTTP request)."""
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        log.warning("sync stream from %s refused (%d %s): %s", peer, exc.status, exc.body.error, exc.body.message)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame({"status": exc.status, "body": exc.body.model_dump(mode="json")}))
            self.transport.close()
        self._receiving(False)
        self.header, self.body = None, None

    async def _watchdog(self) -> None:
        """A bucket that stops arriving ends its session (as a stalled HTTP upload does)."""
        while True:
            await asyncio.sleep(0.5)
            if self.body is None or self.header is None:
                continue
            gap, now = self.sync.idle_timeout_s, time.monotonic()
            if now - self.last > gap or now > self.deadline:
                why = f"nothing for {gap:g}s" if now - self.last > gap else "the session's deadline passed"
                self._receiving(False)
                exc = await self.sync.request_failed(self.header.session, ApiError(
                    408, "request_timeout", f"the bucket stopped arriving after {self.pos} bytes ({why})"))
                self._refuse(exc)


def sniffing_protocol(base: type, sync: Any, max_bytes: int) -> type:
    """``base`` (uvicorn's HTTP protocol class) that hands connections opening with :data:`MAGIC` to a
    :class:`BucketStream`; every other connection is ``base``'s, untouched."""

    class Sniffing(base):  # type: ignore[misc, valid-type]
        _tandem_first = b""
        _tandem_decided = False

        def data_received(self, data: bytes) -> None:
            if self._tandem_decided:
                return super().data_received(data)
            seen = self._tandem_first + data
            if MAGIC.startswith(seen):  # not enough bytes to tell yet
                self._tandem_first = seen
                return None
            self._tandem_decided = True
            if not seen.startswith(MAGIC):
                return super().data_received(seen)
            stream = BucketStream(sync, max_bytes, on_close=super().connection_lost)
            stream.start(self.transport, seen[len(MAGIC):])
            return None

    Sniffing.__name__ = f"Sniffing{base.__name__}"
    return Sniffing


__all__ = ["MAGIC", "BucketStream", "frame", "sniffing_protocol"]
