"""Channel-B post-processing as a library: rollout → strict parse → Hungarian match → target → encode.

    Sample (key, Record, image paths)
      │ rollout_batch: /infer in chunks of stage2_ab.channel_b.rollout_decode_batch_size,
      │                sampling from rollout_matching.decoding, seed from (training.seed, keys)
      ▼
    Rollout (token ids, ver, finish_reason, server prompt ids)
      │ build_segments, per sample:
      │   parse_rollout ─► hungarian_match ─► reordered_gt | rollout_prefix target ─► Encoder.encode
      ▼
    Segment (ver = the rollout's ver) + metrics {rollout/*, time/*}

The actor process (``actor/loop.py``) calls it for the async mode; the learner's ``step``/``micro``
modes call the same :class:`Pipeline` in-process. A malformed rollout never raises: it becomes a
target with zero valid predictions (counted in ``rollout/invalid_rollout`` and ``rollout/parse_*``);
an unexpected error on one sample drops that sample (counted in ``rollout/errors``) and the batch
goes on.

What this module does not know: sockets, credits, packing, or the learner's queues.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.data.records import Record, load_record
from common.detection.answer import canonical_order
from common.detection.matching import hungarian_match, precision_recall_f1
from common.detection.parsing import DROP_REASONS, parse_rollout
from common.wire.http import SamplingParams
from common.packing.segment import Segment
from common.detection.targets import TargetError, TargetSpec, reordered_gt_target, rollout_prefix_target

log = logging.getLogger(__name__)

#: Counters summed over samples (P/R/F1 are recomputed from the sums, never averaged).
COUNT_KEYS = (
    "rollout/samples",
    "rollout/n_pred",
    "rollout/n_gt",
    "rollout/n_matched",
    "rollout/parse_truncated",
    "rollout/invalid_rollout",
    "rollout/gating_rejections",
    "rollout/finish_length",
    "rollout/prompt_mismatch",
    "rollout/errors",
    "rollout/segments",
    "rollout/too_long_dropped",
    "rollout/target_fallback",
    *(f"rollout/parse_{r}" for r in DROP_REASONS),
)
TIME_KEYS = ("time/parse", "time/match", "time/target", "time/encode")


@dataclass
class Sample:
    """One Channel-B sample: its stream key (the segment's sample_id), record and resolved image paths."""

    key: str
    record: Record
    image_paths: list[str]


@dataclass
class Rollout:
    """One generated response, as the pipeline needs it (from ``InferOutput`` + the batch ``ver``)."""

    token_ids: list[int]
    ver: int
    finish_reason: str = "stop"
    prompt_token_ids: list[int] | None = None  # None = not checked against the encoder's prompt


@dataclass
class BatchMetrics:
    """Sums over samples plus stage times; :meth:`summary` adds precision/recall/F1 from the sums."""

    counts: dict[str, float] = field(default_factory=lambda: {k: 0 for k in COUNT_KEYS + TIME_KEYS})

    def add(self, other: BatchMetrics | dict[str, float]) -> None:
        src = other.counts if isinstance(other, BatchMetrics) else other
        for k, v in src.items():
            if k in self.counts:
                self.counts[k] += v

    def summary(self) -> dict[str, float]:
        c = dict(self.counts)
        p, r, f1 = precision_recall_f1(int(c["rollout/n_matched"]), int(c["rollout/n_pred"]), int(c["rollout/n_gt"]))
        c.update({"rollout/precision": p, "rollout/recall": r, "rollout/f1": f1})
        return c


def rollout_seed(base_seed: int, keys: Sequence[str]) -> int:
    """Sampling seed of one /infer batch: a pure function of ``training.seed`` and the batch's sample keys."""
    digest = hashlib.sha256(f"tandem/rollout/{base_seed}/{'|'.join(keys)}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class Pipeline:
    """Turns samples and their rollouts into Channel-B segments; stateless apart from counters."""

    def __init__(self, cfg: Any, encoder: Any, tokenizer: Any | None = None) -> None:
        self.cfg = cfg
        self.encoder = encoder
        self.tokenizer = tokenizer if tokenizer is not None else encoder.tokenizer
        self.coord_ids = getattr(encoder, "coord_ids", None)
        self.target_kind = cfg.stage2_ab.channel_b.target
        self.matching = cfg.rollout_matching.matching
        self.decode_batch = cfg.stage2_ab.channel_b.rollout_decode_batch_size
        self._errors_logged = 0

    # -- inputs ---------------------------------------------------------------------------------

    def sample(self, key: str, raw: dict[str, Any], *, where: str | None = None) -> Sample:
        """A :class:`Sample` from a raw JSONL record (validated; image paths resolved by the encoder)."""
        record = load_record(raw, where=where or key, coord_mode=self.cfg.data.coord_mode)
        return Sample(key=key, record=record, image_paths=self.encoder.image_paths(record))

    def sampling(self, keys: Sequence[str]) -> SamplingParams:
        """``rollout_matching.decoding`` as /infer sampling, seeded from (training.seed, keys)."""
        d = self.cfg.rollout_matching.decoding
        return SamplingParams(
            temperature=d.temperature,
            top_p=d.top_p,
            top_k=d.top_k,
            max_tokens=d.max_new_tokens,
            repetition_penalty=d.repetition_penalty,
            seed=rollout_seed(self.cfg.training.seed, keys),
        )

    def rollout_batch(self, samples: Sequence[Sample], client: Any, *, ver_hint: int | None = None,
                      client_id: str | None = None) -> list[Rollout]:
        """Roll out ``samples`` in /infer calls of ``rollout_decode_batch_size`` (independent of the learner
        micro-batch).

        ``ver_hint``: the lowest server ``ver`` worth generating under (passed as ``min_ver``); None = any.
        Retries, splitting and back-off are the client's.
        """
        out: list[Rollout] = []
        for i in range(0, len(samples), self.decode_batch):
            chunk = samples[i : i + self.decode_batch]
            items = [self.encoder.prompt_for_rollout(s.record, s.image_paths, item_id=s.key) for s in chunk]
            response = client.infer(items, self.sampling([s.key for s in chunk]), min_ver=ver_hint, client=client_id)
            out.extend(rollouts_from_response(response))
        return out

    # -- post-processing ------------------------------------------------------------------------

    def build_segments(self, samples: Sequence[Sample], rollouts: Sequence[Rollout]) -> tuple[list[Segment], BatchMetrics]:
        """One segment per sample that encodes within ``packing_length``; metrics for all of them."""
        if len(samples) != len(rollouts):
            raise ValueError(f"{len(samples)} samples but {len(rollouts)} rollouts")
        metrics = BatchMetrics()
        segments = []
        for sample, rollout in zip(samples, rollouts):
            try:
                segment = self._one(sample, rollout, metrics.counts)
            except Exception as exc:  # noqa: BLE001 - one bad sample must not stop the actor
                metrics.counts["rollout/errors"] += 1
                self._errors_logged += 1
                if self._errors_logged <= 10 or self._errors_logged % 100 == 0:
                    log.exception("sample %s dropped (%d errors so far): %s", sample.key, self._errors_logged, exc)
                continue
            if segment is not None:
                segments.append(segment)
        return segments, metrics

    def _one(self, sample: Sample, rollout: Rollout, c: dict[str, float]) -> Segment | None:
        c["rollout/samples"] += 1
        c["rollout/finish_length"] += int(rollout.finish_reason == "length")

        t0 = time.perf_counter()
        parse = parse_rollout(rollout.token_ids, self.tokenizer, coord_ids=self.coord_ids,
                              answer_format=self.encoder.prompts.answer_format)
        t1 = time.perf_counter()
        gt = canonical_order(sample.record.objects)  # FN are appended in this order (common/detection/targets.py)
        pred_boxes = np.array([o.bins for o in parse.valid_objects], dtype=np.float64).reshape(-1, 4)
        gt_boxes = np.array([o.bins for o in gt], dtype=np.float64).reshape(-1, 4)
        m = self.matching
        match = hungarian_match(pred_boxes, gt_boxes, candidate_top_k=m.candidate_top_k, gate=m.gate,
                                fp_cost=m.fp_cost, fn_cost=m.fn_cost)
        t2 = time.perf_counter()
        target = self._target(parse, match, gt, c)
        t3 = time.perf_counter()

        c["rollout/n_pred"] += parse.n_valid
        c["rollout/n_gt"] += len(gt)
        c["rollout/n_matched"] += match.n_matched
        c["rollout/parse_truncated"] += int(parse.truncated)
        c["rollout/invalid_rollout"] += int(parse.invalid_rollout)
        c["rollout/gating_rejections"] += match.gating_rejections
        for reason, n in parse.dropped_by_reason.items():
            c[f"rollout/parse_{reason}"] += n

        prompt = self.encoder.prompt(sample.record, sample.image_paths)
        if rollout.prompt_token_ids is not None:
            if not self.encoder.check_server_prompt(sample.key, rollout.prompt_token_ids, prompt["input_ids"]):
                c["rollout/prompt_mismatch"] += 1
        meta = {
            "key": sample.key,
            "ver": rollout.ver,
            "n_pred": parse.n_valid,
            "n_gt": len(gt),
            "n_matched": match.n_matched,
            "n_fn": target.n_fn,
            "parse_dropped": parse.n_dropped,
            "parse_truncated": int(parse.truncated),
            "invalid_rollout": int(parse.invalid_rollout),
            "gating_rejections": match.gating_rejections,
            "finish_reason": rollout.finish_reason,
            "rollout_len": len(rollout.token_ids),
            **{f"target/{k}": v for k, v in target.meta.items()},
        }
        segment = self.encoder.encode(sample.record, target, sample_id=sample.key, channel="B", ver=rollout.ver,
                                      meta=meta, image_paths=sample.image_paths, prompt=prompt)
        t4 = time.perf_counter()
        c["time/parse"] += t1 - t0
        c["time/match"] += t2 - t1
        c["time/target"] += t3 - t2
        c["time/encode"] += t4 - t3
        if segment is None:
            c["rollout/too_long_dropped"] += 1
        else:
            c["rollout/segments"] += 1
        return segment

    def _target(self, parse: Any, match: Any, gt: Sequence[Any], c: dict[str, float]) -> TargetSpec:
        ab = self.cfg.stage2_ab
        if self.target_kind == "rollout_prefix":
            try:
                return rollout_prefix_target(parse, match, gt, self.tokenizer, desc_ce_weight=ab.desc_ce_weight,
                                             fn_geometry=ab.channel_b.fn_geometry, coord_ids=self.coord_ids)
            except TargetError as exc:
                # e.g. a prefix ending in ',' with nothing left to append: fall back to the GT-context target.
                c["rollout/target_fallback"] += 1
                log.debug("rollout_prefix target impossible (%s); using reordered_gt", exc)
        return reordered_gt_target(parse, match, gt, self.tokenizer, desc_ce_weight=ab.desc_ce_weight,
                                   desc_ce_weight_matched=ab.channel_b.desc_ce_weight_matched, coord_ids=self.coord_ids)


def rollouts_from_response(response: Any) -> list[Rollout]:
    """``InferResponse`` (or a list of per-item outputs carrying ``ver``) -> :class:`Rollout` list."""
    outputs = getattr(response, "outputs", response)
    batch_ver = getattr(response, "ver", None)
    out = []
    for o in outputs:
        ver = getattr(o, "ver", batch_ver)
        if ver is None:
            raise ValueError("a rollout without a ver: the server must stamp every /infer response")
        out.append(Rollout(token_ids=list(o.token_ids), ver=int(ver), finish_reason=o.finish_reason,
                           prompt_token_ids=list(o.prompt_token_ids) if getattr(o, "prompt_token_ids", None) else None))
    return out
