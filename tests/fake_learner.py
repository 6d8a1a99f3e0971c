"""A learner rank as the actors see it on the wire, for tests: PULL + PUB bound, credits, slow consumption.

It is a test double of ``learner/pack_queue.py``'s network side only: it decodes every message with the
real codec (malformed ones are counted), keeps received packs in a list it consumes one at a time
every ``consume_every_s``, and publishes credits with per-actor counts (``ActorTally``) every 0.1 s.
Optionally it dies and comes back once (``restart_after`` packs), then sends ``garbage`` multipart
messages at itself from a second PUSH socket.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import zmq

from common.wire.transport import ActorTally, CreditPublisher, PackReceiver, credit_endpoint, pack_endpoint
from common.wire.codec import ProtocolError, encode_credits, frames_to_pack


@dataclass
class Received:
    seq: int
    ver: int
    actor: str
    keys: list[str]
    segment_vers: list[int]
    digests: dict[str, str]
    incarnation: int
    meta: dict


class FakeLearnerRank:
    def __init__(self, transport, *, rank: int = 0, target: int = 2, version_window: int = 1, ver_current: int = 0,
                 consume_every_s: float = 0.3, restart_after: int | None = None,
                 garbage: Sequence[Sequence[bytes]] = ()) -> None:
        self.transport, self.rank, self.target, self.version_window = transport, rank, target, version_window
        self.ver_current, self.consume_every_s = ver_current, consume_every_s
        self.restart_after, self.garbage = restart_after, list(garbage)
        self.received: list[Received] = []
        self.malformed = 0
        self.max_unconsumed = 0
        self.incarnation = 0
        self.errors: list[str] = []
        self.garbage_sent_at: int | None = None  # len(received) when the garbage went out
        self.done = False  # set True: the credits say the learner finished training (actors stop at once)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-learner", daemon=True)

    def __enter__(self) -> FakeLearnerRank:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive(), "fake learner thread did not stop within 10 s"

    # -- the receiver thread ----------------------------------------------------------------------

    def _open(self) -> None:
        self.pull = PackReceiver(pack_endpoint(self.transport, self.rank), hwm=self.transport.hwm)
        self.pub = CreditPublisher(credit_endpoint(self.transport, self.rank))
        self.tally, self.queue, self.total = ActorTally(), [], 0

    def _close(self) -> None:
        self.pull.close()
        self.pub.close()

    def _run(self) -> None:
        try:
            self._open()
            last_consume = last_credit = time.monotonic()
            while not self._stop.is_set():
                frames = self.pull.recv(0.02)
                if frames is not None:
                    self._on_frames(frames)
                now = time.monotonic()
                if self.queue and now - last_consume >= self.consume_every_s:
                    actor, _ = self.queue.pop(0)
                    self.tally.left_queue(actor)
                    last_consume = now
                if now - last_credit >= 0.1:
                    self.pub.publish(encode_credits(
                        rank=self.rank, ver_current=self.ver_current, depth=len(self.queue), target=self.target,
                        version_window=self.version_window, received_total=self.total, actors=self.tally.as_map(),
                        done=self.done))
                    last_credit = now
                if self.restart_after is not None and self.incarnation == 0 and len(self.received) >= self.restart_after:
                    self._restart()
            self._close()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(repr(exc))

    def _on_frames(self, frames) -> None:
        try:
            message, pack = frames_to_pack(frames)
        except ProtocolError:
            self.malformed += 1
            return
        self.total += 1
        self.tally.received(message.actor, message.seq)
        self.queue.append((message.actor, message.seq))
        self.max_unconsumed = max(self.max_unconsumed, len(self.queue))
        digests = {name: hashlib.sha256(np.ascontiguousarray(a).view(np.uint8)).hexdigest()
                   for name, a in message.tensors.items()}
        self.received.append(Received(message.seq, message.ver, message.actor, [s.sample_id for s in pack.segments],
                                      [int(s.meta["ver"]) for s in pack.segments], digests, self.incarnation,
                                      dict(message.meta)))

    def _restart(self) -> None:
        """The learner dies (queue and sockets gone) and comes back on the same ports a second later."""
        self._close()
        time.sleep(1.0)
        self.incarnation += 1
        self._open()
        if self.garbage:
            self._send_garbage()

    def _send_garbage(self) -> None:
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 2000)
        push.connect(pack_endpoint(self.transport, self.rank))
        for frames in self.garbage:
            if not push.poll(5000, zmq.POLLOUT):
                raise AssertionError("the garbage sender could not connect within 5 s")
            push.send_multipart(list(frames))
        push.close()
        self.garbage_sent_at = len(self.received)
