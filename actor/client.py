"""The rollout client actors use: batched ``/infer`` over one or more rollout servers, with retries.

    client = RolloutClient.from_config(cfg, client_id="actor-r0-0", config_path="configs/demo_cpu.yaml")
    client.wait_until_ready(deadline_s=cfg.rollout_matching.vllm.timeout_s)
    result = client.infer(items, sampling, min_ver=3)      # RolloutResult
    for out in result.outputs: out.token_ids, out.ver     # ver per item (see "split" below)

Failure handling of one ``infer`` call, in order::

    POST the batch to a server (least in flight, or round robin)
      ok ─────────────────────────────────────────────────────────► one InferResponse
      retryable (timeout/stall, dropped connection, 5xx, 503, 429) ─► back off, retry ONCE on a
          fresh connection (another server if there is one)
            ok ─────────────────────────────────────────────────────► one InferResponse
            still failing, > 1 item ──► back off, split in halves, each half starts over (recursively)
            still failing, 1 item ────► RolloutError naming the item, the URLs and the last error
      connection refused twice ─────► RolloutUnavailable (no split: it cannot help) with the command
                                      that starts the server
      413 (batch too large) ────────► split at once
      other 4xx ────────────────────► RolloutRequestError at once (the request is wrong; no retry)

Back-off: ``retry_backoff_s * 2**depth`` (capped at ``retry_backoff_max_s``) times a uniform
jitter in [0.5, 1.5]; ``depth`` grows with every split level.

Split batches and versions: each sub-batch ran under one ``ver``, but halves may straddle a weight
sync, so a :class:`RolloutResult` carries the ``ver`` of every item (``result.vers``) and
``result.ver`` is None when they differ. Packs must group by the per-item ``ver``.

Thread-safe: several actor threads may share one client. Imports httpx and common only.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import ValidationError

from common.wire.codec import SCHEMA_VERSION
from common.wire.http import HealthResponse, InferItem, InferOutput, InferRequest, InferResponse, SamplingParams

log = logging.getLogger(__name__)

START_COMMAND = "make launch-rollout CONFIG={config}  (python -m rollout_server --config {config})"


class RolloutError(RuntimeError):
    """A batch (or part of it) that could not be rolled out after retries and splits."""


class RolloutRequestError(RolloutError):
    """The server refused the request itself (4xx): retrying the same bytes cannot help."""

    def __init__(self, message: str, status: int, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.field = status, field


class RolloutUnavailable(RolloutError):
    """No server accepted a connection."""


class _Retryable(Exception):
    def __init__(self, message: str, *, refused: bool = False, split_now: bool = False) -> None:
        super().__init__(message)
        self.refused, self.split_now = refused, split_now


@dataclass(frozen=True)
class RolloutOutput:
    """One item's completion and the ``ver`` of the weights that produced it."""

    id: str | None
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_token_ids: list[int]
    ver: int

    @classmethod
    def of(cls, o: InferOutput, ver: int) -> RolloutOutput:
        return cls(id=o.id, token_ids=o.token_ids, text=o.text, finish_reason=o.finish_reason,
                   prompt_token_ids=o.prompt_token_ids, ver=ver)


@dataclass
class RolloutResult:
    """Outputs in item order plus the server responses they came from (one per sub-batch)."""

    outputs: list[RolloutOutput]
    responses: list[InferResponse]

    @property
    def vers(self) -> list[int]:
        return [o.ver for o in self.outputs]

    @property
    def ver(self) -> int | None:
        """The one ``ver`` of every item, or None when a split batch straddled a sync."""
        vers = set(self.vers)
        return vers.pop() if len(vers) == 1 else None

    @property
    def split(self) -> bool:
        return len(self.responses) > 1


class RolloutClient:
    """Batched /infer with retry, split and back-off over several servers (module docstring)."""

    def __init__(self, servers: Sequence[str], *, connect_timeout_s: float = 10.0, read_timeout_s: float = 120.0,
                 retry_backoff_s: float = 0.5, retry_backoff_max_s: float = 10.0, balance: str = "least_inflight",
                 client_id: str | None = None, config_path: str | None = None,
                 sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None) -> None:
        if not servers:
            raise ValueError("RolloutClient needs at least one server URL (rollout_matching.vllm.servers)")
        if balance not in ("least_inflight", "round_robin"):
            raise ValueError(f"balance must be least_inflight or round_robin, not {balance!r}")
        self.servers = [s.rstrip("/") for s in servers]
        self.timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        self.backoff_s, self.backoff_max_s, self.balance = retry_backoff_s, retry_backoff_max_s, balance
        self.client_id = client_id
        self.config_path = config_path or "CONFIG"
        self._sleep, self._rng = sleep, rng or random.Random()
        self._http = {url: httpx.Client(base_url=url, timeout=self.timeout) for url in self.servers}
        self._lock = threading.Lock()
        self._inflight = {url: 0 for url in self.servers}
        self._rr = itertools.count()
        self.counts = {"requests": 0, "retries": 0, "splits": 0, "failures": 0}

    @classmethod
    def from_config(cls, cfg: Any, client_id: str | None = None, config_path: str | None = None) -> RolloutClient:
        v = cfg.rollout_matching.vllm
        return cls([s.base_url for s in v.servers], connect_timeout_s=v.connect_timeout_s,
                   read_timeout_s=v.infer_timeout_s, retry_backoff_s=v.retry_backoff_s,
                   retry_backoff_max_s=v.retry_backoff_max_s, balance=v.balance, client_id=client_id,
                   config_path=config_path)

    def close(self) -> None:
        for c in self._http.values():
            c.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start_command(self) -> str:
        return START_COMMAND.format(config=self.config_path)

    # ------------------------------------------------------------------ readiness

    def health(self, url: str, timeout_s: float = 5.0) -> tuple[int, HealthResponse]:
        r = self._http[url].get("/health", timeout=timeout_s)
        return r.status_code, HealthResponse.model_validate_json(r.content)

    def wait_until_ready(self, deadline_s: float, poll_s: float = 0.25) -> dict[str, HealthResponse]:
        """Block until every server answers /health ``ok`` (or ``syncing``: it admits, calls wait).

        Raises TimeoutError after ``deadline_s`` naming each URL not ready, what it last said, and
        the command that starts a server; RolloutError at once for a schema mismatch or an engine
        that failed to start.
        """
        end = time.monotonic() + deadline_s
        ready: dict[str, HealthResponse] = {}
        last: dict[str, str] = {url: "no answer yet" for url in self.servers}
        while True:
            for url in self.servers:
                if url in ready:
                    continue
                try:
                    code, h = self.health(url, timeout_s=max(0.1, min(5.0, end - time.monotonic())))
                except (httpx.HTTPError, ValidationError, ValueError) as exc:
                    last[url] = f"{type(exc).__name__}: {exc}"
                    continue
                if h.schema_version != SCHEMA_VERSION:
                    raise RolloutError(f"{url} speaks protocol schema {h.schema_version}, this client {SCHEMA_VERSION}: "
                                       "run the same tandem version on both sides")
                if h.status == "error":
                    raise RolloutError(f"{url} reports its engine in error (see the server log); restart it with "
                                       f"{self.start_command()}")
                if code == 200 or h.status == "syncing":
                    ready[url] = h
                    log.info("rollout server %s ready: %s engine, ver %d", url, h.engine, h.ver)
                else:
                    last[url] = f"status {h.status}"
            if len(ready) == len(self.servers):
                return ready
            if time.monotonic() >= end:
                waiting = "; ".join(f"{u} ({last[u]})" for u in self.servers if u not in ready)
                raise TimeoutError(f"rollout server not ready after {deadline_s:.0f}s: {waiting}. Start it with "
                                   f"{self.start_command()}, or raise rollout_matching.vllm.timeout_s if it is "
                                   "still loading")
            self._sleep(min(poll_s, max(0.0, end - time.monotonic())))

    def image_pixels_mismatch(self, ours: Any, timeout_s: float = 5.0) -> str | None:
        """The start check of the image size: why a server that answers ``/health`` resizes images otherwise than
        ``ours`` (the encoder's ``common.data.image_size.ImagePixels``); None when every server that answers resizes
        alike. One not serving yet is left to the per-prompt check (``Encoder.check_server_prompt``)."""
        from common.data.image_size import mismatch

        for url in self.servers:
            try:
                _, h = self.health(url, timeout_s=timeout_s)
            except (httpx.HTTPError, ValidationError, ValueError) as exc:
                log.info("image size of %s not checked at start (%s: %s); the per-prompt check covers it", url,
                         type(exc).__name__, exc)
                continue
            why = mismatch(h.engine_info.get("image_pixels"), ours, url=url, config=self.config_path)
            if why:
                return why
        return None

    # ------------------------------------------------------------------ infer

    def infer(self, items: Sequence[InferItem | dict[str, Any]], sampling: SamplingParams, *,
              min_ver: int | None = None, client: str | None = None) -> RolloutResult:
        """Roll out ``items`` (outputs in the same order); see the module docstring for failures."""
        batch = [i if isinstance(i, InferItem) else InferItem.model_validate(i) for i in items]
        if not batch:
            return RolloutResult(outputs=[], responses=[])
        responses = self._infer_split(batch, sampling, min_ver, client or self.client_id, 0)
        outputs = [RolloutOutput.of(o, r.ver) for r in responses for o in r.outputs]
        return RolloutResult(outputs=outputs, responses=responses)

    def _infer_split(self, items: list[InferItem], sampling: SamplingParams, min_ver: int | None,
                     client: str | None, depth: int) -> list[InferResponse]:
        try:
            return [self._attempt_twice(items, sampling, min_ver, client, depth)]
        except _Retryable as exc:
            if exc.refused:
                self.counts["failures"] += 1
                raise RolloutUnavailable(f"no rollout server accepts connections ({', '.join(self.servers)}): {exc}. "
                                         f"Start one with {self.start_command()}") from None
            if len(items) == 1:
                self.counts["failures"] += 1
                raise RolloutError(f"item {items[0].id or '<no id>'} failed after a retry on a fresh connection and "
                                   f"{depth} split(s); last error: {exc}") from None
            self.counts["splits"] += 1
            half = len(items) // 2
            log.warning("/infer of %d items failed twice (%s); splitting into %d + %d", len(items), exc, half,
                        len(items) - half)
            if not exc.split_now:
                self._backoff(depth + 1)
            return (self._infer_split(items[:half], sampling, min_ver, client, depth + 1)
                    + self._infer_split(items[half:], sampling, min_ver, client, depth + 1))

    def _attempt_twice(self, items: list[InferItem], sampling: SamplingParams, min_ver: int | None,
                       client: str | None, depth: int) -> InferResponse:
        body = InferRequest(items=items, sampling=sampling, min_ver=min_ver, client=client).model_dump_json(
            exclude_none=True).encode()
        first = self._pick()
        try:
            return self._post(first, body, len(items), fresh=False)
        except _Retryable as exc:
            if exc.split_now:
                raise
            log.info("/infer to %s failed (%s); retrying once on a fresh connection", first, exc)
            first_error = exc
        self.counts["retries"] += 1
        self._backoff(depth)
        second = self._pick(avoid=first)
        try:
            return self._post(second, body, len(items), fresh=True)
        except _Retryable as exc:
            raise _Retryable(f"{first}: {first_error}; then {second}: {exc}",
                             refused=first_error.refused and exc.refused, split_now=exc.split_now) from None

    def _backoff(self, depth: int) -> None:
        delay = min(self.backoff_max_s, self.backoff_s * 2**depth) * self._rng.uniform(0.5, 1.5)
        if delay > 0:
            self._sleep(delay)

    def _pick(self, avoid: str | None = None) -> str:
        with self._lock:
            candidates = [u for u in self.servers if u != avoid] or self.servers
            turn = next(self._rr)
            if self.balance == "round_robin":
                url = candidates[turn % len(candidates)]
            else:
                rotated = candidates[turn % len(candidates):] + candidates[: turn % len(candidates)]
                url = min(rotated, key=lambda u: self._inflight[u])
            self._inflight[url] += 1
            return url

    def _post(self, url: str, body: bytes, n_items: int, *, fresh: bool) -> InferResponse:
        """One POST /infer; the caller already counted it in flight on ``url``."""
        self.counts["requests"] += 1
        headers = {"Content-Type": "application/json"}
        try:
            if fresh:  # a new connection pool: a half-dead keep-alive socket cannot fail us twice
                with httpx.Client(base_url=url, timeout=self.timeout) as c:
                    r = c.post("/infer", content=body, headers=headers)
            else:
                r = self._http[url].post("/infer", content=body, headers=headers)
        except httpx.ConnectError as exc:
            raise _Retryable(f"connection refused ({exc})", refused=True) from None
        except httpx.TimeoutException as exc:
            raise _Retryable(f"no answer within the timeout ({type(exc).__name__}); raise "
                             "rollout_matching.vllm.infer_timeout_s if the server is just slow") from None
        except httpx.TransportError as exc:
            raise _Retryable(f"connection dropped ({type(exc).__name__}: {exc})") from None
        finally:
            with self._lock:
                self._inflight[url] -= 1
        if r.status_code == 200:
            try:
                resp = InferResponse.model_validate_json(r.content)
            except ValidationError as exc:
                raise _Retryable(f"unreadable 200 body ({exc.errors()[0]['msg']})") from None
            if len(resp.outputs) != n_items:
                raise _Retryable(f"{len(resp.outputs)} outputs for {n_items} items")
            return resp
        message, field = _error_message(r)
        if r.status_code == 413:
            raise _Retryable(f"HTTP 413: {message}", split_now=True)
        if r.status_code in (408, 429) or r.status_code >= 500:
            raise _Retryable(f"HTTP {r.status_code}: {message}")
        raise RolloutRequestError(f"{url}/infer refused the request (HTTP {r.status_code}): {message}",
                                  r.status_code, field)


def _error_message(r: httpx.Response) -> tuple[str, str | None]:
    try:
        body = r.json()
        return str(body.get("message", r.text)), body.get("field")
    except (ValueError, AttributeError):
        return r.text[:300], None
