"""The learner's end of the bucket stream (``rollout_server/weight_sync/stream.py``): HTTP buckets at socket speed.

An ``http`` sync session whose ``/sync/init`` reply carries a ``data_token`` takes its buckets on one
TCP connection to the server's own port (opened with ``MAGIC``, kept across buckets and pushes):
per bucket a length-prefixed JSON header (token + :class:`common.weight_sync.messages.SyncBucketHeader`), the raw
bytes with one ``sendall`` (no copy), then the server's length-prefixed reply. Every socket operation
carries the session's remaining deadline.

When the connection cannot be made or does not answer in frames (an HTTP proxy between learner and
server answers the magic with an HTTP error), :meth:`BucketStreamClient.send` returns None, logs once
why, and this client uses ``POST /sync/bucket`` from then on (counted in ``fallbacks``). A frame the
server sends back with an error status is a :class:`learner.weight_sync.session.SyncError`, as an HTTP error is.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
from typing import Any
from urllib.parse import urlsplit

from common.weight_sync.messages import STREAM_MAGIC as MAGIC
from common.weight_sync.messages import SyncBucketHeader, SyncBucketResponse

log = logging.getLogger(__name__)



class StreamUnavailable(Exception):
    """The server end does not speak the stream (nothing of the bucket was taken): use HTTP bodies."""


class BucketStreamClient:
    """One stream connection to one server, opened on first use (module docstring)."""

    def __init__(self, base_url: str, connect_timeout_s: float = 10.0) -> None:
        url = urlsplit(base_url)
        self.addr = (url.hostname or "127.0.0.1", url.port or 80) if url.scheme == "http" else None
        self.connect_timeout_s = connect_timeout_s
        self.sock: socket.socket | None = None
        self.disabled: str | None = None if self.addr else f"{url.scheme} URL (the stream is plain TCP)"
        self.fallbacks = 0

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def send(self, session: Any, header: SyncBucketHeader, data: memoryview) -> SyncBucketResponse | None:
        """The bucket over the stream and the server's reply; None if the stream is not available here."""
        from learner.weight_sync.session import SyncError

        if self.disabled is not None:
            return None
        try:
            return self._send(session, header, data)
        except StreamUnavailable as exc:
            self.close()
            self.disabled = str(exc)
            self.fallbacks += 1
            log.warning("bucket stream to %s:%d unavailable (%s): sending buckets as POST /sync/bucket bodies "
                        "from now on (~5x slower on a 2-core box)", *self.addr, exc)
            return None
        except TimeoutError:
            self.close()
            raise SyncError("bucket", f"bucket {header.index} not acknowledged before the sync deadline over the "
                            f"stream to {self.addr[0]}:{self.addr[1]}") from None
        except OSError as exc:
            self.close()
            raise SyncError("bucket", f"bucket stream to {self.addr[0]}:{self.addr[1]} failed: {exc}") from None

    def _send(self, session: Any, header: SyncBucketHeader, data: memoryview) -> SyncBucketResponse:
        from learner.weight_sync.session import SyncError

        def left() -> float:
            remaining = session.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            return remaining

        fresh = self.sock is None
        if fresh:
            try:
                self.sock = socket.create_connection(self.addr, timeout=min(self.connect_timeout_s, left()))
            except OSError as exc:
                raise StreamUnavailable(f"connect: {exc}") from None
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = self.sock
        head = json.dumps({"token": session.info.data_token, "bucket": header.model_dump(mode="json")}).encode()
        sock.settimeout(left())
        sock.sendall((MAGIC if fresh else b"") + struct.pack("<I", len(head)) + head)
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            if not fresh:
                raise
        sock.settimeout(left())
        raw = self._read(sock, 4, fresh)
        (n,) = struct.unpack("<I", raw)
        if fresh and raw.startswith(b"HTTP"):
            raise StreamUnavailable("the peer answered in HTTP (a proxy in between?)")
        if n > 64 << 20:
            raise StreamUnavailable(f"reply frame of {n} bytes: the peer does not speak the stream")
        try:
            reply = json.loads(self._read(sock, n, fresh))
            status, body = int(reply["status"]), reply["body"]
        except (ValueError, KeyError, TypeError) as exc:
            raise StreamUnavailable(f"unreadable reply frame ({exc})") from None
        if status != 200:
            self.close()
            raise SyncError("bucket", f"bucket stream -> {status}: {body.get('message', body)}", status)
        return SyncBucketResponse.model_validate(body)

    @staticmethod
    def _read(sock: socket.socket, n: int, fresh: bool) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                if fresh and not out:
                    raise StreamUnavailable("the peer closed the connection without a frame")
                raise ConnectionResetError("the server closed the bucket stream mid-reply")
            out += chunk
        return bytes(out)


__all__ = ["BucketStreamClient", "MAGIC", "StreamUnavailable"]
