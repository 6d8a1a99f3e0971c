"""The sync fence (docs/design.md section 4): the rollout server's admission gate and its version counter.

Readers are /infer batches (:meth:`Fence.run`); the writer is a weight sync
(:class:`rollout_server.weight_sync.session.SyncController`). Each admitted batch holds a :class:`Ticket` carrying
the ``ver`` it was admitted under; the fence never lets a commit happen while a ticket is out, so
that ``ver`` is exact for the whole batch::

    /infer ──► Fence.run ──admitted (open, ver >= min_ver)──► work() holding a Ticket(ver) ──► released
                  │ waits while closed, or until ver >= min_ver
                  │   ← unblocked by open(ver): ver set and waiters woken in one step
                  │   ← or AdmissionTimeout after rollout_server.admission_timeout_s
    sync: close() ─► [abort mode: abort_inflight()] ─► wait_quiet() ← the last ticket's release
          ... weights swapped ... ─► open(ver + 1)

``abort`` fence mode: a cancelled batch is re-run by :meth:`Fence.run` after the fence reopens, under
the new ``ver``; the client just sees a slower success (no ``finish_reason: abort`` ever leaves the
server). An abort of a request that had already produced its outputs is a no-op: the batch keeps
its old ``ver``. A batch is cut at most once (:data:`MAX_CUTS`): its re-run is drained by the next
fence, not cut again. Without that bound, syncs that come faster than a batch runs cut every batch
forever: on 4 x H200 (2026-11-26) a tiny learner syncing every ~2.5 s left its 4 actors with zero
finished rollouts in 75 s and its evaluation waiting 69 s, every fence aborting the same 5 batches.

What this module does not know: HTTP, sessions, engines or weights (the sync controller closes and
opens the fence; the /infer route runs its work through it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

#: How many times an abort-mode fence may cut one batch; a batch cut this often is drained instead. One
#: cut keeps abort's point (a sync does not wait for work started under the old weights) and bounds every
#: batch's latency by one re-run, however often syncs come.
MAX_CUTS = 1


class AdmissionTimeout(Exception):
    """An /infer call waited longer than ``rollout_server.admission_timeout_s`` at the fence."""


@dataclass(eq=False)
class Ticket:
    """One admitted batch: the ``ver`` it runs under and the task computing it."""

    ver: int
    admitted_at: float
    task: asyncio.Future | None = None
    aborted: bool = False
    cuts: int = 0  # times this batch was cut before this admission: at MAX_CUTS a fence drains it


class Fence:
    """Admission gate: many batches in flight, or one weight sync, never both.

    ``run(work)`` waits while the gate is closed (or until ``ver >= min_ver``), then runs
    ``work()`` holding a ticket. ``close()`` stops new admissions; ``wait_quiet()`` is unblocked
    by the last ticket's release; ``open(ver)`` sets the new version and wakes the waiters in one
    step, so nobody is admitted under a stale ``ver``.
    """

    def __init__(self, ver: int = 0, on_wait: Callable[[float], None] | None = None) -> None:
        self.ver = ver
        self.reruns = 0
        self.spared = 0  # abort-mode fences that drained a re-run batch instead of cutting it again
        self.waiting = 0
        self._open = True
        self._cond = asyncio.Condition()
        self._inflight: set[Ticket] = set()
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._on_wait = on_wait

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    async def run(self, work: Callable[[], Awaitable[T]], *, min_ver: int | None = None,
                  timeout_s: float = 600.0) -> tuple[Ticket, T]:
        """Run ``work()`` under an admission ticket; re-run it if an abort-mode fence cuts it (once)."""
        cuts = 0
        while True:
            ticket = await self._admit(min_ver, timeout_s)
            ticket.cuts = cuts
            try:
                task = asyncio.ensure_future(work())
                ticket.task = task
                try:
                    result = await task
                except asyncio.CancelledError:
                    me = asyncio.current_task()
                    if ticket.aborted and (me is None or not me.cancelling()):
                        self.reruns += 1
                        cuts += 1
                        continue  # cut by the fence, not by our caller: wait for the gate, run again
                    raise
                return ticket, result
            finally:
                self._release(ticket)

    async def _admit(self, min_ver: int | None, timeout_s: float) -> Ticket:
        def admissible() -> bool:
            return self._open and (min_ver is None or self.ver >= min_ver)

        async with self._cond:
            if not admissible():
                self.waiting += 1
                t0 = time.monotonic()
                try:
                    await asyncio.wait_for(self._cond.wait_for(admissible), timeout=timeout_s)
                except TimeoutError:
                    why = "the sync fence to reopen" if not self._open else f"ver >= {min_ver} (now {self.ver})"
                    raise AdmissionTimeout(f"waited {timeout_s:.0f}s for {why}") from None
                finally:
                    self.waiting -= 1
                    if self._on_wait is not None:
                        self._on_wait(time.monotonic() - t0)
            ticket = Ticket(ver=self.ver, admitted_at=time.monotonic())
            self._inflight.add(ticket)
            self._quiet.clear()
            return ticket

    def _release(self, ticket: Ticket) -> None:
        self._inflight.discard(ticket)
        if not self._inflight:
            self._quiet.set()

    async def close(self) -> int:
        """Stop admitting; returns the batches in flight at that moment."""
        async with self._cond:
            self._open = False
            return len(self._inflight)

    def abort_inflight(self) -> int:
        """Cancel every running batch not yet cut :data:`MAX_CUTS` times (they re-run after :meth:`open`; the
        others are drained); returns how many were cut."""
        n = 0
        for ticket in list(self._inflight):
            if ticket.task is None or ticket.task.done():
                continue
            if ticket.cuts >= MAX_CUTS:
                self.spared += 1
                continue
            ticket.aborted = True
            ticket.task.cancel()
            n += 1
        return n

    async def wait_quiet(self, timeout_s: float) -> None:
        """Return once no batch holds a ticket; TimeoutError after ``timeout_s``."""
        await asyncio.wait_for(self._quiet.wait(), timeout=timeout_s)

    async def open(self, ver: int | None = None) -> None:
        """Set ``ver`` (if given) and reopen admission, atomically for waiters."""
        async with self._cond:
            if ver is not None:
                if ver < self.ver:
                    raise ValueError(f"ver must not go back ({self.ver} -> {ver})")
                self.ver = ver
            self._open = True
            self._cond.notify_all()
