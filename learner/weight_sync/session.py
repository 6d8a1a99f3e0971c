"""The HTTP control channel of a weight sync: one session's calls, each with a deadline.

    client = SyncClient("http://127.0.0.1:8310", auth_token=None, timeout_s=300)
    session = client.open(bucket_bytes)      # POST /sync/init: the server's manifest, tied groups, dtype
    session.begin("drain")                   # /sync/begin: the fence closes
    session.send_bucket(tensors)             # /sync/bucket (HTTP transport) or session.update(header) (NCCL)
    session.commit(fingerprint, min_ver)     # /sync/commit: swap, caches reset, ver += 1
    session.abort(reason)                    # /sync/abort: the server keeps its old weights and ver

Every sender (``learner/weight_sync/http.py``, ``learner/weight_sync/nccl.py``) talks to the server through this:
the transports differ only in how the bytes travel, never in the calls that fence and commit them.
Every call's deadline is taken from the session's ``timeout_s``. Imports httpx, pydantic, torch and
common only (no fastapi): the learner does not need the server's dependencies.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, TypeVar

import httpx
import torch
from pydantic import BaseModel, ValidationError

from common.weight_sync.messages import (BUCKET_HEADER, AdapterSpec, SyncAbortRequest, SyncAbortResponse,
                                         SyncBeginRequest, SyncBeginResponse, SyncBucketHeader, SyncBucketResponse,
                                         SyncCommitRequest, SyncCommitResponse, SyncInitRequest, SyncInitResponse,
                                         SyncIpcRequest, SharedBuffer)
from common.wire.http import HealthResponse
from common.weight_sync import packed as P
from learner.weight_sync.stream import BucketStreamClient
from common.weight_sync import weights as W

#: Bytes per write of a bucket body (see SyncSession.send_packed).
SEND_SLICE = 1 << 20

R = TypeVar("R", bound=BaseModel)


class SyncError(RuntimeError):
    """A push that did not commit; the server kept its old weights. ``phase`` says where it stopped."""

    def __init__(self, phase: str, message: str, status: int | None = None) -> None:
        super().__init__(f"weight sync failed during {phase}: {message}")
        self.phase, self.status = phase, status


class SyncSession:
    """One open session on the server; the steps of :meth:`learner.weight_sync.base.PushSender.push`, usable one by one."""

    def __init__(self, client: SyncClient, info: SyncInitResponse, deadline: float) -> None:
        self.client, self.info, self.deadline = client, info, deadline
        self.id = info.session
        self.n_buckets = 0
        self.bytes = 0

    def begin(self, mode: str = "drain", drain_timeout_s: float | None = None) -> SyncBeginResponse:
        timeout = drain_timeout_s if drain_timeout_s is not None else max(1.0, self.deadline - time.monotonic())
        req = SyncBeginRequest(session=self.id, mode=mode, timeout_s=timeout)  # type: ignore[arg-type]
        return self.client._call("begin", "/sync/begin", req, SyncBeginResponse, self.deadline)

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> SyncBucketResponse:
        """One bucket of CPU tensors already in their serving dtype (packed here; tests and small pushes)."""
        layout = P.packed_layout(list(tensors.items()), {n: W.dtype_name(t.dtype) for n, t in tensors.items()})
        buf = torch.empty(P.nbytes_of(layout), dtype=torch.uint8)
        P.pack_into(buf, list(tensors.values()), layout)
        return self.send_packed(layout, memoryview(buf.numpy()))

    def send_packed(self, layout: list[P.Entry], data: memoryview) -> SyncBucketResponse:
        """One bucket's packed bytes: over the bucket stream (:mod:`learner.weight_sync.stream`) when the session offers
        one, else as the body of ``POST /sync/bucket`` (its layout in the header).

        The body goes out in :data:`SEND_SLICE` pieces under an explicit Content-Length: httpx sends one
        big bytes body by re-slicing it after every partial ``send`` (quadratic: 256 MB went at ~50 MB/s).
        """
        header = SyncBucketHeader(session=self.id, index=self.n_buckets, names=[e[0] for e in layout],
                                  dtypes=[e[1] for e in layout], shapes=[e[2] for e in layout],
                                  offsets=[e[3] for e in layout])  # type: ignore[arg-type]
        data = data.cast("B") if data.format != "B" else data
        resp = self.client.stream.send(self, header, data) if self.info.data_token else None
        if resp is None:  # no stream offered, or it is not reachable (a proxy in between): the HTTP body
            pieces = (data[i:i + SEND_SLICE] for i in range(0, len(data), SEND_SLICE))
            resp = self.client._call("bucket", "/sync/bucket", pieces, SyncBucketResponse, self.deadline,
                                     headers={BUCKET_HEADER: header.model_dump_json(), "Content-Length": str(len(data)),
                                              "Content-Type": "application/octet-stream"})
        self.n_buckets += 1
        self.bytes += len(data)
        return resp

    def send_ipc(self, layout: list[P.Entry], source: SharedBuffer) -> SyncBucketResponse:
        """``POST /sync/ipc``: the server copies this bucket out of the learner's shared buffer; returns after."""
        req = SyncIpcRequest(session=self.id, index=self.n_buckets, names=[e[0] for e in layout],
                             dtypes=[e[1] for e in layout], shapes=[e[2] for e in layout],
                             offsets=[e[3] for e in layout], source=source)  # type: ignore[arg-type]
        resp = self.client._call("ipc", "/sync/ipc", req, SyncBucketResponse, self.deadline)
        self.n_buckets += 1
        self.bytes += resp.nbytes
        return resp

    def update(self, header: SyncBucketHeader) -> SyncBucketResponse:
        """``/sync/update`` (NCCL path): announce tensors the learner broadcasts meanwhile; returns once received."""
        resp = self.client._call("update", "/sync/update", header, SyncBucketResponse, self.deadline)
        self.n_buckets += 1
        self.bytes += resp.nbytes
        return resp

    def commit(self, fingerprint: str | None = None, min_ver: int | None = None) -> SyncCommitResponse:
        req = SyncCommitRequest(session=self.id, n_buckets=self.n_buckets, fingerprint=fingerprint, min_ver=min_ver)
        return self.client._call("commit", "/sync/commit", req, SyncCommitResponse, self.deadline)

    def abort(self, reason: str | None = None) -> SyncAbortResponse:
        req = SyncAbortRequest(session=self.id, reason=reason)
        return self.client._call("abort", "/sync/abort", req, SyncAbortResponse, time.monotonic() + 10.0)


class SyncClient:
    """The HTTP control channel to one rollout server: /health and sync sessions (every call has a deadline)."""

    def __init__(self, base_url: str, auth_token: str | None = None, timeout_s: float = 300.0, *,
                 client_id: str | None = None, connect_timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.client_id = client_id or f"learner@{socket.gethostname()}:{os.getpid()}"
        headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._connect_timeout_s = connect_timeout_s
        self._http = httpx.Client(base_url=self.base_url, headers=headers)
        self.stream = BucketStreamClient(self.base_url, connect_timeout_s)

    def close(self) -> None:
        self.stream.close()
        self._http.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ HTTP

    def _call(self, phase: str, path: str, body: Any, out: type[R], deadline: float,
              headers: dict[str, str] | None = None) -> R:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SyncError(phase, f"the sync deadline ({self.timeout_s:.0f}s) passed before {path}")
        timeout = httpx.Timeout(remaining, connect=min(self._connect_timeout_s, remaining))
        try:
            if not isinstance(body, BaseModel):  # bytes, or an iterator of pieces (a bucket body)
                r = self._http.post(path, content=body, headers=headers, timeout=timeout)
            else:
                r = self._http.post(path, content=body.model_dump_json(), timeout=timeout,
                                    headers={"Content-Type": "application/json", **(headers or {})})
        except httpx.TimeoutException:
            raise SyncError(phase, f"no answer from {self.base_url}{path} within {remaining:.1f}s") from None
        except httpx.TransportError as exc:
            raise SyncError(phase, f"cannot reach {self.base_url}{path} ({exc}); is the rollout server running? "
                            "Start it with `make launch-rollout CONFIG=...` "
                            "(python -m rollout_server --config ...)") from None
        if r.status_code != 200:
            try:
                detail = r.json().get("message", r.text)
            except ValueError:
                detail = r.text
            raise SyncError(phase, f"{path} -> HTTP {r.status_code}: {detail}", r.status_code)
        try:
            return out.model_validate_json(r.content)
        except ValidationError as exc:
            raise SyncError(phase, f"{path} answered with an unexpected body: {exc}") from None

    # ------------------------------------------------------------------ steps

    def health(self) -> HealthResponse:
        """``GET /health`` (its body also on a 503: loading, syncing or error)."""
        try:
            r = self._http.get("/health", timeout=httpx.Timeout(self.timeout_s, connect=self._connect_timeout_s))
            return HealthResponse.model_validate_json(r.content)
        except (httpx.HTTPError, ValidationError) as exc:
            raise SyncError("health", f"GET {self.base_url}/health failed ({exc}); is the rollout server running? "
                            "Start it with `python -m rollout_server --config ...`") from None

    def open(self, bucket_bytes: int = 512 << 20, *, nccl: dict[str, Any] | None = None,
             weight_load: str | None = None, transport: str | None = None, skip: list[str] | None = None,
             adapter: AdapterSpec | None = None) -> SyncSession:
        """``/sync/init``: a session, with the server's manifest (409 if another client holds one).

        ``nccl`` (``master_addr``, ``master_port``, ``world_size``, ``rank_offset``) opens an NCCL-transport
        session instead (``learner/weight_sync/nccl.py``); the server joins that group if it is new to it.
        ``weight_load`` (``fast`` | ``native``) overrides the server's NCCL load path for this session.
        ``transport``: ``ipc`` for ``learner/weight_sync/ipc.py`` (default: ``nccl`` with ``nccl``, else ``http``).
        ``skip``: served names frozen for the run, not to be sent (the server answers which it accepts);
        ``adapter``: open an ``adapter`` session (the adapter's tensors travel; the server merges them).
        """
        deadline = time.monotonic() + self.timeout_s
        req = SyncInitRequest(client=self.client_id, transport=transport or ("nccl" if nccl else "http"),
                              bucket_bytes=bucket_bytes, timeout_s=self.timeout_s, weight_load=weight_load,
                              skip=list(skip or []), adapter=adapter, **(nccl or {}))
        return SyncSession(self, self._call("init", "/sync/init", req, SyncInitResponse, deadline), deadline)
