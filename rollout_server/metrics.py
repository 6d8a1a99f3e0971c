"""Prometheus metrics of one rollout server (one registry per app, so tests can build several).

Served as text at ``GET /metrics``. Names (Prometheus forbids ``/``; the ``rollout_`` prefix plays
the role of the ``<area>/`` of run metrics)::

    rollout_requests_total{route,code}        HTTP requests by route and status code
    rollout_items_total                       prompts completed (/infer and /v1/*)
    rollout_prompt_tokens_total               prompt tokens seen by the engine
    rollout_generated_tokens_total            tokens generated
    rollout_tokens_per_second                 generated tokens/s over the last 30 s
    rollout_infer_seconds                     admission -> response of one batch (histogram)
    rollout_inflight                          batches holding an admission ticket now
    rollout_admission_waiting                 /infer calls waiting at a closed fence now
    rollout_admission_wait_seconds            time spent waiting at the fence (histogram)
    rollout_fence_reruns                      batches cut by an abort-mode fence and re-run
    rollout_fence_spared                      re-run batches an abort-mode fence drained instead of cutting again
    rollout_sync_seconds{phase}               fence | wire | commit | total, per committed sync
    rollout_syncs_total{outcome}              committed | aborted | failed | timeout | stalled (upload stopped)
    rollout_cancelled_total{reason}           batches cancelled before they finished: client_disconnect
    rollout_sync_bytes_total                  weight bytes staged
    rollout_ver                               weight version served now
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

#: Routes reported by name; anything else is counted as ``other`` (bounded label cardinality).
KNOWN_ROUTES = ("/health", "/infer", "/metrics", "/sync/init", "/sync/begin", "/sync/bucket", "/sync/update",
                "/sync/commit", "/sync/abort", "/sync/digest", "/v1/models", "/v1/completions", "/v1/chat/completions")

_WINDOW_S = 30.0


class ServerMetrics:
    """The server's collectors; ``bind(fence)`` wires the live gauges to the fence."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("rollout_requests", "HTTP requests by route and status code", ["route", "code"], registry=r)
        self.items = Counter("rollout_items", "Prompts completed", registry=r)
        self.prompt_tokens = Counter("rollout_prompt_tokens", "Prompt tokens seen by the engine", registry=r)
        self.generated_tokens = Counter("rollout_generated_tokens", "Tokens generated", registry=r)
        self.tokens_per_s = Gauge("rollout_tokens_per_second", f"Generated tokens/s over the last {_WINDOW_S:.0f} s",
                                  registry=r)
        self.infer_seconds = Histogram("rollout_infer_seconds", "Admission to response of one batch", registry=r,
                                       buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.inflight = Gauge("rollout_inflight", "Batches holding an admission ticket", registry=r)
        self.admission_waiting = Gauge("rollout_admission_waiting", "Calls waiting at a closed fence", registry=r)
        self.admission_wait = Histogram("rollout_admission_wait_seconds", "Time spent waiting at the fence", registry=r,
                                        buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300))
        self.reruns = Gauge("rollout_fence_reruns", "Batches cut by an abort-mode fence and re-run", registry=r)
        self.spared = Gauge("rollout_fence_spared", "Re-run batches an abort-mode fence drained instead of cutting "
                            "again (a batch is cut at most once)", registry=r)
        self.sync_seconds = Histogram("rollout_sync_seconds", "Weight sync duration by phase", ["phase"], registry=r,
                                      buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.syncs = Counter("rollout_syncs", "Sync sessions by outcome", ["outcome"], registry=r)
        self.cancelled = Counter("rollout_cancelled", "Batches cancelled before they finished (waiting or generating)",
                                 ["reason"], registry=r)
        self.sync_bytes = Counter("rollout_sync_bytes", "Weight bytes staged", registry=r)
        self.ver = Gauge("rollout_ver", "Weight version served", registry=r)
        for phase in ("fence", "wire", "commit", "total"):
            self.sync_seconds.labels(phase=phase)
        for outcome in ("committed", "aborted", "failed", "timeout", "stalled"):
            self.syncs.labels(outcome=outcome)
        self.cancelled.labels(reason="client_disconnect")
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        self._window_lock = threading.Lock()
        self._t0 = time.monotonic()
        self.tokens_per_s.set_function(self._rate)

    def bind(self, fence: Any) -> None:
        self.inflight.set_function(lambda: fence.inflight)
        self.admission_waiting.set_function(lambda: fence.waiting)
        self.reruns.set_function(lambda: fence.reruns)
        self.spared.set_function(lambda: fence.spared)
        self.ver.set_function(lambda: fence.ver)

    def observe_cancelled_tokens(self, generated: int) -> None:
        """Tokens a cancelled batch generated before it stopped: generated all the same (and in the rate)."""
        self.generated_tokens.inc(generated)
        with self._window_lock:
            self._window.append((time.monotonic(), generated))

    def observe_batch(self, n_items: int, prompt_tokens: int, generated: int, seconds: float) -> None:
        self.items.inc(n_items)
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated)
        self.infer_seconds.observe(seconds)
        with self._window_lock:
            self._window.append((time.monotonic(), generated))

    def _rate(self) -> float:
        now = time.monotonic()
        with self._window_lock:
            while self._window and now - self._window[0][0] > _WINDOW_S:
                self._window.popleft()
            total = sum(n for _, n in self._window)
        return total / max(1e-9, min(_WINDOW_S, now - self._t0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """Pure ASGI middleware counting requests by route and final status (streaming-safe)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics
        self._children: dict[tuple[str, int], Any] = {}  # (route, code) -> its counter: no labels() per request

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in KNOWN_ROUTES else "other"
        code = {"status": 500}

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                code["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            key = (route, code["status"])
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self.metrics.requests.labels(route=route, code=str(key[1]))
            child.inc()
