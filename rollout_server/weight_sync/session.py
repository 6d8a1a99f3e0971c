"""The weight-sync session state machine behind ``/sync/*`` (docs/design.md section 4), owned by the rollout server.

:class:`SyncController` serves one sync client at a time. It closes the admission gate
(:class:`rollout_server.fence.Fence`) while new weights arrive and reopens it under the next ``ver``
once they are committed (a session that fails reopens it under the old ``ver``).

State machine (``SyncState``), with what unblocks each wait::

      idle ──init──► open ──begin──► fenced ──bucket*──► fenced ──commit──► committing ──► idle
       ▲               │  (admission closes: new /infer wait in Fence.run;      │  weights swapped,
       │               │   drain: wait for in-flight tickets to finish          │  caches reset,
       │               │   abort: cancel them; they re-run after the commit)    │  THEN ver += 1,
       │               │                                                        │  THEN admission opens
       └── abort, any failure (bad bucket, incomplete commit, drain timeout),
           idle timeout (rollout_server.sync_idle_timeout_s) or session deadline:
           staged weights dropped, old weights and old ver kept, admission reopens

What this module does not know: HTTP (routes call it with protocol models), how an engine stores
weights (it calls the Engine interface), or how /infer batches are admitted and re-run (the fence).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from common.weight_sync.messages import (MAX_VER_JUMP, SyncAbortRequest, SyncAbortResponse, SyncBeginRequest,
                                         SyncBeginResponse, SyncBucketHeader, SyncBucketResponse, SyncCommitRequest,
                                         SyncCommitResponse, SyncInitRequest, SyncInitResponse, SyncIpcRequest,
                                         SyncState)
from common.weight_sync import packed as P
from rollout_server.engines.base import Engine, WeightUpdateError
from rollout_server.errors import ApiError
from rollout_server.fence import Fence

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Session:
    """One sync client's session (created by /sync/init, ended by commit, abort or a timeout)."""

    id: str
    client: str
    transport: str
    deadline: float
    started: float = field(default_factory=time.monotonic)
    last_activity: float = field(default_factory=time.monotonic)
    busy: int = 0
    next_index: int = 0
    nbytes: int = 0
    fence_done: float | None = None
    fence_s: float = 0.0
    update_started: bool = False  # an NCCL /sync/update or an /sync/ipc bucket reached the engine
    data_token: str | None = None  # http: what a bucket stream connection quotes (rollout_server/weight_sync/stream.py)


class SyncController:
    """The ``/sync/*`` state machine around one engine and one fence (see the module docstring)."""

    def __init__(self, engine: Engine, fence: Fence, *, idle_timeout_s: float, metrics: Any = None) -> None:
        self.engine = engine
        self.fence = fence
        self.idle_timeout_s = idle_timeout_s
        self.metrics = metrics
        self.state = SyncState.IDLE
        self.session: Session | None = None
        self.error: str | None = None  # set when the server can no longer vouch for its outputs
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------ helpers

    def _describe_holder(self) -> str:
        s = self.session
        assert s is not None
        idle = time.monotonic() - s.last_activity
        return (f"sync session {s.id} is held by {s.client!r} (state {self.state.value}, idle {idle:.1f}s; "
                f"it expires after {self.idle_timeout_s:.0f}s idle)")

    @contextlib.asynccontextmanager
    async def _op(self, session_id: str, *allowed: SyncState):
        """Run one /sync call on the open session ``session_id`` under the lock; whatever fails inside
        (a wrong state, a bad bucket, an engine error) goes through :meth:`_request_failed`."""
        async with self._lock:
            try:
                s = self._open_session(session_id, allowed)
            except ApiError as exc:
                raise await self._request_failed(session_id, exc) from None
            s.busy += 1
            s.last_activity = time.monotonic()
            try:
                yield s
            except ApiError as exc:
                raise await self._request_failed(session_id, exc) from None
            except Exception as exc:  # noqa: BLE001 - an engine failure ends the session like any other
                log.exception("sync %s: a /sync call failed", session_id)
                raise await self._request_failed(session_id, ApiError(
                    500, "engine_error", f"{type(exc).__name__}: {exc}")) from None
            finally:
                s.busy -= 1
                s.last_activity = time.monotonic()

    # ------------------------------------------------------------------ the failure rule

    async def request_failed(self, session_id: str | None, exc: ApiError) -> ApiError:
        """THE rule for a /sync/* request that fails -- request validation (422), transport (408, 413,
        a dropped upload) or semantics (409, 4xx from the engine, 5xx): see :meth:`_request_failed`.
        Routes call it for failures found before the controller runs (app.py: validation errors;
        routes/sync.py: a bad bucket header, a refused or stalled upload); :meth:`_op` for everything after."""
        async with self._lock:
            return await self._request_failed(session_id, exc)

    async def _request_failed(self, session_id: str | None, exc: ApiError) -> ApiError:
        """Lock held. A failed request that names the open session ends it: staged weights dropped, old
        weights and ver kept, admission reopened; the error's message says so. Only its holder knows a
        session's id (a random token), so a request naming it is the holder's own. A request that names
        no session or another one leaves the open session alone (a stray client must not cost the
        holder its sync), and a 401 never ends one (the caller did not prove who it is); the message
        says that nothing was ended when a session is open and the request named none."""
        s = self.session
        if s is None or exc.status == 401 or session_id != s.id:
            if s is not None and session_id is None:
                exc.body.message += " -- no sync session was ended: this request names none"
            return exc
        reason = f"{exc.status} {exc.body.error}" + (f" on {exc.body.field}" if exc.body.field else "")
        return await self._fail(exc, reason, "stalled" if exc.status == 408 else "failed")

    def check_bucket(self, session_id: str) -> Session:
        """The open, fenced session a bucket names, checked before its body is read: 409 otherwise
        (nothing read, nothing ended: a stray or late bucket must not cost the holder its session)."""
        return self._open_session(session_id, (SyncState.FENCED,))

    def _open_session(self, session_id: str, allowed: tuple[SyncState, ...]) -> Session:
        """The open session ``session_id`` names, in one of the ``allowed`` states; a 409 naming why not."""
        s = self.session
        if s is None:
            raise ApiError(409, "sync_state", f"no sync session is open (session {session_id!r} ended: committed, "
                           "aborted, or timed out); start again with /sync/init", field="session")
        if s.id != session_id:
            raise ApiError(409, "sync_conflict", f"session {session_id!r} is not the open one: "
                           + self._describe_holder(), field="session")
        if self.state not in allowed:
            raise ApiError(409, "sync_state", f"call not allowed in state {self.state.value} "
                           f"(allowed: {', '.join(a.value for a in allowed)})")
        return s

    @contextlib.contextmanager
    def receiving(self, session_id: str):
        """Mark the session busy while a bucket body is still arriving. The body is read under a gap
        deadline of at most ``idle_timeout_s`` and the session's deadline (routes/sync.py), so a stalled
        upload ends the session through :meth:`request_failed` as an idle one would."""
        s = self.session
        if s is None or s.id != session_id:
            yield
            return
        s.busy += 1
        try:
            yield
        finally:
            s.busy -= 1
            s.last_activity = time.monotonic()

    async def _end(self, reason: str, outcome: str) -> None:
        """Drop the session and anything staged; keep weights and ver; reopen admission. Lock held."""
        s = self.session
        with contextlib.suppress(Exception):
            await self.engine.discard()
        if s is not None and s.update_started and getattr(self.engine, "updates_in_place", False):
            # vLLM loads NCCL and IPC buckets as they arrive: nothing staged to drop, so the
            # served weights may already be (partly) new while ver is old. Refuse to serve them.
            self.error = (f"sync {s.id} ended after its {s.transport} update had started loading weights ({reason}); "
                          "served weights no longer match ver: restart the rollout server")
            log.error("%s", self.error)
        if not self.fence.is_open and self.error is None:
            with contextlib.suppress(Exception):
                await self.engine.resume()
            await self.fence.open()
        self.session, self.state = None, SyncState.IDLE
        if self.metrics is not None:
            self.metrics.syncs.labels(outcome=outcome).inc()
        log.warning("sync session %s from %s ended without commit (%s): old weights kept, ver %d",
                    s.id if s else "?", s.client if s else "?", reason, self.fence.ver)

    async def _fail(self, exc: ApiError, reason: str, outcome: str = "failed") -> ApiError:
        await self._end(reason, outcome)
        exc.body.message += f" -- sync session aborted, old weights kept (ver {self.fence.ver})"
        return exc

    # ------------------------------------------------------------------ routes

    async def init(self, req: SyncInitRequest) -> SyncInitResponse:
        async with self._lock:
            if self.session is not None:
                raise ApiError(409, "sync_conflict", self._describe_holder() + "; one sync client at a time",
                               hint="wait for it, or abort it with /sync/abort and its session id")
            if req.transport not in self.engine_transports():
                raise ApiError(400, "bad_request", f"transport {req.transport!r} is not served by the "
                               f"{self.engine.name} engine (it takes {self.engine_transports()})", field="transport",
                               hint="set weight_sync.transport: http")
            joins = self.engine.collective_backend()
            if req.transport == "nccl" and req.backend != joins:
                raise ApiError(400, "bad_request", f"backend {req.backend!r}: the {self.engine.name} engine joins "
                               f"{joins!r} groups only (its model is on {'a GPU' if joins == 'nccl' else 'CPU'})",
                               field="backend", hint="keep the learner's weights and the server's model on the same "
                               "kind of device (GPU: nccl, CPU: gloo), or set weight_sync.transport: "
                               "http")
            if req.transport == "nccl":
                # Blocks until learner rank 0 joins the group (it joins while this call is in flight).
                try:
                    await asyncio.wait_for(self.engine.init_nccl(req), timeout=req.timeout_s)  # type: ignore[attr-defined]
                except TimeoutError:
                    raise ApiError(504, "sync_timeout", f"learner rank 0 did not join the weight-transfer group at "
                                   f"{req.master_addr}:{req.master_port} within {req.timeout_s:.0f}s",
                                   hint="the learner joins while its /sync/init is in flight "
                                   "(learner/weight_sync/nccl.py)") from None
                except Exception as exc:  # noqa: BLE001 - reported to the learner, no session opened
                    raise ApiError(500, "engine_error", f"joining the weight-transfer group at {req.master_addr}:"
                                   f"{req.master_port} failed: {type(exc).__name__}: {exc}") from None
            try:  # an adapter's first session copies its layers' base weights: off the event loop
                terms = await asyncio.to_thread(self.engine.open_session, req.skip, req.adapter)
            except WeightUpdateError as exc:
                where = "adapter" if exc.field == "adapter" else "skip"
                raise ApiError(400, "bad_request", f"{where}: {exc}", field=where) from None
            self.session = Session(id=f"s-{secrets.token_hex(4)}", client=req.client, transport=req.transport,
                                   deadline=time.monotonic() + req.timeout_s,
                                   data_token=secrets.token_urlsafe(24) if req.transport == "http" else None)
            self.state = SyncState.OPEN
            log.info("sync session %s opened by %s (%s%s%s)", self.session.id, req.client, req.transport,
                     f", {len(terms.skip)} frozen name(s) kept" if terms.skip else "",
                     f", {req.adapter.type} adapter on {len(req.adapter.layers)} layer(s)" if req.adapter else "")
            if terms.skip_refused:
                log.info("sync session %s: frozen names not taken: %s", self.session.id, terms.skip_refused)
            return SyncInitResponse(session=self.session.id, ver=self.fence.ver, dtype=self.engine.serving_dtype(),
                                    manifest=self.engine.manifest(), tied=self.engine.tied_groups(),
                                    data_token=self.session.data_token, skip=terms.skip,
                                    skip_refused=terms.skip_refused, adapter_manifest=terms.adapter_manifest)

    def engine_transports(self) -> list[str]:
        return list(getattr(self.engine, "transports", ("http",)))

    async def begin(self, req: SyncBeginRequest) -> SyncBeginResponse:
        async with self._op(req.session, SyncState.OPEN) as s:
            t0 = time.monotonic()
            in_flight = await self.fence.close()
            self.state = SyncState.FENCED
            spared_before = self.fence.spared
            aborted = self.fence.abort_inflight() if req.mode == "abort" else 0
            spared = self.fence.spared - spared_before
            try:
                await self.fence.wait_quiet(req.timeout_s)
            except TimeoutError:
                raise ApiError(504, "sync_timeout", f"{self.fence.inflight} /infer batch(es) still "
                               f"running after {req.timeout_s:.0f}s of drain") from None
            await self.engine.pause()
            s.fence_done = time.monotonic()
            s.fence_s = s.fence_done - t0
            if self.metrics is not None:
                self.metrics.sync_seconds.labels(phase="fence").observe(s.fence_s)
            log.info("sync %s: fence closed (%s) in %.3fs, drained %d, aborted %d%s",
                     s.id, req.mode, s.fence_s, in_flight - aborted, aborted,
                     f" ({spared} drained re-run(s) of batches cut by an earlier fence)" if spared else "")
            return SyncBeginResponse(ver_before=self.fence.ver, drained=in_flight - aborted, aborted=aborted,
                                     fence_s=s.fence_s, spared=spared)

    async def bucket(self, header: SyncBucketHeader, body: torch.Tensor) -> SyncBucketResponse:
        """One HTTP bucket: ``body`` is the received bytes (a flat uint8 tensor), the tensors packed end to end."""
        async with self._op(header.session, SyncState.FENCED) as s:
            t0 = time.monotonic()
            await self._check_index(s, header)
            try:
                tensors = P.unpack(body, header.names, header.dtypes, header.shapes, header.offsets)
            except ValueError as exc:
                raise ApiError(400, "bad_request", f"bucket {header.index}: {exc}", field="body") from None
            try:
                nbytes = await self.engine.stage_bucket(tensors)
            except WeightUpdateError as exc:
                raise ApiError(400, "bad_request", f"bucket {header.index}: {exc}",
                               field=f"names.{exc.field}" if exc.field else "names") from None
            return self._staged(s, header, len(tensors), nbytes, t0)

    async def ipc(self, req: SyncIpcRequest) -> SyncBucketResponse:
        """One ``ipc`` bucket: the engine copies it out of the learner's shared buffer before this returns."""
        async with self._op(req.session, SyncState.FENCED) as s:
            if "ipc" not in self.engine_transports():
                raise ApiError(400, "bad_request", f"/sync/ipc is not served by the {self.engine.name} engine",
                               field="transport", hint="set weight_sync.transport: http")
            if s.transport != "ipc":
                raise ApiError(409, "sync_state", f"this session was opened with transport {s.transport}: /sync/ipc "
                               "serves sessions opened with transport ipc", field="transport")
            t0 = time.monotonic()
            await self._check_index(s, req)
            s.update_started = True
            self.engine.last_update_info = None
            try:
                nbytes = await asyncio.wait_for(self.engine.receive_ipc(req), timeout=max(1.0, s.deadline - t0))
            except TimeoutError:
                raise ApiError(504, "sync_timeout", f"ipc bucket {req.index} not loaded before the "
                               "session deadline") from None
            except (ValueError, WeightUpdateError) as exc:
                field = ("source" if not isinstance(exc, WeightUpdateError)  # WeightUpdateError is a ValueError too
                         else f"names.{exc.field}" if exc.field else "names")
                raise ApiError(400, "bad_request", f"ipc bucket {req.index}: {exc}", field=field) from None
            except Exception as exc:  # noqa: BLE001 - any failure ends the session, old weights kept
                raise ApiError(500, "engine_error", f"ipc bucket {req.index}: {type(exc).__name__}: "
                               f"{exc}") from None
            return self._staged(s, req, len(req.names), nbytes, t0, load=self.engine.last_update_info)

    async def _check_index(self, s: Session, header: SyncBucketHeader) -> None:
        if header.index != s.next_index:
            raise ApiError(409, "sync_state", f"bucket index {header.index}, expected {s.next_index} "
                           "(buckets are numbered from 0, in order)", field="index")

    def _staged(self, s: Session, header: SyncBucketHeader, n_tensors: int, nbytes: int, t0: float,
                load: dict | None = None) -> SyncBucketResponse:
        s.next_index += 1
        s.nbytes += nbytes
        if self.metrics is not None:
            self.metrics.sync_bytes.inc(nbytes)
        return SyncBucketResponse(session=s.id, index=header.index, n_tensors=n_tensors, nbytes=nbytes,
                                  elapsed_s=time.monotonic() - t0, load=load)

    async def update(self, header: SyncBucketHeader) -> SyncBucketResponse:
        """One NCCL bucket: the engine receives what the learner broadcasts (``/sync/update``)."""
        async with self._op(header.session, SyncState.FENCED) as s:
            if "nccl" not in self.engine_transports():
                raise ApiError(400, "bad_request", f"/sync/update (NCCL) is not served by the {self.engine.name} "
                               "engine; send packed buckets to /sync/bucket (or use transport ipc)", field="transport")
            if s.transport != "nccl":
                raise ApiError(409, "sync_state", "this session was opened with transport http: send /sync/bucket",
                               field="transport")
            t0 = time.monotonic()
            budget = max(1.0, s.deadline - t0)
            s.update_started = True
            self.engine.last_update_info = None
            try:
                nbytes = await asyncio.wait_for(self.engine.receive_nccl(header), timeout=budget)  # type: ignore[attr-defined]
            except TimeoutError:
                # The engine may still sit in a collective that never completes (vLLM's PyNccl has no
                # timeout): it cannot be trusted to serve or to take another update. Keep the fence
                # closed, report error on /health and /infer, and say how to recover.
                self.error = (f"NCCL weight receive did not finish within {budget:.0f}s (learner rank 0 gone?); "
                              "restart the rollout server")
                self.session, self.state = None, SyncState.IDLE
                if self.metrics is not None:
                    self.metrics.syncs.labels(outcome="timeout").inc()
                log.error("sync %s: %s", s.id, self.error)
                raise ApiError(504, "sync_timeout", self.error) from None
            except WeightUpdateError as exc:
                raise ApiError(400, "bad_request", f"NCCL update {header.index}: {exc}",
                               field=f"names.{exc.field}" if exc.field else "names") from None
            except Exception as exc:  # noqa: BLE001 - any failure ends the session, old weights kept
                raise ApiError(500, "engine_error", f"NCCL update {header.index}: "
                               f"{type(exc).__name__}: {exc}") from None
            return self._staged(s, header, len(header.names), nbytes, t0, load=self.engine.last_update_info)

    async def commit(self, req: SyncCommitRequest) -> SyncCommitResponse:
        async with self._op(req.session, SyncState.FENCED) as s:
            if req.n_buckets != s.next_index:
                raise ApiError(409, "sync_state", f"commit says {req.n_buckets} bucket(s), the server "
                               f"staged {s.next_index}", field="n_buckets")
            if req.min_ver is not None and req.min_ver > self.fence.ver + MAX_VER_JUMP:
                raise ApiError(400, "bad_request", f"min_ver {req.min_ver} is more than {MAX_VER_JUMP} "
                               f"above the server's ver {self.fence.ver}: ver never comes back down, "
                               "so a wrong min_ver would stick for good", field="min_ver",
                               hint="send the learner's own ver + 1")
            self.state = SyncState.COMMITTING
            t0 = time.monotonic()
            try:
                caches_reset = await self.engine.commit(req.fingerprint)
            except WeightUpdateError as exc:
                raise ApiError(400, "bad_request", str(exc), field=exc.field) from None
            if not caches_reset:  # pragma: no cover - vLLM only
                self.error = "cache reset failed after a weight update; restart the server"
                self.session, self.state = None, SyncState.IDLE
                raise ApiError(500, "engine_error", self.error)
            fp = self.engine.fingerprint()
            ver = max(self.fence.ver + 1, req.min_ver or 0)
            await self.engine.resume()
            await self.fence.open(ver)  # ver += 1, THEN admission reopens (one step for waiters)
            commit_s = time.monotonic() - t0
            self.session, self.state = None, SyncState.IDLE
            if self.metrics is not None:
                m = self.metrics
                m.sync_seconds.labels(phase="wire").observe(t0 - (s.fence_done or t0))
                m.sync_seconds.labels(phase="commit").observe(commit_s)
                m.sync_seconds.labels(phase="total").observe(time.monotonic() - s.started)
                m.syncs.labels(outcome="committed").inc()
            log.info("sync %s committed: ver %d, %d bucket(s), %.1f MB, fingerprint %s, commit %.3fs",
                     s.id, ver, s.next_index, s.nbytes / 1e6, fp, commit_s)
            return SyncCommitResponse(ver=ver, commit_s=commit_s, fingerprint=fp)

    async def abort(self, req: SyncAbortRequest) -> SyncAbortResponse:
        async with self._lock:
            if self.session is None:
                return SyncAbortResponse(ver=self.fence.ver, state=self.state, aborted=False)
            if self.session.id != req.session:
                raise ApiError(409, "sync_conflict", f"session {req.session!r} is not the open one: "
                               + self._describe_holder(), field="session")
            await self._end(f"aborted by client: {req.reason or 'no reason given'}", "aborted")
            return SyncAbortResponse(ver=self.fence.ver, state=self.state, aborted=True)

    async def watchdog(self, period_s: float = 0.2) -> None:
        """Abort sessions idle past ``idle_timeout_s`` or past their own deadline (runs forever)."""
        while True:
            await asyncio.sleep(period_s)
            s = self.session
            if s is None or s.busy:
                continue
            now = time.monotonic()
            reason = ("idle timeout" if now - s.last_activity > self.idle_timeout_s
                      else "session deadline" if now > s.deadline else None)
            if reason is None:
                continue
            async with self._lock:
                if self.session is s and not s.busy:
                    await self._end(f"{reason} after {now - s.last_activity:.1f}s without a call", "timeout")

    async def shutdown(self) -> None:
        async with self._lock:
            if self.session is not None:
                await self._end("server shutting down", "aborted")
