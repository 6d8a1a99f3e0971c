"""The per-rank ready-pack queue: a receiver thread, a bounded deque, stale drops, credits.

Data flow and what each wait is unblocked by::

    actors ──ZMQ PUSH──► PackReceiver (PULL, bind) ──recv(poll_s)──►
        receiver thread
          │ frames_to_pack; malformed -> counted, dropped
          │ admission (values vs model and config, ver ≤ ver_current + 1)
          │   -> rejected_<reason> counted, dropped, logged with the sender
          │ duplicate B sample (already trained) -> counted, dropped
          │ stale (ver < ver_current - version_window) -> counted, dropped
          │ full: drop the OLDEST (counted), then append
          ▼
        deque[ReadyPack]  (capacity queue_limit, FIFO)
          │ eligible(): prune stale, count    (decision, any thread)
          │ reserve(n): prune stale, pop n oldest -> reserved
          ▼
        learner main thread trains them; mark_trained(pack)
    receiver thread ──every credit_interval_s (and on a ver change)──► CreditPublisher (PUB, bind) ──► actors

Capacity rule: at most ``queue_limit`` packs wait; a push into a full queue drops the oldest one.
Example: queue_limit 3 holding vers [5, 6, 6], a pack of ver 6 arrives -> [6, 6, 6], one oldest drop.
With ver_current 8 and version_window 1, a pack of ver 6 is stale (6 < 7) at its next look.

Conservation, at every moment (``check_conservation``)::

    received == trained + stale_dropped + oldest_dropped + duplicate_dropped + Σ rejected_<reason>
                + reserved + in_queue

``malformed`` frames never became packs and are counted apart. The receiver never raises on bad
input; it counts every problem and logs it with the sender (actor id, seq, peer address), at most one
line per kind of problem every ``LOG_EVERY_S`` seconds (with the count of those not logged).

Admission (``common.packing.segment.pack_rejection`` with the learner's :class:`PackLimits`, set from the model
before :meth:`ReadyQueue.start`): ids and labels in the vocabulary, at most ``packing_length`` tokens,
finite non-negative weights, a finite pixel normalisation (``pixel_affine``), position ids and images the
model takes, finite meta counts; and here, ``ver ≤ ver_current + 1`` (an actor may be one sync ahead of the
learner's adoption, never more: a pack claiming a later ver would never go stale). Without limits only the
ver bound is checked.

What this module does not know: models, the A/B schedule, or ranks other than its own.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.packing.segment import REJECT_REASONS, Pack, PackLimits, pack_rejection
from common.wire.transport import ActorTally
from common.wire.codec import PackMessage, ProtocolError, encode_credits, frames_to_pack

log = logging.getLogger(__name__)

FrameSource = Callable[[float], Any]  # recv(timeout_s) -> frames or None (PackReceiver.recv)
CreditSink = Callable[[bytes], None]  # publish(frame) (CreditPublisher.publish)


@dataclass
class ReadyPack:
    """A decoded pack waiting on this rank; ``arrays`` view the received frames (``PACK_TENSOR_SPECS``)."""

    message: PackMessage
    pack: Pack
    received_at: float  # time.monotonic()

    @property
    def ver(self) -> int:
        return self.message.ver

    @property
    def arrays(self) -> dict:
        return self.message.tensors

    @property
    def sample_ids(self) -> list[str]:
        return [s.sample_id for s in self.pack.segments]


COUNTER_NAMES = (
    "received", "trained", "stale_dropped", "oldest_dropped", "duplicate_dropped", "reserved", "in_queue", "malformed",
    *(f"rejected_{reason}" for reason in REJECT_REASONS),
)
REJECTED = tuple(f"rejected_{reason}" for reason in REJECT_REASONS)
LOG_EVERY_S = 30.0  # one log line per kind of receiver problem at most this often


class ReadyQueue:
    """One learner rank's queue of ready packs (see the module docstring for the rules).

    Thread model: the receiver thread (:meth:`start`) owns ``recv`` and ``publish``; every other
    method may be called from the learner's main thread; one lock guards the deque and counters.
    ``trained_ids`` is the B-sample ledger: the caller's set, updated in place by :meth:`mark_trained`
    (the learner checkpoints it and restores it before :meth:`start`).
    """

    def __init__(
        self,
        *,
        rank: int,
        queue_limit: int,
        version_window: int,
        target: int,
        recv: FrameSource | None = None,
        publish: CreditSink | None = None,
        credit_interval_s: float = 0.2,
        poll_s: float = 0.05,
        ver_current: int = 0,
        trained_ids: set[str] | None = None,
        limits: PackLimits | None = None,
    ) -> None:
        if queue_limit < 1:
            raise ValueError(f"queue_limit must be >= 1, got {queue_limit}")
        self.rank, self.queue_limit, self.version_window, self.target = rank, queue_limit, version_window, target
        self._recv, self._publish = recv, publish
        self.credit_interval_s, self.poll_s = credit_interval_s, poll_s
        self._lock = threading.Lock()
        self._deque: deque[ReadyPack] = deque()
        self._ver = ver_current
        self.trained_ids: set[str] = trained_ids if trained_ids is not None else set()  # shared, not copied
        self.tally = ActorTally()  # per-actor [last seq, queued] for the credits' ``actors`` field
        self.counters = {name: 0 for name in COUNTER_NAMES}
        self._stop = threading.Event()
        self._credits_due = threading.Event()
        self._thread: threading.Thread | None = None
        self.limits = limits  # set before start(); None = the ver bound only
        self._log_at: dict[str, float] = {}  # problem kind -> when it was last logged
        self._unlogged: dict[str, int] = {}  # problem kind -> occurrences since

    # -- receiver thread ------------------------------------------------------------------------

    def start(self) -> None:
        if self._recv is None:
            raise RuntimeError("ReadyQueue.start needs a frame source (recv)")
        self._thread = threading.Thread(target=self._run, name=f"ready-queue-rank{self.rank}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("ready-queue receiver thread of rank %d did not stop within %.1fs", self.rank, timeout_s)
                return
        if self._publish is not None and sys.exc_info()[0] is None:
            # Training finished (no exception is on its way out of the learner): the last credits say done, so
            # this rank's actors exit now instead of waiting out their silence deadline
            # (common.wire.codec Credits.done).
            # The receiver thread is gone, so this thread may use the PUB socket; three sends 50 ms apart get
            # one out before the socket closes with linger 0.
            with self._lock:
                frame = encode_credits(rank=self.rank, ver_current=self._ver, depth=len(self._deque), target=self.target,
                                       version_window=self.version_window, received_total=self.counters["received"],
                                       actors=self.tally.as_map(), done=True)
            for _ in range(3):
                self._publish(frame)
                time.sleep(0.05)

    def _run(self) -> None:
        last_credit = 0.0
        while not self._stop.is_set():
            try:
                frames = self._recv(self.poll_s)  # type: ignore[misc]
            except Exception as exc:  # a socket closed under us at shutdown, or a transport fault
                if self._stop.is_set():
                    return
                self._note_problem(f"receive failed: {exc!r}")
                frames = None
                time.sleep(self.poll_s)
            if frames is not None:
                try:
                    self.push_frames(frames)
                except Exception as exc:  # noqa: BLE001 - the receiver must outlive any one bad message
                    with self._lock:
                        self.counters["malformed"] += 1
                    self._note_problem(f"pack message dropped, unexpected {exc!r}")
            now = time.monotonic()
            if self._publish is not None and (self._credits_due.is_set() or now - last_credit >= self.credit_interval_s):
                self._credits_due.clear()
                self.publish_credits()
                last_credit = now

    def push_frames(self, frames: Any) -> bool:
        """Decode and enqueue one message (the receiver thread's step; callable directly in tests)."""
        try:
            message, pack = frames_to_pack(frames)
        except ProtocolError as exc:
            with self._lock:
                self.counters["malformed"] += 1
            self._note_problem(f"malformed pack message dropped: {exc}{_peer(frames)}", kind="malformed")
            return False
        return self.push(ReadyPack(message, pack, time.monotonic()), peer=_peer(frames))

    def push(self, item: ReadyPack, peer: str = "") -> bool:
        """Admit a decoded pack; False if it was dropped on arrival (rejected, duplicate or stale)."""
        m = item.message
        rejection = self._rejection(item)  # numpy over the arrays: outside the lock
        if rejection is not None:
            self._note_problem(f"pack rejected ({rejection[0]}): {rejection[1]}; from {m.actor!r} seq {m.seq} "
                               f"ver {m.ver}{peer}", kind=rejection[0])
        with self._lock:
            self.counters["received"] += 1
            self.tally.received(m.actor, m.seq)
            if rejection is not None:
                self.counters[f"rejected_{rejection[0]}"] += 1
                self.tally.left_queue(m.actor)
                return False
            if self.trained_ids.intersection(item.sample_ids):
                self.counters["duplicate_dropped"] += 1
                self.tally.left_queue(item.message.actor)
                return False
            if self._is_stale(item.ver):
                self.counters["stale_dropped"] += 1
                self.tally.left_queue(item.message.actor)
                return False
            self._prune_stale()
            while len(self._deque) >= self.queue_limit:
                self.tally.left_queue(self._deque.popleft().message.actor)
                self.counters["oldest_dropped"] += 1
            self._deque.append(item)
            return True

    def publish_credits(self) -> None:
        """Send ``{ver_current, depth, target, ...}`` to this rank's actors (receiver thread only)."""
        if self._publish is None:
            return
        with self._lock:
            self._prune_stale()
            frame = encode_credits(
                rank=self.rank, ver_current=self._ver, depth=len(self._deque), target=self.target,
                version_window=self.version_window, received_total=self.counters["received"],
                actors=self.tally.as_map(),
            )
        self._publish(frame)

    def _rejection(self, item: ReadyPack) -> tuple[str, str] | None:
        """Why a decoded pack is not trained (``common.packing.segment.REJECT_REASONS``), or None."""
        if item.ver > self._ver + 1:
            return "future_ver", f"ver {item.ver} > ver_current {self._ver} + 1"
        if self.limits is None:
            return None
        return pack_rejection(item.arrays, item.message.meta.get("segments", []), self.limits)

    def _note_problem(self, text: str, kind: str = "receive") -> None:
        """Log ``text`` unless a problem of this ``kind`` was logged in the last LOG_EVERY_S seconds (then count it)."""
        now = time.monotonic()
        last = self._log_at.get(kind)
        if last is not None and now - last < LOG_EVERY_S:
            self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
            return
        self._log_at[kind] = now
        held = self._unlogged.pop(kind, 0)
        more = f" (+{held} more of this kind in the last {now - last:.0f}s, counted)" if held and last else ""
        log.warning("rank %d ready queue: %s%s", self.rank, text, more)

    # -- learner main thread --------------------------------------------------------------------

    @property
    def ver_current(self) -> int:
        return self._ver

    def set_ver(self, ver: int) -> None:
        """Adopt a new ``ver_current`` (after a sync); stale packs go at once and credits go out promptly."""
        with self._lock:
            self._ver = int(ver)
            self._prune_stale()
        self._credits_due.set()

    def eligible(self) -> int:
        """Packs that could be reserved now (stale ones are dropped first)."""
        with self._lock:
            self._prune_stale()
            return len(self._deque)

    def reserve(self, n: int) -> list[ReadyPack]:
        """Take the ``n`` oldest eligible packs for this step; raises if fewer exist (the decision checked)."""
        with self._lock:
            self._prune_stale()
            if len(self._deque) < n:
                raise RuntimeError(f"rank {self.rank}: reserve({n}) with only {len(self._deque)} eligible packs")
            taken = [self._deque.popleft() for _ in range(n)]
            for item in taken:
                self.tally.left_queue(item.message.actor)
            self.counters["reserved"] += n
            return taken

    def mark_trained(self, item: ReadyPack) -> None:
        """A reserved pack went through forward/backward; its sample ids join the ledger."""
        with self._lock:
            self.counters["reserved"] -= 1
            self.counters["trained"] += 1
            self.trained_ids.update(item.sample_ids)

    def snapshot(self) -> dict[str, int]:
        """The counters with ``in_queue`` filled in (prunes stale first)."""
        with self._lock:
            self._prune_stale()
            out = dict(self.counters)
            out["in_queue"] = len(self._deque)
            return out

    def check_conservation(self) -> dict[str, int]:
        """Raise ``AssertionError`` naming the numbers if the identity of the module docstring fails."""
        c = self.snapshot()
        rhs = sum(c[k] for k in ("trained", "stale_dropped", "oldest_dropped", "duplicate_dropped", "reserved", "in_queue",
                                 *REJECTED))
        if c["received"] != rhs:
            raise AssertionError(f"rank {self.rank} queue conservation broken: received {c['received']} != {rhs} ({c})")
        return c

    # -- internals (lock held) ------------------------------------------------------------------

    def _is_stale(self, ver: int) -> bool:
        return ver < self._ver - self.version_window

    def _prune_stale(self) -> None:
        # vers need not arrive in order (several actors), so scan the whole deque.
        if any(self._is_stale(p.ver) for p in self._deque):
            kept: deque[ReadyPack] = deque()
            for p in self._deque:
                if self._is_stale(p.ver):
                    self.counters["stale_dropped"] += 1
                    self.tally.left_queue(p.message.actor)
                else:
                    kept.append(p)
            self._deque = kept


def _peer(frames: Any) -> str:
    """`` (peer 127.0.0.1)``: the TCP peer of a received message where ZMQ knows it (else "")."""
    try:
        return f" (peer {frames[0].get('Peer-Address')})"
    except Exception:  # noqa: BLE001 - bytes frames (tests), or a transport without peer addresses
        return ""
