"""The one-process modes: ``step`` (the synchronous baseline) and ``micro`` (the baselines the async mode is measured against).

Both call the actor's pipeline in-process (``actor.pipeline.Pipeline``: /infer on the rollout
server → parse → match → target → encode), so the learner needs a rollout server but no actor.
A steps are the async mode's (exactly GA window packs); the sync cadence is the async mode's too.

``step``, a B step::

    rollouts_per_step samples of the B stream ─► /infer in chunks of rollout_decode_batch_size
      ─► segments ─► common.packing.packer.Packer ─► a VARIABLE number of packs
      ─► one forward/backward per pack, loss × (segments in pack / segments in step)
      ─► ONE optimizer update
    enable_pipeline: a producer thread rolls out chunk by chunk into queue.Queue(maxsize=1); the main
      thread packs as soon as min_fill is reached and learns while the next chunk is generated. The
      step's segment count is known only at the end, so each pack's loss is scaled by its segment
      count and the gradients are divided by the total once before the update (the same arithmetic).

The origin ran Channel-B "on the final micro-step" of an HF Trainer window; here the optimizer step
is the unit, so the whole budget is rolled out and learned inside it — the same single update.

``micro``, a B step: GA times { per_device_train_batch_size samples → rollout → pack → learn },
each micro-step's packs weighted by segment share / GA; one update at the end.

What this module does not know: queues or ranks (world size 1 only: learner/train.py refuses more).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from common.packing.packer import Packer
from common.packing.schedule import wants_b
from learner.loss import Normaliser
from learner.step_record import RankStats, StepRecord

log = logging.getLogger(__name__)

_DONE = object()


class _BStream:
    """The B samples of a one-process run: the actor's stream (rank 0 of 1), skipping trained keys."""

    def __init__(self, learner: Any) -> None:
        from actor.client import RolloutClient
        from actor.pipeline import Pipeline
        from actor.stream import SampleStream

        cfg = learner.cfg
        self.pipeline = Pipeline(cfg, learner.encoder)
        self.client = RolloutClient.from_config(cfg, client_id="learner-rank0")
        stream = SampleStream(cfg.data.train_jsonl, rank=0, world_size=1, seed=cfg.training.seed,
                              skip_keys=learner.b_trained)
        self._items: Iterator[Any] = iter(stream)

    def take(self, n: int) -> list[Any]:
        return [self.pipeline.sample(item.key, item.record) for item in (next(self._items) for _ in range(n))]

    def segments(self, samples: list[Any]) -> tuple[list[Any], dict[str, float]]:
        rollouts = self.pipeline.rollout_batch(samples, self.client, client_id="learner-rank0")
        segments, metrics = self.pipeline.build_segments(samples, rollouts)
        return segments, metrics.counts


def _train_packs(learner: Any, packs: list[Any], stats: RankStats, weight_per_segment: float) -> None:
    """One forward/backward per pack, normalised by its own counts and weighted by its segment share.

    Each pack's inputs are built just before its forward (the step's packs arrive over time), so
    ``time/prepare_inputs`` sums the per-pack builds here.
    """
    for pack in packs:
        t0 = time.monotonic()
        inp = learner.inputs(pack.tensors())
        norm = Normaliser(ce_tokens=inp.rows.n_ce, boxes=inp.rows.n_boxes)
        stats.time_prepare_inputs += time.monotonic() - t0
        seen = learner.forward_backward(inp, norm, stats, channel="B", sync_grads=True,
                                        loss_scale=len(pack.segments) * weight_per_segment)
        stats.add_ver_lag(learner.ver, pack.ver)
        stats.add_pack_meta(pack.segment_meta())
        learner.b_trained.update(s.sample_id for s in pack.segments)
        learner.trace(kind="B", ver_current=learner.ver, pack_ver=pack.ver, forwards=seen["forward"],
                      backwards=seen["backward"], sample_ids=[s.sample_id for s in pack.segments], tokens=pack.n_tokens)


def _scale_grads(model: torch.nn.Module, factor: float) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)


def _packer(learner: Any, min_fill: float = 0.0) -> Packer:
    return Packer(learner.packing_length, min_fill, max_wait_s=float("inf"))


def _step_b(learner: Any, stream: _BStream, stats: RankStats) -> None:
    cfg = learner.cfg
    samples = stream.take(cfg.derived.rollouts_per_step)
    if not cfg.stage2_ab.channel_b.enable_pipeline:
        t0 = time.monotonic()
        segments, _ = stream.segments(samples)
        stats.time_wait_for_packs += time.monotonic() - t0  # the synchronous baseline waits for every rollout
        packer = _packer(learner)
        for s in segments:
            packer.add(s)
        _train_packs(learner, packer.flush_all(), stats, 1.0 / max(1, len(segments)))
        return
    chunk = cfg.stage2_ab.channel_b.rollout_decode_batch_size
    handoff: queue.Queue = queue.Queue(maxsize=1)  # capacity 1: at most one chunk waits while we learn

    def produce() -> None:
        try:
            for i in range(0, len(samples), chunk):
                handoff.put(stream.segments(samples[i:i + chunk])[0])
            handoff.put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            handoff.put(exc)

    producer = threading.Thread(target=produce, name="step-rollout-producer", daemon=True)
    producer.start()
    packer = _packer(learner, cfg.training.packing_min_fill_ratio)
    deadline_s = 4 * cfg.rollout_matching.vllm.infer_timeout_s
    seen = 0
    while True:
        t0 = time.monotonic()
        try:
            got = handoff.get(timeout=deadline_s)
        except queue.Empty:
            raise TimeoutError(
                f"step mode: no rollout chunk from {[s.base_url for s in cfg.rollout_matching.vllm.servers]} within "
                f"{deadline_s:.0f}s (4 × rollout_matching.vllm.infer_timeout_s). Is the rollout server up? "
                "Start it with: python -m rollout_server --config CONFIG"
            ) from None
        stats.time_wait_for_packs += time.monotonic() - t0  # learning waits only when rollouts lag
        if got is _DONE:
            break
        if isinstance(got, BaseException):
            raise got
        seen += len(got)
        for s in got:
            packer.add(s)
        _train_packs(learner, packer.pop_ready(), stats, 1.0)  # scaled by segment count; divided below
    _train_packs(learner, packer.flush_all(), stats, 1.0)
    producer.join(timeout=5)
    if seen:
        _scale_grads(learner.model, 1.0 / seen)
        # loss/coord_ce stays: B packs carry none (stage2_ab.coord_ce_weight is Channel-A's)
        stats.loss_total /= seen
        stats.loss_ce /= seen
        stats.loss_bbox_smoothl1 /= seen
        stats.loss_bbox_ciou /= seen


def _micro_b(learner: Any, stream: _BStream, stats: RankStats) -> None:
    ga, per_micro = learner.ga, learner.cfg.training.per_device_train_batch_size
    for _ in range(ga):
        t0 = time.monotonic()
        segments, _ = stream.segments(stream.take(per_micro))
        stats.time_wait_for_packs += time.monotonic() - t0
        packer = _packer(learner)
        for s in segments:
            packer.add(s)
        _train_packs(learner, packer.flush_all(), stats, 1.0 / (max(1, len(segments)) * ga))


def _a_step(learner: Any, stats: RankStats) -> None:
    window = learner.take_a_window(stats)
    packs = window.packs
    inputs, norm = learner.step_inputs(window.arrays, stats)
    for i, (inp, pack) in enumerate(zip(inputs, packs)):
        seen = learner.forward_backward(inp, norm, stats, channel="A", sync_grads=True)
        learner.trace(micro=i, kind="A", ver_current=learner.ver, pack_ver=pack.ver, forwards=seen["forward"],
                      backwards=seen["backward"], sample_ids=[s.sample_id for s in pack.segments], tokens=inp.n_tokens)


def run_sync_mode(learner: Any, mode: str) -> None:
    """Loop ``step`` or ``micro`` optimizer steps until ``training.max_steps`` (world size 1)."""
    stream = _BStream(learner) if learner.b_ratio > 0 else None
    while not learner.finished:
        record = StepRecord()
        learner.maybe_sync(record)
        kind_b = wants_b(learner.step, learner.b_ratio)
        if kind_b:
            (_step_b if mode == "step" else _micro_b)(learner, stream, record.stats)
        else:
            _a_step(learner, record.stats)
        facts = record.facts
        facts.policy_wants_b = facts.step_kind_b = kind_b
        facts.b_step_skipped_due_to_queue, facts.mode = False, mode
        learner.finish_step(record)
