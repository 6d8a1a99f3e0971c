"""Channel-A on the learner: the main dataloader and the window filler (exactly GA full packs per step).

::

    train JSONL ─► DistributedSampler(rank, world, shuffle, seed, drop_last) ─► record index
        ─► canonical GT ─► common.detection.targets.channel_a_target ─► common.packing.encode.Encoder
        ─► Segment (channel A)
        ─► first fit into GA packs of packing_length, in draw order ─► GA Packs, carry (≤ 2 × GA samples)

An A step's packs hold **as many whole samples as fit** (the origin packs Channel-A too), not a
fixed count: the samples carried from the previous window go in first, oldest first, then fresh
ones are drawn, each into the first of the GA packs with room. A sample that fits no pack is
carried, and the window is complete once 2 × GA samples are carried: a second chance per pack for
a shorter sample to fill the room a long one left (a long-tailed length mix fills 0.90 at GA 1,
0.95 at GA 2, against 0.84 and 0.93 when the window stops at GA). So there are **exactly GA**
non-empty packs — a sample fits no pack only when none is empty — and every rank runs one packed
forward/backward per micro-step. The carry never exceeds 2 × GA samples, and a sample waits two
windows at most: the GA oldest carried samples always go in (first fit puts any GA samples into
GA empty packs), so the rest are the GA oldest of the next window.
``training.per_device_train_batch_size`` does not count Channel-A samples (common/config/schema.py).
Example (demo: packing_length 1024, samples of 77-140 tokens, GA 2): about 18 samples a window,
mean fill 0.96, against 8 samples and 0.42 when a window took per_device × GA of them.

A sample longer than ``packing_length`` never reaches a pack: the Encoder refuses it and it is
counted in ``too_long_dropped``, and the next is drawn. A record that breaks the contract (docs/data.md)
or whose image is missing follows ``data.on_bad_record`` (common/data/check.py): ``fail`` raises
naming the record (the learner checked the first records before it started), ``skip`` counts it in
``record_errors``, logs each kind once, and draws the next.

Sample ids are ``A:<record id or line>@<epoch>``. The sampler position (epoch, index within the
epoch) and the carry's (epoch, line) references are the checkpointed state: a resumed run draws
exactly the samples the uninterrupted run would have, the carried ones re-encoded from their
references. A window is a pure function of that state, which is what lets learner/prefetch.py
build it one step early and still checkpoint exactly.

``data.encode_workers: N > 0`` moves the encoding (learner/encode_pool.py) to N spawned worker processes
of this rank: the next refs in sampler order are submitted ahead (a lookahead of two windows' draws, at
least 4 per worker) and consumed in that same order, so windows, counters, bad-record errors and the
checkpointed state (what was consumed, never what was submitted) are those of the synchronous path;
``load_state_dict`` drops the lookahead, and :meth:`ChannelAData.close` shuts the workers down.

Threads: not thread-safe (nor is its Encoder). In the learner, the Channel-A prefetch thread owns
this object and its Encoder from ``ChannelAPrefetcher.start()`` on; nothing else may call it then.

What this module does not know: ranks beyond (rank, world), models, the loss's normalisation, or Channel-B.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.data.check import BadRecords
from common.packing.segment import Pack, Segment
from learner.encode_pool import EncodePool, Encoded, encode_line


@dataclass
class _Ref:
    epoch: int
    line: int


class ChannelAData:
    """This rank's Channel-A stream: sampler order, target building, encoding, window packing."""

    def __init__(self, cfg: Any, encoder: Any, *, rank: int, world_size: int, ga: int,
                 samples: int | None = None, pool: EncodePool | None = None) -> None:
        """``samples``: a fixed number of samples per window instead of full packs (the Stage-1 warm start keeps
        its per-step batch, ``per_device_train_batch_size × GA``, so its recipe and cost stay what they were).
        ``pool``: encode workers to use instead of starting ``data.encode_workers`` of its own (their encoder must
        be this config's; :meth:`close` leaves a pool passed in to its owner)."""
        self.cfg, self.encoder, self.rank, self.world_size, self.ga = cfg, encoder, rank, world_size, ga
        self.samples = samples
        self.packing_length = cfg.derived.packing_length
        path = Path(cfg.data.train_jsonl)
        self.lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if len(self.lines) < world_size:
            raise ValueError(f"{path}: {len(self.lines)} records for {world_size} learner ranks; use more data")
        self.source = path.name
        self.epoch, self.position = 0, 0
        self._orders: dict[int, list[int]] = {}
        self.carry: list[tuple[_Ref, Segment]] = []
        self.counters = {"samples_drawn": 0, "too_long_dropped": 0, "record_errors": 0, "window_carry": 0}
        self.bad_records = BadRecords(cfg.data.on_bad_record, str(path))
        workers = int(getattr(cfg.data, "encode_workers", 0) or 0)
        self.pool = pool if pool is not None else EncodePool(cfg, workers) if workers > 0 else None
        self._owns_pool = pool is None
        # data.encode_workers > 0: futures of the next refs in sampler order (submitted, not consumed), and the
        # sampler position of the first ref not yet submitted. Ahead: 2 windows' draws (the window being taken and
        # the next, encoded while the step trains), at least 4 per worker so none idles.
        self._ahead: deque[tuple[_Ref, Future]] = deque()
        self._submit_at = (0, 0)
        self._window_draws = samples if samples is not None else 4 * ga  # the last window's, once there is one
        self._closed = False

    @property
    def _order(self) -> list[int]:
        return self._order_of(self.epoch)

    def _order_of(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            for old in [e for e in self._orders if e < self.epoch]:
                del self._orders[old]
            self._orders[epoch] = self._epoch_order(epoch)
        return self._orders[epoch]

    def _epoch_order(self, epoch: int) -> list[int]:
        from torch.utils.data import DistributedSampler  # the standard sharding rule, so A data matches any DDP trainer

        sampler = DistributedSampler(
            range(len(self.lines)), num_replicas=self.world_size, rank=self.rank, shuffle=True,
            seed=self.cfg.training.seed, drop_last=True,
        )
        sampler.set_epoch(epoch)
        return list(sampler)

    def _draw(self) -> _Ref:
        if self.position >= len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
        ref = _Ref(self.epoch, self._order[self.position])
        self.position += 1
        self.counters["samples_drawn"] += 1
        return ref

    def _encode(self, ref: _Ref, ver: int) -> Segment | None:
        """In this process (the synchronous path, and the carry on load)."""
        return self._consume(encode_line(self.cfg, self.encoder, self.source, self.lines[ref.line], ref.epoch,
                                         ref.line, ver), ver)

    def _consume(self, out: Encoded, ver: int) -> Segment | None:
        """A sample's counters and ``data.on_bad_record`` (fail raises here, naming the record) when it is taken."""
        if out.error is not None:
            self.counters["record_errors"] += 1
            self.bad_records.handle(out.error)
            return None
        self.counters["too_long_dropped"] += out.too_long
        seg = out.segment
        return seg if seg is None or seg.ver == ver else retag(seg, ver)

    def _take(self, ver: int) -> tuple[_Ref, Segment | None]:
        """The next ref in sampler order and its segment: encoded now, or by the pool ahead of time."""
        if self._closed:
            raise RuntimeError("ChannelAData.next_window after close()")
        if self.pool is None:
            ref = self._draw()
            return ref, self._encode(ref, ver)
        self._submit_ahead()
        ref = self._draw()
        ahead, future = self._ahead.popleft()
        assert (ahead.epoch, ahead.line) == (ref.epoch, ref.line), (ahead, ref)  # the lookahead follows the sampler
        self._submit_ahead()  # keep the workers busy while this one is awaited
        return ref, self._consume(self.pool.result(future, f"{self.source}:{ref.line + 1}"), ver)

    def _submit_ahead(self) -> None:
        assert self.pool is not None
        epoch, position = self._submit_at
        while len(self._ahead) < max(4 * self.pool.workers, 2 * self._window_draws):
            if position >= len(self._order_of(epoch)):
                epoch, position = epoch + 1, 0
            ref = _Ref(epoch, self._order_of(epoch)[position])
            position += 1
            self._ahead.append((ref, self.pool.submit(self.source, self.lines[ref.line], ref.epoch, ref.line, 0)))
        self._submit_at = (epoch, position)

    def _drop_ahead(self) -> None:
        for _, future in self._ahead:
            future.cancel()
        self._ahead.clear()
        self._submit_at = (self.epoch, self.position)

    def close(self) -> None:
        """Shut the encode workers down (pending encodes cancelled); safe to call twice. The owner calls it once the
        thread that draws windows is done with this object."""
        self._closed = True
        self._drop_ahead()
        if self.pool is not None and self._owns_pool:
            self.pool.close()

    def next_window(self, ver: int) -> list[Pack]:
        """Exactly GA packs for one A step, as full as whole samples make them (segments tagged ``ver``).

        The synchronous path: image decoding + processor + targets, ~3 ms per tiny sample on CPU
        (``data.encode_workers > 0``: taken from the workers' lookahead, already encoded).
        The learner calls it on the Channel-A prefetch thread (learner/prefetch.py), one window
        ahead, and retags the segments with its ver when it takes the window.
        """
        packs: list[list[Segment]] = [[] for _ in range(self.ga)]
        room = [self.packing_length] * self.ga
        carry: list[tuple[_Ref, Segment]] = []

        def place(ref: _Ref, seg: Segment) -> None:
            fits = [b for b in range(self.ga) if seg.length <= room[b]]
            if not fits:  # only when no pack is empty: the Encoder keeps every segment ≤ packing_length
                carry.append((ref, seg))
                return
            b = fits[0] if self.samples is None else max(fits, key=lambda k: (room[k], -k))  # fixed count: balance
            packs[b].append(seg)
            room[b] -= seg.length

        for ref, seg in self.carry:
            place(ref, seg if seg.ver == ver else retag(seg, ver))
        unusable = 0
        drawn = self.counters["samples_drawn"]
        while len(carry) < 2 * self.ga and (self.samples is None or not all(packs)
                                           or sum(map(len, packs)) + len(carry) < self.samples):
            ref, seg = self._take(ver)
            if seg is None:
                unusable += 1
                if unusable >= 100 * self.ga:
                    raise RuntimeError(
                        f"rank {self.rank}: {unusable} Channel-A samples in a row were unusable (too long or invalid); "
                        f"check {self.cfg.data.train_jsonl} and training.global_max_length"
                    )
                continue
            unusable = 0
            place(ref, seg)
        self.carry = carry
        self.counters["window_carry"] = len(carry)
        self._window_draws = max(1, self.counters["samples_drawn"] - drawn)
        return [Pack(ver=ver, channel="A", segments=p) for p in packs]

    # -- checkpoint ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "position": self.position,
            "carry": [[r.epoch, r.line] for r, _ in self.carry], "counters": dict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any], ver: int) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._drop_ahead()  # encoded for the old position
        self.counters.update(state.get("counters", {}))
        self.carry = []
        for epoch, line in state.get("carry", []):
            ref = _Ref(int(epoch), int(line))
            if (seg := self._encode(ref, ver)) is not None:
                self.carry.append((ref, seg))


def retag(segment: Segment, ver: int) -> Segment:
    """A Channel-A segment (carried or prefetched) joins the window under the learner's current ver."""
    return replace(segment, ver=ver)
