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

Threads: not thread-safe (nor is its Encoder). In the learner, the Channel-A prefetch thread owns
this object and its Encoder from ``ChannelAPrefetcher.start()`` on; nothing else may call it then.

What this module does not know: ranks beyond (rank, world), models, the loss's normalisation, or Channel-B.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.detection.answer import canonical_order
from common.data.records import load_record
from common.data.check import BadRecords, check_images
from common.packing.segment import Pack, Segment
from common.detection.targets import channel_a_target


@dataclass
class _Ref:
    epoch: int
    line: int


class ChannelAData:
    """This rank's Channel-A stream: sampler order, target building, encoding, window packing."""

    def __init__(self, cfg: Any, encoder: Any, *, rank: int, world_size: int, ga: int,
                 samples: int | None = None) -> None:
        """``samples``: a fixed number of samples per window instead of full packs (the Stage-1 warm start keeps
        its per-step batch, ``per_device_train_batch_size × GA``, so its recipe and cost stay what they were)."""
        self.cfg, self.encoder, self.rank, self.world_size, self.ga = cfg, encoder, rank, world_size, ga
        self.samples = samples
        self.packing_length = cfg.derived.packing_length
        path = Path(cfg.data.train_jsonl)
        self.lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if len(self.lines) < world_size:
            raise ValueError(f"{path}: {len(self.lines)} records for {world_size} learner ranks; use more data")
        self.source = path.name
        self.epoch, self.position = 0, 0
        self._order: list[int] = self._epoch_order(0)
        self.carry: list[tuple[_Ref, Segment]] = []
        self.counters = {"samples_drawn": 0, "too_long_dropped": 0, "record_errors": 0, "window_carry": 0}
        self.bad_records = BadRecords(cfg.data.on_bad_record, str(path))

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
            self._order = self._epoch_order(self.epoch)
        ref = _Ref(self.epoch, self._order[self.position])
        self.position += 1
        self.counters["samples_drawn"] += 1
        return ref

    def _encode(self, ref: _Ref, ver: int) -> Segment | None:
        where = f"{self.source}:{ref.line + 1}"
        try:
            raw = json.loads(self.lines[ref.line])
            record = load_record(raw, where=where, coord_mode=self.cfg.data.coord_mode)
            # existence only: opening every image twice per draw would double the decode cost
            check_images(record, self.encoder.image_root or ".", where, open_images=False)
            target = channel_a_target(
                canonical_order(record.objects), self.encoder.tokenizer,
                desc_ce_weight=self.cfg.stage2_ab.desc_ce_weight, coord_ids=self.encoder.coord_ids,
                answer_format=self.encoder.prompts.answer_format,
            )
        except ValueError as exc:  # RecordError / TargetError / JSONDecodeError
            self.counters["record_errors"] += 1
            self.bad_records.handle(exc)  # data.on_bad_record: fail raises here
            return None
        sample_id = f"A:{record.id if record.id is not None else ref.line}@{ref.epoch}"
        before = self.encoder.counters["too_long_dropped"]
        segment = self.encoder.encode(record, target, sample_id=sample_id, channel="A", ver=ver)
        self.counters["too_long_dropped"] += self.encoder.counters["too_long_dropped"] - before
        return segment

    def next_window(self, ver: int) -> list[Pack]:
        """Exactly GA packs for one A step, as full as whole samples make them (segments tagged ``ver``).

        The synchronous path: image decoding + processor + targets, ~3 ms per tiny sample on CPU.
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
        while len(carry) < 2 * self.ga and (self.samples is None or not all(packs)
                                           or sum(map(len, packs)) + len(carry) < self.samples):
            ref = self._draw()
            if (seg := self._encode(ref, ver)) is None:
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
        return [Pack(ver=ver, channel="A", segments=p) for p in packs]

    # -- checkpoint ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "position": self.position,
            "carry": [[r.epoch, r.line] for r, _ in self.carry], "counters": dict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any], ver: int) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)
        self.counters.update(state.get("counters", {}))
        self.carry = []
        for epoch, line in state.get("carry", []):
            ref = _Ref(int(epoch), int(line))
            if (seg := self._encode(ref, ver)) is not None:
                self.carry.append((ref, seg))


def retag(segment: Segment, ver: int) -> Segment:
    """A Channel-A segment (carried or prefetched) joins the window under the learner's current ver."""
    return replace(segment, ver=ver)
