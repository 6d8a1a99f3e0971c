"""Channel-A windows built one step ahead on a background thread, so an A step only picks one up.

One thread per rank (``channel-a-prefetch-r<rank>``) owns this rank's :class:`~learner.data.ChannelAData`
(and its Encoder) from :meth:`ChannelAPrefetcher.start` on; the training thread never touches it again::

    training thread                                    prefetch thread
    ───────────────                                    ───────────────
    start() ────────────────────────────────────────►  build window 0: ChannelAData.next_window + Pack.tensors
                                                       put it in the slot ─► sleep until the slot is empty
    A step: take(ver) ── waits for the slot ──────────  (unblocked by the window, or the thread's exception;
            (deadline, time/wait_for_a_window)           deadline_s: the learner gives half its collective one)
            retags the window's segments with ver,
            adopts the window's sampler state as
            "consumed", empties the slot ────────────►  build window 1 while the step trains ...
    B step: takes nothing; the ready window waits (the sampler does not advance: no A data is skipped)
    save:   state_dict() = the state right after the last window TAKEN, never the one in the slot
    close:  stop flag, then join with a deadline (a window in progress is finished, not abandoned)

Capacity: one slot. At most one window is built or being built ahead of consumption, whatever the
number of B steps in between. Example: the A step at optimizer step 4 takes window 2; the thread
builds window 3 during step 4 and then sleeps through B steps 5 and 6; the A step 7 takes window 3
(retagged with step 7's ver) and the thread starts window 4.

Exact resume: a window is a pure function of the sampler state (epoch, position, carry) it starts
from, and every window carries ``ChannelAData.state_dict()`` taken right after it was built. A
checkpoint stores the state after the last taken window, so the resumed thread rebuilds the window
that was waiting at save time — the same samples, in the same packs — and the run goes on as if
never interrupted. ``ahead`` (0 or 1) is saved next to it for inspection only; it is not restored.

Versions: a window is built before its ``ver`` is known; :meth:`ChannelAPrefetcher.take` retags its
segments and packs with the learner's ver at consumption, as the synchronous path tags them at build
time. ``Pack.tensors()`` holds no ver, so the arrays built on the thread stay valid.

Torch threads: the build is numpy, PIL, tokenizers and a few tiny torch ops (the rope index), so
this thread runs torch single-threaded and the training thread keeps its count
(learner/torch_threads.py). Much of the build is Python and holds the GIL: the overlap is real
where the training thread blocks with the GIL released (a GPU step); on a CPU-bound box the build's time moves
into the step's forward/backward instead of preceding it (docs/learner.md, Benchmark).

What this module does not know: models, queues, ranks beyond its own, or how a window is trained.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from common.packing.segment import Pack
from learner.data import retag
from learner.torch_threads import pin_this_thread, start_pinned

log = logging.getLogger(__name__)

UNCONSUMED_VER = -1  # the ver a window is built under; take() retags it with the learner's ver
CLOSE_TIMEOUT_S = 30.0  # close(): how long to wait for a window in progress before leaving the (daemon) thread


class ChannelAPrefetchError(RuntimeError):
    """The prefetch thread failed; its exception (with the thread's traceback) is the ``__cause__``."""


class WindowSource(Protocol):
    """What the thread needs of :class:`learner.data.ChannelAData` (tests pass fakes)."""

    def next_window(self, ver: int) -> list[Pack]: ...

    def state_dict(self) -> dict[str, Any]: ...


@dataclass
class AWindow:
    """One A step's data: exactly GA packs, their arrays, and the sampler state after them."""

    index: int  # windows built by this process before this one (0-based)
    packs: list[Pack]
    arrays: list[dict[str, np.ndarray]]  # Pack.tensors() of each pack, built on the thread
    state: dict[str, Any]  # ChannelAData.state_dict() right after this window was built


class ChannelAPrefetcher:
    """This rank's Channel-A window, built one ahead on a thread; exact-resume state of what was taken."""

    def __init__(self, source: WindowSource, *, rank: int, deadline_s: float, what: str = "one Channel-A window",
                 deadline_from: str = "", poll_s: float = 0.5) -> None:
        """``deadline_s``: longest wait of :meth:`take` (and of :meth:`start` for the thread); ``what`` (what a
        window encodes) and ``deadline_from`` (where the deadline comes from) only go into the timeout message."""
        self.source, self.rank, self.deadline_s, self.poll_s = source, rank, deadline_s, poll_s
        self.what, self.deadline_from = what, deadline_from
        self._consumed: dict[str, Any] = source.state_dict()  # fresh or loaded: nothing taken yet
        self._cond = threading.Condition()
        self._slot: AWindow | None = None
        self._error: BaseException | None = None
        self._stop = False
        self._built = self._taken = 0
        self._building_since: float | None = None
        self._thread_ready = threading.Event()
        self.torch_threads: int | None = None  # the thread's torch intra-op count (tests read it)
        self._thread = threading.Thread(target=self._run, name=f"channel-a-prefetch-r{rank}", daemon=True)

    # -- training thread ------------------------------------------------------------------------

    def start(self) -> None:
        if not start_pinned(self._thread, self._thread_ready, self.deadline_s):
            raise TimeoutError(f"rank {self.rank}: {self._thread.name} did not start within {self.deadline_s:.0f}s")

    def take(self, ver: int) -> AWindow:
        """The next window, segments and packs tagged ``ver``; waits for the thread up to the deadline.

        Raises :class:`ChannelAPrefetchError` (the thread's exception chained) if the build failed,
        ``TimeoutError`` naming what was awaited if no window came within ``deadline_s``.
        """
        if self._stop or self._thread.ident is None:
            raise RuntimeError(f"rank {self.rank}: the Channel-A prefetcher is not running "
                               f"({'closed' if self._stop else 'start() was not called'})")
        t0 = time.monotonic()
        with self._cond:
            while self._slot is None and self._error is None:
                left = t0 + self.deadline_s - time.monotonic()
                if left <= 0:
                    raise TimeoutError(self._timeout_message(time.monotonic() - t0))
                if not self._thread.is_alive():
                    raise ChannelAPrefetchError(
                        f"rank {self.rank}: {self._thread.name} exited without a window or an error")
                self._cond.wait(min(left, self.poll_s))
            if self._error is not None:
                exc = self._error
                raise ChannelAPrefetchError(
                    f"rank {self.rank}: {self._thread.name} failed building Channel-A window {self._built} "
                    f"({type(exc).__name__}: {exc}); the thread's traceback is above"
                ) from exc
            window, self._slot = self._slot, None
            self._taken += 1
            self._consumed = window.state
            self._cond.notify_all()
        packs = [Pack(ver=ver, channel=p.channel, segments=[retag(s, ver) for s in p.segments]) for p in window.packs]
        return AWindow(window.index, packs, window.arrays, window.state)

    @property
    def counters(self) -> dict[str, Any]:
        """Channel-A counters as of the last window taken (what the trained steps consumed)."""
        return self._consumed["counters"]

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint state: the sampler after the last window taken (``ahead`` is informational)."""
        with self._cond:
            ahead = self._built - self._taken
        return {**self._consumed, "ahead": ahead}

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Stop the thread and join it within ``timeout_s``; False (and an error log) if it would not stop."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if not self._thread.is_alive():
            return True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            since = self._building_since
            log.error("rank %d: %s did not stop within %.0fs (building window %d for %.0fs); leaving the daemon thread",
                      self.rank, self._thread.name, timeout_s, self._built,
                      time.monotonic() - since if since is not None else 0.0)
            return False
        return True

    def _timeout_message(self, waited_s: float) -> str:
        since = self._building_since
        doing = (f"building window {self._built} for {time.monotonic() - since:.0f}s" if since is not None
                 else "idle (no window in progress)")
        deadline = f"the deadline, {self.deadline_from}" if self.deadline_from else "the deadline"
        alive = "alive" if self._thread.is_alive() else "dead"
        return (
            f"rank {self.rank}: waited {waited_s:.1f}s ({deadline}) for Channel-A window {self._taken} from thread "
            f"{self._thread.name} ({alive}, {doing}); a window encodes {self.what} (chat template, image processor, "
            f"targets). Likely cause: an image read hanging on a network filesystem, or a CPU starved by other "
            f"processes. See where the thread is stuck with: py-spy dump --pid {os.getpid()}"
        )

    # -- prefetch thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            try:
                self.torch_threads = pin_this_thread()
            finally:
                self._thread_ready.set()
            while True:
                with self._cond:
                    while self._slot is not None and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    self._building_since = time.monotonic()
                packs = self.source.next_window(UNCONSUMED_VER)
                window = AWindow(self._built, packs, [p.tensors() for p in packs], self.source.state_dict())
                with self._cond:
                    self._slot, self._building_since = window, None
                    self._built += 1
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by take()
            log.error("rank %d: %s failed building Channel-A window %d (raised in the training thread at the next "
                      "A step)", self.rank, self._thread.name, self._built, exc_info=True)
            with self._cond:
                self._error, self._building_since = exc, None
                self._cond.notify_all()
