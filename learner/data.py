"""Channel-A on the learner: the main dataloader and the window packer (exactly GA packs per step).

::

    train JSONL ─► DistributedSampler(rank, world, shuffle, seed, drop_last) ─► record index
        ─► canonical GT ─► common.targets.channel_a_target ─► common.tensors.encode.Encoder ─► Segment (channel A)
        ─► window_packs(carry + this window's segments, GA, packing_length) ─► GA Packs, leftover carry

Each A step draws ``per_device_train_batch_size × GA`` samples minus what the carry already holds
(more if fewer than GA segments survived encoding), and :func:`window_packs` turns them into
**exactly GA** non-empty packs — never more, never fewer — so every rank runs one packed
forward/backward per micro-step whatever its samples' lengths. A segment that fits no pack this
window waits in the carry for the next one (counted in ``packing/window_carry``); the carry never
exceeds one window's worth of samples.

Sample ids are ``A:<record id or line>@<epoch>``. The sampler position (epoch, index within the
epoch) and the carry's (epoch, line) references are the checkpointed state: a resumed run draws
exactly the samples the uninterrupted run would have. A window is a pure function of that state,
which is what lets learner/prefetch.py build it one step early and still checkpoint exactly.

Threads: not thread-safe (nor is its Encoder). In the learner, the Channel-A prefetch thread owns
this object and its Encoder from ``ChannelAPrefetcher.start()`` on; nothing else may call it then.

What this module does not know: ranks beyond (rank, world), models, or Channel-B.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.assistant_json import canonical_order, load_record
from common.segment import Pack, Segment
from common.targets import channel_a_target

log = logging.getLogger(__name__)


def window_packs(segments: list[Segment], n_packs: int, packing_length: int) -> tuple[list[Pack], list[Segment]]:
    """Exactly ``n_packs`` packs from ``segments`` (LPT balancing) plus the segments that did not fit.

    Longest first: the ``n_packs`` longest seed one pack each; every other segment goes into the
    pack with the fewest tokens that still has room, else it is left over. Packs keep their
    segments in input order. Raises if fewer than ``n_packs`` segments are given.
    """
    if len(segments) < n_packs:
        raise ValueError(f"window_packs needs at least {n_packs} segments, got {len(segments)}")
    order = sorted(range(len(segments)), key=lambda i: (-segments[i].length, i))
    bins: list[list[int]] = [[i] for i in order[:n_packs]]
    sums = [segments[i].length for i in order[:n_packs]]
    leftover = []
    for i in order[n_packs:]:
        fits = [b for b in range(n_packs) if sums[b] + segments[i].length <= packing_length]
        if not fits:
            leftover.append(i)
            continue
        b = min(fits, key=lambda k: (sums[k], k))
        bins[b].append(i)
        sums[b] += segments[i].length
    packs = []
    for members in bins:
        chosen = [segments[i] for i in sorted(members)]
        packs.append(Pack(ver=chosen[0].ver, channel="A", segments=chosen))
    return packs, [segments[i] for i in sorted(leftover)]


@dataclass
class _Ref:
    epoch: int
    line: int


class ChannelAData:
    """This rank's Channel-A stream: sampler order, target building, encoding, window packing."""

    def __init__(self, cfg: Any, encoder: Any, *, rank: int, world_size: int, ga: int) -> None:
        self.cfg, self.encoder, self.rank, self.world_size, self.ga = cfg, encoder, rank, world_size, ga
        self.per_device = cfg.training.per_device_train_batch_size
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
            record = load_record(raw, where=where)
            target = channel_a_target(
                canonical_order(record.objects), self.encoder.tokenizer,
                desc_ce_weight=self.cfg.stage2_ab.desc_ce_weight, coord_ids=self.encoder.coord_ids,
            )
        except ValueError as exc:  # RecordError / TargetError: a bad record must not stop training
            self.counters["record_errors"] += 1
            log.error("Channel-A record %s skipped: %s", where, exc)
            return None
        sample_id = f"A:{record.id if record.id is not None else ref.line}@{ref.epoch}"
        before = self.encoder.counters["too_long_dropped"]
        segment = self.encoder.encode(record, target, sample_id=sample_id, channel="A", ver=ver)
        self.counters["too_long_dropped"] += self.encoder.counters["too_long_dropped"] - before
        return segment

    def next_window(self, ver: int) -> list[Pack]:
        """Exactly GA packs for one A step (segments tagged ``ver``).

        The synchronous path: image decoding + processor + targets, ~5 ms per tiny sample on CPU.
        The learner calls it on the Channel-A prefetch thread (learner/prefetch.py), one window
        ahead, and retags the segments with its ver when it takes the window.
        """
        pending = [(ref, seg if seg.ver == ver else retag(seg, ver)) for ref, seg in self.carry]
        for _ in range(max(0, self.per_device * self.ga - len(pending))):
            ref = self._draw()
            if (seg := self._encode(ref, ver)) is not None:
                pending.append((ref, seg))
        attempts = 0
        while len(pending) < self.ga:
            attempts += 1
            if attempts > 100 * self.ga:
                raise RuntimeError(
                    f"rank {self.rank}: 100×GA Channel-A samples in a row were unusable (too long or invalid); "
                    f"check {self.cfg.data.train_jsonl} and training.global_max_length"
                )
            ref = self._draw()
            if (seg := self._encode(ref, ver)) is not None:
                pending.append((ref, seg))
        packs, leftover = window_packs([s for _, s in pending], self.ga, self.packing_length)
        left = {id(s) for s in leftover}
        self.carry = [(r, s) for r, s in pending if id(s) in left]
        self.counters["window_carry"] = len(self.carry)
        return packs

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
