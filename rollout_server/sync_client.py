"""Learner-side weight sender over HTTP (the CPU / no-NCCL path of design section 4).

    client = WeightSyncClient("http://127.0.0.1:8310", auth_token=None, timeout_s=300)
    report = client.push(model.named_parameters(), bucket_bytes=512 << 20, fence="drain")
    log.info("synced ver %d in %.2fs, fingerprint %s", report.ver, report.total_s, report.fingerprint)

One push = one session: ``/sync/init`` (the server's manifest, tied groups, serving dtype) ->
plan (names mapped, tied weights once, every served name present, shapes checked; nothing fenced
yet) -> ``/sync/begin`` (the server closes admission and drains or aborts in-flight /infer) ->
``/sync/bucket`` x n (safetensors blobs of at most ``bucket_bytes``, cast to the serving dtype one
tensor at a time) -> ``/sync/commit`` (the server swaps, resets caches, ``ver += 1``). Any failure
after init sends a best-effort ``/sync/abort``, so the server keeps its old weights and ``ver``
and reopens admission at once instead of waiting for its idle timeout.

Every HTTP call has a deadline taken from the whole push's ``timeout_s``. Imports torch, httpx,
safetensors and common only (no fastapi): the learner does not need the server's dependencies.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import torch
from pydantic import BaseModel, ValidationError

from common.protocol import (
    BUCKET_HEADER,
    HealthResponse,
    SyncAbortRequest,
    SyncAbortResponse,
    SyncBeginRequest,
    SyncBeginResponse,
    SyncBucketHeader,
    SyncBucketResponse,
    SyncCommitRequest,
    SyncCommitResponse,
    SyncInitRequest,
    SyncInitResponse,
)
from rollout_server import weights as W

log = logging.getLogger(__name__)
R = TypeVar("R", bound=BaseModel)


class SyncError(RuntimeError):
    """A push that did not commit; the server kept its old weights. ``phase`` says where it stopped."""

    def __init__(self, phase: str, message: str, status: int | None = None) -> None:
        super().__init__(f"weight sync failed during {phase}: {message}")
        self.phase, self.status = phase, status


@dataclass
class SyncReport:
    """What one committed push took (seconds) and moved."""

    ver: int
    fence_s: float  # /sync/begin: admission closed and in-flight drained or aborted
    wire_s: float  # all /sync/bucket calls (cast + serialise + transfer + server staging)
    commit_s: float  # /sync/commit round trip (swap + cache reset on the server)
    total_s: float  # init to commit response
    bytes: int
    n_buckets: int
    fingerprint: str  # of the weights now served (equal to the learner's)
    ver_before: int = 0
    drained: int = 0
    aborted: int = 0
    server_update_s: float | None = None  # NCCL path: the server's own time for /sync/update (receive + load)
    server_load: dict | None = None  # NCCL path: how the engine loaded it (SyncBucketResponse.load)


class SyncSession:
    """One open session on the server; the steps of :meth:`WeightSyncClient.push`, usable one by one."""

    def __init__(self, client: WeightSyncClient, info: SyncInitResponse, deadline: float) -> None:
        self.client, self.info, self.deadline = client, info, deadline
        self.id = info.session
        self.n_buckets = 0
        self.bytes = 0

    def begin(self, mode: str = "drain", drain_timeout_s: float | None = None) -> SyncBeginResponse:
        timeout = drain_timeout_s if drain_timeout_s is not None else max(1.0, self.deadline - time.monotonic())
        req = SyncBeginRequest(session=self.id, mode=mode, timeout_s=timeout)  # type: ignore[arg-type]
        return self.client._call("begin", "/sync/begin", req, SyncBeginResponse, self.deadline)

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> SyncBucketResponse:
        blob, layout = W.encode_bucket(tensors)
        header = SyncBucketHeader(session=self.id, index=self.n_buckets, names=[e[0] for e in layout],
                                  dtypes=[e[1] for e in layout], shapes=[e[2] for e in layout],
                                  offsets=[e[3] for e in layout])  # type: ignore[arg-type]
        resp = self.client._call("bucket", "/sync/bucket", blob, SyncBucketResponse, self.deadline,
                                 headers={BUCKET_HEADER: header.model_dump_json(),
                                          "Content-Type": "application/octet-stream"})
        self.n_buckets += 1
        self.bytes += len(blob)
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


class WeightSyncClient:
    """Pushes full weights to one rollout server (see the module docstring)."""

    def __init__(self, base_url: str, auth_token: str | None = None, timeout_s: float = 300.0, *,
                 client_id: str | None = None, connect_timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.client_id = client_id or f"learner@{socket.gethostname()}:{os.getpid()}"
        headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._connect_timeout_s = connect_timeout_s
        self._http = httpx.Client(base_url=self.base_url, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> WeightSyncClient:
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
            if isinstance(body, bytes):
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
             weight_load: str | None = None) -> SyncSession:
        """``/sync/init``: a session, with the server's manifest (409 if another client holds one).

        ``nccl`` (``master_addr``, ``master_port``, ``world_size``, ``rank_offset``) opens an NCCL-transport
        session instead (see ``learner/nccl_sync.py``); the server joins that group if it is new to it.
        ``weight_load`` (``fast`` | ``native``) overrides the server's NCCL load path for this session.
        """
        deadline = time.monotonic() + self.timeout_s
        req = SyncInitRequest(client=self.client_id, transport="nccl" if nccl else "http", bucket_bytes=bucket_bytes,
                              timeout_s=self.timeout_s, weight_load=weight_load, **(nccl or {}))
        return SyncSession(self, self._call("init", "/sync/init", req, SyncInitResponse, deadline), deadline)

    @staticmethod
    def plan(info: SyncInitResponse, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Match the learner's tensors to the server's manifest, in manifest order (not yet cast).

        Names lose ``module.`` / ``_orig_mod.``; a tied group is sent once under its first name;
        names the server does not serve are skipped with a warning. Raises :class:`SyncError` when a
        served name is missing or a shape differs (before any fence is closed).
        """
        alias = {n: g[0] for g in info.tied for n in g[1:]}
        specs = {s.name: s for s in info.manifest}
        found: dict[str, torch.Tensor] = {}
        extra = []
        for raw, t in named_tensors:
            name = alias.get(W.hf_name(raw), W.hf_name(raw))
            if name not in specs:
                extra.append(raw)
            elif name not in found:
                found[name] = t
        if extra:
            log.warning("weight sync skips %d tensor(s) the server does not serve (first: %s)", len(extra), extra[0])
        missing = [n for n in specs if n not in found]
        if missing:
            raise SyncError("plan", f"{len(missing)} served parameter(s) missing on the learner (first: {missing[0]!r}); "
                            "send the HF model's own named_parameters() (same architecture as the server)")
        bad = [(n, list(found[n].shape), s.shape) for n, s in specs.items() if list(found[n].shape) != s.shape]
        if bad:
            raise SyncError("plan", f"{len(bad)} shape mismatch(es), first {bad[0][0]!r}: learner {bad[0][1]} vs "
                            f"server {bad[0][2]}")
        return [(n, found[n]) for n in specs]

    @staticmethod
    def cast_stream(info: SyncInitResponse, planned: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor as the server holds it: CPU, contiguous, serving dtype (one at a time)."""
        dtypes = {s.name: s.dtype for s in info.manifest}
        for name, t in planned:
            yield name, t.detach().to(device="cpu", dtype=W.torch_dtype(dtypes[name])).contiguous()

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 512 << 20,
             fence: str = "drain", min_ver: int | None = None) -> SyncReport:
        """Send every served weight and commit; see the module docstring. Raises :class:`SyncError`.

        ``min_ver``: the lowest ver the commit may produce (``SyncCommitRequest.min_ver``).
        """
        t0 = time.monotonic()
        session = self.open(bucket_bytes)
        info = session.info
        try:
            planned = self.plan(info, named_tensors)
            fp = W.fingerprint(planned, {s.name: s.dtype for s in info.manifest})
            t1 = time.monotonic()
            begun = session.begin(fence)
            t2 = time.monotonic()
            for bucket in W.iter_buckets(self.cast_stream(info, planned), bucket_bytes):
                session.send_bucket(bucket)
            t3 = time.monotonic()
            done = session.commit(fp, min_ver)
            t4 = time.monotonic()
        except BaseException as exc:
            try:
                session.abort(f"learner push failed: {type(exc).__name__}: {exc}"[:500])
            except Exception as abort_exc:  # noqa: BLE001 - the server's idle timeout is the backstop
                log.warning("could not abort sync session %s: %s", session.id, abort_exc)
            raise
        if done.fingerprint != fp:  # the server compared too; this catches a server that did not
            raise SyncError("commit", f"server fingerprint {done.fingerprint} != learner {fp}")
        report = SyncReport(ver=done.ver, fence_s=t2 - t1, wire_s=t3 - t2, commit_s=t4 - t3, total_s=t4 - t0,
                            bytes=session.bytes, n_buckets=session.n_buckets, fingerprint=done.fingerprint,
                            ver_before=begun.ver_before, drained=begun.drained, aborted=begun.aborted)
        log.info("weights synced to %s: ver %d, %d bucket(s), %.1f MB, fence %.3fs wire %.3fs commit %.3fs, "
                 "fingerprint %s", self.base_url, report.ver, report.n_buckets, report.bytes / 1e6, report.fence_s,
                 report.wire_s, report.commit_s, report.fingerprint)
        return report
