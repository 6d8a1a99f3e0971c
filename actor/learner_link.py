"""The actor's link to its learner rank: credits in, packs out, and the outbox between the two.

::

    ActorLoop ──finished packs──► outbox ── credits fresh and gate.room > 0 ──► PackSender (PUSH, connect)
                                    │ ver < gate.stale_below(): dropped, samples requeued      │
                                    ▼                                                           ▼
                              counted stale_dropped               learner rank r's PULL; ledger line {seq, ver, keys}
    CreditSubscriber (SUB, connect) ◄── learner rank r's PUB: the newest credits → CreditGate

The learner binds both endpoints (``common.wire.transport``), so either side may start first. Each wait and
what unblocks it:
  - first credits (:meth:`LearnerLink.wait_first`): deadline ``actor.learner_wait_timeout_s`` ← the
    rank publishing; on timeout the error names the endpoint and the learner command.
  - silence (:meth:`LearnerLink.poll`): credits older than ``actor.learner_silence_s`` pause sending
    (and, in the loop, admission); past ``learner_silence_s + learner_wait_timeout_s``, poll says give up.
  - send (:meth:`LearnerLink.send`): ``PackSender.send`` blocks up to ``actor.send_timeout_s`` (it never
    drops); on timeout the pack stays at the head of the outbox and is tried again on the next call.
  - done: credits with ``done`` (the rank finished training and is closing) set :attr:`LearnerLink.done`;
    the loop stops at once.

Rejoin (a restarted actor process, by the launcher or by hand, while its learner rank lives on): at the
first credits, if the rank already lists this actor id (``actors[id] = [last seq L, queued]``), the
packs of an earlier process of this actor reached it. The sent-pack ledger (``actor.stream.PackLedger``)
says which keys went into the packs of ``seq <= L`` sent to this learner incarnation: those the rank
holds (trained, queued, or dropped on arrival as a live actor's would be), so :attr:`rejoin_skip` hands
them to the stream to skip. Keys of packs sent after ``L`` died with the old process (ZMQ's queue) and
are produced again, like every sample it had taken but not sent. Seqs continue after the ledger's last
one, so the rank's ``last seq`` of the old process never counts as an acknowledgement of ours.

A pack is sent only while ``outstanding < share`` (:class:`actor.credits.CreditGate`); the outbox
keeps every packed segment's sample until its pack is sent, so a pack dropped as stale hands its
samples back to be rolled out again under current weights.

What this module does not know: rollouts, the packer's rules, or when the actor stops.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from actor.credits import CreditGate
from actor.pipeline import Sample
from actor.stream import PackLedger
from common.packing.segment import Pack
from common.wire.transport import CreditSubscriber, PackSender, TransportTimeout, credit_endpoint, pack_endpoint
from common.wire.codec import Credits, pack_to_frames

log = logging.getLogger(__name__)


def learner_command(cfg: Any, config_path: str, rank: int = 0) -> str:
    """The command that starts learner rank ``rank``, for every message about a learner that is not there
    (on several learner nodes: node ``rank // nproc_per_node``'s launcher, on its host)."""
    lrn = cfg.learner
    if lrn.nnodes > 1:
        node = rank // lrn.nproc_per_node
        return (f"python -m launcher --config {config_path} launcher.node_rank={node}  "
                f"(on learner node {node}, {lrn.node_hosts[node]})")
    return f"torchrun --nproc_per_node={lrn.nproc_per_node} learner/main.py --config {config_path}"


class LearnerLink:
    """Credits, outbox, sends and the sent-pack ledger of one actor; counts into the actor's ``counts``."""

    def __init__(self, cfg: Any, rank: int, index: int, actor_id: str, gate: CreditGate,
                 counts: collections.Counter, *, ledger_path: Path, log_record: Callable[[dict[str, Any]], None],
                 config_path: str, sender: PackSender | None = None,
                 subscriber: CreditSubscriber | None = None) -> None:
        self.cfg, self.rank, self.index, self.actor_id = cfg, rank, index, actor_id
        self.gate, self.counts, self.log_record = gate, counts, log_record
        self.hint = learner_command(cfg, config_path, rank)
        t = cfg.transport
        self.sender = sender or PackSender(pack_endpoint(t, rank, cfg.learner), hwm=t.hwm, linger_ms=t.linger_ms,
                                           peer_hint=self.hint)
        self.subscriber = subscriber or CreditSubscriber(credit_endpoint(t, rank, cfg.learner))
        self.ledger = PackLedger(ledger_path)
        self.outbox: collections.deque[Pack] = collections.deque()
        self.samples: dict[str, Sample] = {}  # key -> sample, from build until its pack is sent
        self.rejoin_skip: set[str] = set()  # keys the live rank already got from an earlier process of this actor
        self.done = False  # the rank said it finished training (its last credits)

    # ------------------------------------------------------------------------------------ credits

    def wait_first(self, stop: threading.Event) -> bool:
        """First credits within ``actor.learner_wait_timeout_s`` (a stop request ends the wait early)."""
        deadline = time.monotonic() + self.cfg.actor.learner_wait_timeout_s
        log.info("%s: waiting up to %.0fs for learner rank %d's credits at %s", self.actor_id,
                 self.cfg.actor.learner_wait_timeout_s, self.rank, self.subscriber.endpoint)
        while not stop.is_set():
            try:
                credits = self.subscriber.wait_first(min(1.0, max(0.0, deadline - time.monotonic())), hint=self.hint)
                self._join(credits)
                self.gate.on_credits(credits)
                self._note_done(credits)
                return True
            except TransportTimeout:
                if time.monotonic() >= deadline:
                    log.error("%s: no credits from learner rank %d at %s within %.0fs (actor.learner_wait_timeout_s); "
                              "the learner binds that endpoint and publishes every transport.credit_interval_s. "
                              "Start it with: %s", self.actor_id, self.rank, self.subscriber.endpoint,
                              self.cfg.actor.learner_wait_timeout_s, self.hint)
                    return False
        return False

    def _join(self, credits: Credits) -> None:
        """Before the first credits count: continue this actor id's seqs; when the rank already knows this id,
        find what it holds from an earlier process of this actor (module docstring, "Rejoin")."""
        next_seq, sent = PackLedger.rejoin_state(self.ledger.path)
        entry = credits.actors.get(self.actor_id)
        if entry is None:  # a learner incarnation new to this actor id
            self.gate.start_at(next_seq)
            self.ledger.mark_learner(next_seq)
            return
        last = int(entry[0])
        self.gate.start_at(max(next_seq, last + 1))
        self.rejoin_skip = {k for k, seq in sent.items() if seq <= last}
        self.counts["rejoins"] += 1
        log.warning("%s: rejoining learner rank %d, which got packs up to seq %d from an earlier process of this actor "
                    "(%d still queued): %d of their samples are skipped, %d sent after it are produced again; "
                    "samples that process had not sent are produced again too", self.actor_id, self.rank, last,
                    int(entry[1]), len(self.rejoin_skip), len(sent) - len(self.rejoin_skip))

    def _note_done(self, credits: Credits) -> None:
        if credits.done and not self.done:
            self.done = True
            log.info("%s: learner rank %d finished training (its last credits say done); stopping", self.actor_id,
                     self.rank)

    def poll(self) -> bool:
        """Take the newest credits; False once the learner has been silent past every deadline."""
        before = self.subscriber.latest
        credits = self.subscriber.poll(0)
        if credits is not None and credits is not before:
            restarts = self.gate.restarts
            self.gate.on_credits(credits)
            if self.gate.restarts > restarts:  # a new learner incarnation: packs from baseline_seq on go to it
                self.ledger.mark_learner(self.gate.baseline_seq)
            self._note_done(credits)
        age = self.subscriber.age_s() or 0.0
        a = self.cfg.actor
        if age > a.learner_silence_s + a.learner_wait_timeout_s:
            log.error("%s: no credits from learner rank %d at %s for %.0fs; exiting. Start the learner with: %s",
                      self.actor_id, self.rank, self.subscriber.endpoint, age, self.hint)
            return False
        if age > a.learner_silence_s and self.counts["silence_logged"] < int(age // a.learner_silence_s):
            self.counts["silence_logged"] = int(age // a.learner_silence_s)
            log.warning("%s: learner rank %d silent for %.0fs at %s; generation paused (exit after %.0fs more)",
                        self.actor_id, self.rank, age, self.subscriber.endpoint, a.learner_wait_timeout_s + a.learner_silence_s - age)
        return True

    def fresh(self) -> bool:
        """Credits newer than ``actor.learner_silence_s``: sending (and starting rollouts) may go on."""
        age = self.subscriber.age_s()
        return age is not None and age <= self.cfg.actor.learner_silence_s

    def is_stale(self, ver: int) -> bool:
        """Generated under a ver the rank would drop (older than its version window)."""
        below = self.gate.stale_below()
        return below is not None and ver < below

    # ------------------------------------------------------------------------------------ sending

    def send(self, requeue: Callable[[Iterable[Sample]], None]) -> float | None:
        """Send from the head of the outbox while credits allow; the seconds spent in sends that went out
        (None when none did). Samples of a pack dropped as stale go to ``requeue``."""
        spent = None
        while self.outbox and self.fresh():
            pack = self.outbox[0]
            if self.is_stale(pack.ver):
                self.outbox.popleft()
                self.counts["stale_dropped"] += len(pack.segments)
                requeue(x for x in (self.samples.pop(s.sample_id, None) for s in pack.segments) if x is not None)
                continue
            if self.gate.room <= 0:
                return spent
            t0 = time.perf_counter()
            seq = self.gate.next_seq
            meta = {"rollout": pack_rollout_meta(pack), "actor_index": self.index}
            frames = pack_to_frames(pack, self.actor_id, seq, meta=meta)
            if not self.sender.send(frames, timeout_s=self.cfg.actor.send_timeout_s):
                self.counts["send_timeouts"] += 1
                if self.counts["send_timeouts"] % 20 == 1:
                    log.warning("%s: %s", self.actor_id, self.sender.timeout_message(self.cfg.actor.send_timeout_s))
                return spent
            self.gate.on_sent()
            self.outbox.popleft()
            keys = [s.sample_id for s in pack.segments]
            for k in keys:
                self.samples.pop(k, None)
            self.ledger.record(seq, pack.ver, keys)
            self.counts["packs_sent"] += 1
            self.counts["segments_sent"] += len(keys)
            self.counts["tokens_sent"] += pack.n_tokens
            spent = (spent or 0.0) + time.perf_counter() - t0
            if self.cfg.actor.dump_pack_digests:
                self.log_record({"event": "pack", "seq": seq, "ver": pack.ver, "keys": keys, "n_tokens": pack.n_tokens,
                                 "sha256": frame_digests(frames)})
        return spent

    def outbox_segments(self) -> int:
        return sum(len(p.segments) for p in self.outbox)

    def drop_unsent(self) -> None:
        """At stop: what is still in the outbox is dropped, counted in ``dropped_at_stop``."""
        for pack in self.outbox:
            self.counts["dropped_at_stop"] += len(pack.segments)
        if self.outbox:
            why = ("the learner is done" if self.done
                   else f"not sent within actor.stop_timeout_s={self.cfg.actor.stop_timeout_s:.0f}s")
            log.warning("%s: %d packs (%d segments) dropped: %s", self.actor_id, len(self.outbox),
                        self.counts["dropped_at_stop"], why)
        self.outbox.clear()

    def close(self) -> None:
        self.sender.close()
        self.subscriber.close()
        self.ledger.close()


def pack_rollout_meta(pack: Pack) -> dict[str, float]:
    """Rollout quality of the pack's own segments (sums) — what the learner logs next to the step."""
    keys = ("n_pred", "n_gt", "n_matched", "parse_dropped", "parse_truncated", "invalid_rollout", "gating_rejections")
    return {f"rollout/{k}": sum(int(s.meta.get(k, 0)) for s in pack.segments) for k in keys}


def frame_digests(frames: list[Any]) -> dict[str, str]:
    """sha256 of every tensor frame, keyed by tensor name (frame 0 is the msgpack header)."""
    import msgpack

    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    return {spec["name"]: hashlib.sha256(memoryview(f)).hexdigest() for spec, f in zip(header["tensors"], frames[1:])}
