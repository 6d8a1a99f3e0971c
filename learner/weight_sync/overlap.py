"""The two pieces of ``weight_sync.mode: overlap`` on learner rank 0: a weights snapshot and the push thread.

``learner/weight_sync/boundary.py`` drives them at every step boundary (the protocol and its collectives are
there); this module holds rank 0's local machinery. What each wait is unblocked by::

    training thread (rank 0), boundary before step s              push thread "wsync-overlap" (rank 0)
    ────────────────────────────────────────────────              ──────────────────────────────────
    BackgroundPush.poll(): the finished push's outcome, if any    (idle: waits for a job)
    due and idle: WeightSnapshot.take(model)   time/sync_snapshot
        CPU:  copy_ of every weight into the staging tensors (synchronous)
        CUDA: event recorded on the training stream (after the optimizer step's kernels); the copy
              into the staging tensors runs on the snapshot stream after that event; the training
              thread does not wait. Before the NEXT optimizer step the training stream waits for
              the copy's event (guard_writes), so the update cannot overwrite a weight mid-copy.
      BackgroundPush.start(snapshot) ──────────────────────────►  with snapshot.reading():  (CUDA: a stream that
    due and busy: deferred (counted by the caller)                   waits for the copy event)
    ... trains step s, s+1, ... meanwhile                          push(snapshot) to every server: HTTP buckets or
                                                                   NCCL broadcasts on their own side streams;
                                                                   each server's push has the client's deadline
                                                                   (sync.timeout_s; the NCCL watchdog applies)
    BackgroundPush.poll() at a later boundary ◄──────────────────  outcome: committed ver or failure, timings,
                                                                   optimizer steps completed during the push

Capacity: one job. ``start`` refuses while a push is in flight; the caller defers (never queues).
Example: sync every step, a push taking 2.5 steps: started at boundary 4, deferred at 5 and 6,
adopted at 7 (where the next one starts).

Deadline: a push still running ``deadline_s`` after it started (per server: ``sync.timeout_s`` plus the
client's 10 s best-effort abort and a margin) is reported failed by ``poll`` once; the slot stays busy
until the thread returns (the server holds one sync client at a time, and an NCCL group one
broadcast), and a result that arrives after that is discarded with a warning (the next push's
``min_ver`` floor makes learner and server converge again).

Memory: the snapshot is one extra copy of the weights (on rank 0's GPU under CUDA), allocated at the
first overlap push and reused. Sharded weights (FSDP2): the snapshot is in rank 0's host memory (pinned on a
CUDA host); each rank copies its own shards at the boundary and rank 0's push thread receives them before it
pushes (learner/weight_sync/shard_snapshot.py: ``start`` takes that assembly as a callable), or, where the
shards' layout is not one dim-0 shard on a 1-D mesh, ``take_gathered`` fills it by a gather on every rank one
weight at a time after the boundary's broadcast said a push starts; training waits for that gather.

Torch threads: the push thread runs torch single-threaded (its torch work is casts and copies;
learner/torch_threads.py says why), as the Channel-A prefetch thread does.

What this module does not know: ranks, collectives, versions' meaning, or the wire protocol.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.torch_threads import pin_this_thread, start_pinned

log = logging.getLogger(__name__)

ABORT_GRACE_S = 15.0  # per server, on top of sync.timeout_s: the client's /sync/abort (10 s) and the NCCL join
THREAD_START_TIMEOUT_S = 30.0

Named = list[tuple[str, torch.Tensor]]


class WeightSnapshot:
    """A reusable staging copy of the weights, taken at a step boundary (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._device: torch.device | None = None
        self._copy_stream: Any = None  # CUDA only
        self._read_stream: Any = None  # CUDA only, used by the push thread
        self._copied: Any = None  # CUDA event: the copy into the staging tensors is done
        self._read_done: Any = None  # CUDA event: the last push finished reading them
        self._guard_pending = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def take(self, named: Named) -> Named:
        """Copy ``named`` (HF names, live weights) into the staging tensors; returns them under the same names."""
        device = named[0][1].device
        if device != self._device or list(self._buffers) != [n for n, _ in named]:
            self._allocate(named, device)
        with torch.no_grad():
            if device.type == "cuda":
                params_ready = torch.cuda.Event()
                params_ready.record(torch.cuda.current_stream(device))  # after the optimizer step's kernels
                self._copy_stream.wait_event(params_ready)
                if self._read_done is not None:  # the previous push's reads (always done by now; cheap insurance)
                    self._copy_stream.wait_event(self._read_done)
                with torch.cuda.stream(self._copy_stream):
                    for name, t in named:
                        self._buffers[name].copy_(t, non_blocking=True)
                self._copied = torch.cuda.Event()
                self._copied.record(self._copy_stream)
                self._guard_pending = True
            else:
                for name, t in named:
                    self._buffers[name].copy_(t)
        return [(name, self._buffers[name]) for name, _ in named]

    def take_gathered(self, specs: Named, gathered: Iterable[tuple[str, torch.Tensor]]) -> Named:
        """Sharded weights (FSDP2): copy each gathered full tensor into a host staging tensor as it arrives.

        ``specs``: ``(name, DTensor)`` for the full shapes and dtypes; ``gathered`` yields each weight whole,
        one at a time (a collective on every rank: learner/weight_sync/sharded.py), so rank 0's GPU holds one full
        tensor at a time and its host the snapshot. Staging tensors are pinned on a CUDA host (the copies
        run asynchronously; one synchronize at the end). The push reads them on the CPU (``reading`` is a no-op).
        """
        cpu = torch.device("cpu")
        if self._device != cpu or list(self._buffers) != [n for n, _ in specs]:
            pin = torch.cuda.is_available()
            self._buffers = {n: torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=pin) for n, t in specs}
            self._device = cpu
            log.info("overlap sync: host snapshot of the sharded weights, %.1f MB%s (reused by every push)",
                     self.nbytes / 1e6, " pinned" if pin else "")
        cuda = False
        with torch.no_grad():
            for name, full in gathered:
                cuda |= full.is_cuda
                self._buffers[name].copy_(full, non_blocking=full.is_cuda)
        if cuda:
            torch.cuda.synchronize()  # every device-to-host copy landed before the push thread reads
        return [(name, self._buffers[name]) for name, _ in specs]

    def _allocate(self, named: Named, device: torch.device) -> None:
        self._buffers = {name: torch.empty_like(t, memory_format=torch.contiguous_format) for name, t in named}
        self._device = device
        if device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(device=device)
            self._read_stream = torch.cuda.Stream(device=device)
        log.info("overlap sync: weights snapshot of %.1f MB allocated on %s (reused by every push)",
                 self.nbytes / 1e6, device)

    def guard_writes(self) -> None:
        """Training thread, before anything overwrites the weights (the optimizer step): CUDA: the training
        stream waits for the snapshot copy (a device-side wait; the thread does not block). CPU: nothing."""
        if self._guard_pending:
            torch.cuda.current_stream(self._device).wait_event(self._copied)
            self._guard_pending = False

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Push thread: CUDA work issued inside (casts, device-to-host copies, the NCCL sender's ``ready``
        event) is ordered after the snapshot copy. CPU: nothing to order."""
        if self._device is None or self._device.type != "cuda":
            yield
            return
        torch.cuda.set_device(self._device)  # the current device is per thread
        self._read_stream.wait_event(self._copied)
        try:
            with torch.cuda.stream(self._read_stream):
                yield
        finally:
            self._read_done = torch.cuda.Event()
            self._read_done.record(self._read_stream)


@dataclass
class PushOutcome:
    """What one background push came to (rank 0)."""

    ok: bool
    ver: int  # the committed ver; the learner's ver at start when not ok
    started_step: int  # the boundary it started at (optimizer steps completed then)
    steps_during: int  # optimizer steps the learner completed between the start and the commit (or failure)
    metrics: dict[str, float] = field(default_factory=dict)


PushFn = Callable[[Named, int, int], tuple[int, int, dict[str, float]]]  # (tensors, step, ver) -> (ver, ok, metrics)


class BackgroundPush:
    """At most one push at a time on one persistent daemon thread, with a deadline (module docstring)."""

    def __init__(self, push: PushFn, *, deadline_s: float, progress: Callable[[], int], servers: list[str]) -> None:
        """``progress()`` returns the optimizer steps the learner has completed (read on the push thread)."""
        self._push, self.deadline_s, self.progress, self.servers = push, deadline_s, progress, servers
        self._cond = threading.Condition()
        self._job: tuple[Named | Callable[[], Named], int, int, Callable[[], Any]] | None = None
        self._result: PushOutcome | None = None
        self._busy = False
        self._reported = False  # a failure was already reported for the running push (deadline passed)
        self._started_at = 0.0
        self._step = self._ver = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def busy(self) -> bool:
        """A push is in flight (or finished and not yet collected by :meth:`poll`)."""
        return self._busy

    def remaining_s(self) -> float:
        """Seconds until the running push's deadline (0 when idle or past it)."""
        return max(0.0, self._started_at + self.deadline_s - time.monotonic()) if self._busy else 0.0

    def start(self, tensors: Named | Callable[[], Named], step: int, ver: int, reading: Callable[[], Any]) -> None:
        """Hand a snapshot to the thread; returns at once. Never call while :attr:`busy`. ``tensors`` may be a
        callable the thread runs first for them (a sharded snapshot's assembly: timed as ``time/sync_gather``)."""
        if self._busy:
            raise RuntimeError("a weight push is already in flight (the caller defers instead)")
        if self._thread is None:
            self._start_thread()
        with self._cond:
            self._busy, self._reported, self._result = True, False, None
            self._started_at, self._step, self._ver = time.monotonic(), step, ver
            self._job = (tensors, step, ver, reading)
            self._cond.notify_all()

    def poll(self) -> PushOutcome | None:
        """The outcome of a push that finished since the last call, a failure once its deadline passed, else None."""
        if not self._busy:
            return None
        with self._cond:
            result = self._result
        if result is not None:
            self._busy = False
            if self._reported:
                log.warning("a weight push to %s reported failed at its deadline finished %.0fs after it started "
                            "(%s, ver %d); result discarded: the learner keeps its ver and the next push continues "
                            "from max(server ver, learner ver) + 1", self.servers, time.monotonic() - self._started_at,
                            "committed" if result.ok else "failed", result.ver)
                return None
            return result
        if not self._reported and time.monotonic() - self._started_at > self.deadline_s:
            self._reported = True
            log.error("weight push to %s started at step %d still running after %.0fs (deadline: %d server(s) × "
                      "(weight_sync.timeout_s + %.0fs)); reported failed, training continues on ver %d; "
                      "no new push starts until it returns. See where the thread 'wsync-overlap' is stuck with: "
                      "py-spy dump --pid <learner rank 0 pid>", self.servers, self._step, self.deadline_s,
                      len(self.servers), ABORT_GRACE_S, self._ver)
            return PushOutcome(ok=False, ver=self._ver, started_step=self._step,
                               steps_during=self.progress() - self._step, metrics={})
        return None

    def wait(self, timeout_s: float) -> PushOutcome | None:
        """Wait up to ``timeout_s`` for the push in flight, then :meth:`poll`."""
        end = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            while self._busy and self._result is None and time.monotonic() < end:
                self._cond.wait(min(0.5, max(0.0, end - time.monotonic())))
        return self.poll()

    def close(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a push in flight, then stop the thread; False if a push was left running."""
        if self._busy:
            log.info("waiting up to %.0fs for the weight push in flight before shutting down", timeout_s)
            self.wait(timeout_s)
        left_running = self._busy and self._result is None
        if left_running:
            log.error("the weight push to %s started at step %d did not finish within %.0fs at shutdown; leaving the "
                      "daemon thread (the server aborts the session after its sync_idle_timeout_s and keeps its old "
                      "weights and ver)", self.servers, self._step, timeout_s)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None and not left_running:
            self._thread.join(timeout=5.0)
        return not left_running

    # -- push thread ----------------------------------------------------------------------------

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="wsync-overlap", daemon=True)
        if not start_pinned(self._thread, self._ready, THREAD_START_TIMEOUT_S):
            raise TimeoutError(f"the weight-push thread did not start within {THREAD_START_TIMEOUT_S:.0f}s")

    def _run(self) -> None:
        try:
            pin_this_thread()
        finally:
            self._ready.set()
        while True:
            with self._cond:
                while self._job is None and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                (tensors, step, ver, reading), self._job = self._job, None
            t0 = time.monotonic()
            gather_s: dict[str, float] = {}
            try:
                if callable(tensors):
                    tensors = tensors()
                    gather_s["time/sync_gather"] = time.monotonic() - t0
                with reading():
                    new_ver, ok, metrics = self._push(tensors, step, ver)
            except BaseException:  # noqa: BLE001 - a bug here must not kill training: reported as a failed push
                log.exception("weight push thread failed at step %d (reported as a failed sync; ver %d kept)",
                              step, ver)
                new_ver, ok, metrics = ver, 0, {}
            done = self.progress()
            metrics = {**metrics, **gather_s, "time/sync_total": time.monotonic() - t0}
            with self._cond:
                self._result = PushOutcome(ok=bool(ok), ver=int(new_ver) if ok else ver, started_step=step,
                                           steps_during=done - step, metrics=metrics)
                self._cond.notify_all()
