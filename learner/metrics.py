"""Per-optimizer-step metrics: gathered from every rank, written by rank 0 (docs/design.md section 10).

Each rank fills one :class:`RankStats` per step; :func:`gather_stats_record` all-gathers them as one
fixed-length float vector (one collective, every rank, every step) and rank 0 turns them into one
JSONL record (``{training.output_dir}/metrics.jsonl``, one line per optimizer step), the same
numbers to the trackers of ``training.report_to`` (``learner/trackers.py``) and a tqdm bar.
Keys are ``<area>/<name>``; stalls are ``time/wait_*``.

Aggregation rule: losses are already normalised by step-global counts, so they are *summed* over
ranks; counters (drops, received, ...) are summed for the ``*_total`` keys and also reported per
rank under ``queue/rank<r>/*`` (the conservation identity is checked per rank); times are the
max over ranks (the slowest rank sets the step time) with ``*_mean`` next to them (:func:`time_keys`: what
counts as busy on a GPU, and ``time/other``, the step time no part accounts for). Rollout quality
(``rollout/*``) exists only on steps that trained B packs: counts summed over ranks, P/R/F1 from them.
Evaluation records (``"record": "eval"``) share the file, appended by :meth:`MetricsWriter.write_eval`.

What this module does not know: models, sockets, or how the values were measured.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common.detection.matching import precision_recall_f1
from learner.pack_queue import COUNTER_NAMES, REJECTED
from learner.throughput import mfu

log = logging.getLogger(__name__)

#: The actor's per-segment rollout counters a trained B pack carries (summed by :meth:`RankStats.add_pack_meta`).
ROLLOUT_COUNTS = ("n_pred", "n_gt", "n_matched", "parse_truncated", "invalid_rollout")

#: Scalar per-rank fields, in vector order (the trained pack vers follow, padded to GA with -1).
RANK_FIELDS = (
    "kind_b", "micro_steps", "forwards", "backwards", "max_forwards_per_micro", "packs", "segments", "tokens",
    "time_forward_backward", "time_wait_for_packs", "time_wait_for_a_window", "time_step", "time_sync_stall",
    "time_optimizer_step", "time_prepare_inputs", "time_forward_backward_gpu",
    "loss_total", "loss_ce", "loss_bbox_smoothl1", "loss_bbox_ciou", "loss_coord_ce",
    "ver_lag_sum", "ver_lag_max", "queue_depth", "fill_sum", "ver_current", "sync_client_calls",
    "a_dropped_total", "a_window_carry", "mem_peak_rss", "mem_peak_allocated", "mem_peak_reserved",
    *(f"rollout_{name}" for name in ROLLOUT_COUNTS),
    *(f"queue_{name}" for name in COUNTER_NAMES),
)


class RankStats(dict):
    """This rank's numbers for one optimizer step (keys: :data:`RANK_FIELDS`) plus ``trained_vers``."""

    def __init__(self) -> None:
        super().__init__({k: 0.0 for k in RANK_FIELDS})
        self.trained_vers: list[int] = []

    def add_pack_meta(self, segment_meta: list[dict[str, Any]]) -> None:
        """Sum the actor's per-segment rollout counters of a trained B pack."""
        for m in segment_meta:
            inner = m.get("meta", {})
            for key in ROLLOUT_COUNTS:
                value = inner.get(key, 0)
                if isinstance(value, (int, float)):
                    self[f"rollout_{key}"] += value

    def vector(self, ga: int) -> list[float]:
        vers = (self.trained_vers + [-1] * ga)[:ga]
        return [float(self[k]) for k in RANK_FIELDS] + [float(v) for v in vers]


def unpack(vector: list[float], ga: int) -> RankStats:
    stats = RankStats()
    for k, v in zip(RANK_FIELDS, vector):
        stats[k] = v
    stats.trained_vers = [int(v) for v in vector[len(RANK_FIELDS):len(RANK_FIELDS) + ga] if v >= 0]
    return stats


def rollout_keys(counts: dict[str, int]) -> dict[str, Any]:
    """The ``rollout/*`` keys of a step that trained B packs: the counts (``counts``: :data:`ROLLOUT_COUNTS`
    summed over ranks) and P/R/F1 from them.

    P/R/F1 are left out when the packs held no GT and no prediction: ``precision_recall_f1`` calls
    that case perfect (1.0), which is right for one image but would read as a perfect step in a plot.
    A steps get none of these keys (absent, not 0 or 1): readers aggregate the counts over B records.
    """
    out: dict[str, Any] = {f"rollout/{k}": int(counts[k]) for k in ROLLOUT_COUNTS}
    if counts["n_pred"] + counts["n_gt"] > 0:
        p, r, f1 = precision_recall_f1(int(counts["n_matched"]), int(counts["n_pred"]), int(counts["n_gt"]))
        out.update({"rollout/precision": p, "rollout/recall": r, "rollout/f1": f1})
    return out


def memory_keys(per_rank: list[RankStats]) -> dict[str, Any]:
    """``mem/*``: each rank's peak memory since its process started (GiB), the max over ranks and the list by rank.

    ``peak_rss_gb`` (host) always; ``peak_allocated_gb`` / ``peak_reserved_gb`` (CUDA allocator) only on a GPU
    learner (absent on CPU, not 0).
    """
    out: dict[str, Any] = {}
    for name in ("rss", "allocated", "reserved"):
        values = [round(float(r[f"mem_peak_{name}"]), 3) for r in per_rank]
        if name == "rss" or any(values):
            out[f"mem/peak_{name}_gb"] = max(values)
            out[f"mem/peak_{name}_gb_by_rank"] = values
    return out


#: The per-rank times of a step's parts besides forward/backward (:func:`busy_seconds`); ``time/other`` is the rest.
TIMED_PARTS = ("time_wait_for_packs", "time_wait_for_a_window", "time_sync_stall", "time_optimizer_step",
               "time_prepare_inputs")
#: The record keys that add up to ``time/step`` on a one-rank CPU learner: forward/backward, the parts, the rest.
STEP_TIME_KEYS = ("time/forward_backward", *(f"time/{k.removeprefix('time_')}" for k in TIMED_PARTS), "time/other")


def busy_seconds(stats: RankStats) -> float:
    """A rank's forward/backward time of the step: the host's wall time, or the device's when longer.

    On a GPU the wall time covers launching the kernels (the loss read waits for the forward; the backward
    is only launched) and the kernels finish at a later host wait, inside another part or none; the CUDA
    events of ``time_forward_backward_gpu`` time the spans where they run. On CPU that field is 0.
    """
    return max(stats["time_forward_backward"], stats["time_forward_backward_gpu"])


def other_seconds(stats: RankStats) -> float:
    """A rank's step time that no timed part covers: ``time_step`` − :func:`busy_seconds` − :data:`TIMED_PARTS`.

    Clamped at 0: on a GPU the parts can overlap (the optimizer step's gradient-norm read waits for the
    last backward's kernels, which the device time also counts), so this is a lower bound there.
    """
    return max(0.0, stats["time_step"] - busy_seconds(stats) - sum(stats[k] for k in TIMED_PARTS))


def time_keys(per_rank: list[RankStats]) -> dict[str, Any]:
    """``time/*`` and ``learner/busy_fraction`` of a step.

    Times are the max over ranks (the slowest sets the step), ``*_mean`` the mean; ``time/other`` is the max of
    each rank's :func:`other_seconds`. ``time/forward_backward_gpu`` (and ``_mean``) only on a GPU learner:
    absent on CPU, not 0 (as ``mem/peak_allocated_gb``). Busy is :func:`busy_seconds`, the mean over ranks,
    ÷ ``time/step``, at most 1: on CPU the wall time as before, on a GPU the longer of wall and device time.
    """
    n = len(per_rank)
    step_s = max(r["time_step"] for r in per_rank) or 1e-9
    fb = [r["time_forward_backward"] for r in per_rank]
    fb_gpu = [r["time_forward_backward_gpu"] for r in per_rank]
    out: dict[str, Any] = {"time/step": step_s, "time/forward_backward": max(fb),
                           "time/forward_backward_mean": sum(fb) / n}
    if any(fb_gpu):
        out.update({"time/forward_backward_gpu": max(fb_gpu), "time/forward_backward_gpu_mean": sum(fb_gpu) / n})
    for key in TIMED_PARTS:
        out[f"time/{key.removeprefix('time_')}"] = max(r[key] for r in per_rank)
    out["time/other"] = max(other_seconds(r) for r in per_rank)
    out["learner/busy_fraction"] = min(1.0, (sum(busy_seconds(r) for r in per_rank) / n) / step_s)
    return out


def step_record(step: int, per_rank: list[RankStats], facts: dict[str, Any], packing_length: int) -> dict[str, Any]:
    """The JSONL record of optimizer step ``step`` from every rank's stats and rank 0's facts.

    ``facts`` holds the rank-0 values: policy/kind/skip flags, ver_current, realized ratio, sync
    timings and counts, lr, grad norm. ``rollout/*`` keys are present only when the step trained B
    packs (:func:`rollout_keys`).
    """
    n = len(per_rank)

    def total(key: str) -> float:
        return sum(r[key] for r in per_rank)

    step_s = max(r["time_step"] for r in per_rank) or 1e-9
    packs, tokens, lags = total("packs"), total("tokens"), [v for r in per_rank for v in r.trained_vers]
    kind_b = any(r["kind_b"] for r in per_rank)  # every rank trains the decided kind
    rec: dict[str, Any] = {
        "step": step,
        **facts,
        "stage2_ab/async/queue_depth": total("queue_depth") / n,
        "stage2_ab/async/queue_depth_min": min(r["queue_depth"] for r in per_rank),
        "stage2_ab/async/ver_lag_mean": (total("ver_lag_sum") / len(lags)) if lags else 0.0,
        "stage2_ab/async/ver_lag_max": max((r["ver_lag_max"] for r in per_rank), default=0.0) if lags else 0.0,
        "stage2_ab/async/drop_stale_total": total("queue_stale_dropped"),
        "stage2_ab/async/drop_oldest_total": total("queue_oldest_dropped"),
        "stage2_ab/async/drop_duplicate_total": total("queue_duplicate_dropped"),
        "stage2_ab/async/malformed_total": total("queue_malformed"),
        "stage2_ab/async/rejected_total": sum(total(f"queue_{name}") for name in REJECTED),
        "stage2_ab/async/trained_pack_vers": [r.trained_vers for r in per_rank],
        "stage2_ab/async/kinds_by_rank": ["B" if r["kind_b"] else "A" for r in per_rank],
        "stage2_ab/async/ver_current_by_rank": [int(r["ver_current"]) for r in per_rank],
        "sync/client_calls_by_rank": [int(r["sync_client_calls"]) for r in per_rank],
        "loss/total": total("loss_total"),
        "loss/ce": total("loss_ce"),
        "loss/bbox_smoothl1": total("loss_bbox_smoothl1"),
        "loss/bbox_ciou": total("loss_bbox_ciou"),
        "loss/coord_ce": total("loss_coord_ce"),
        **time_keys(per_rank),
        "learner/micro_steps": [int(r["micro_steps"]) for r in per_rank],
        "learner/forwards": [int(r["forwards"]) for r in per_rank],
        "learner/backwards": [int(r["backwards"]) for r in per_rank],
        "learner/max_forwards_per_micro_step": int(max(r["max_forwards_per_micro"] for r in per_rank)),
        "throughput/tokens_per_s": tokens / step_s,
        "throughput/packs_per_s": packs / step_s,
        "packing/fill": (total("fill_sum") / packs) if packs else 0.0,
        "packing/segments": int(total("segments")),
        # Samples trained in this step over every rank, by channel (the other one is 0): A packs hold as many as fit.
        "train/samples_a": 0 if kind_b else int(total("segments")),
        "train/samples_b": int(total("segments")) if kind_b else 0,
        "packing/tokens": int(tokens),
        "packing/channel_a_dropped_total": int(total("a_dropped_total")),
        "packing/window_carry": int(total("a_window_carry")),
    }
    rec.update(memory_keys(per_rank))
    if "throughput/peak_tflops" in facts:  # learner.throughput: every rank's tokens against every rank's peak
        rec["throughput/mfu"] = mfu(rec["throughput/tokens_per_s"], facts["throughput/lm_params_non_embedding"],
                                    facts["throughput/peak_tflops"])
    if kind_b and packs:
        rec.update(rollout_keys({k: int(total(f"rollout_{k}")) for k in ROLLOUT_COUNTS}))
    for r, stats in enumerate(per_rank):
        for name in COUNTER_NAMES:
            rec[f"queue/rank{r}/{name}"] = int(stats[f"queue_{name}"])
    return rec


class MetricsWriter:
    """Rank 0's sinks: JSONL (always), the trackers of ``training.report_to`` (learner/trackers.py), a tqdm bar.

    Two writers share ``metrics.jsonl``: the training thread (:meth:`write`, one step record per
    optimizer step) and the evaluation thread (:meth:`write_eval`, one ``"record": "eval"`` line per
    evaluation). One lock serialises them, so every line is whole; step records carry no ``record``
    key (readers treat a missing one as ``"step"``, see ``launcher.summary.read_metrics``). Every line
    carries the run's ``run_id`` (``common/runs/checkpoints.py``), so lines of two runs can never be confused.
    """

    def __init__(self, output_dir: str | Path, *, enabled: bool, progress: bool, start_step: int, max_steps: int,
                 run_id: str | None = None, report_to: Sequence[str] = (), run_name: str = "tandem",
                 config: dict[str, Any] | None = None) -> None:
        """``report_to``: ``training.report_to`` (learner/trackers.py), opened here on rank 0 only."""
        self.enabled, self.run_id = enabled, run_id
        self._jsonl = self._bar = None
        self._trackers: list[Any] = []
        self._lock = threading.Lock()
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "metrics.jsonl"
        set_aside_superseded(self.path, start_step)
        self._jsonl = self.path.open("a", encoding="utf-8")
        if report_to:
            from learner.trackers import open_trackers

            self._trackers = open_trackers(report_to, out, run_name=run_name, run_id=run_id, config=config)
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=max_steps, initial=start_step, desc="learner", unit="step", dynamic_ncols=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append one step record (training thread)."""
        if not self.enabled:
            return
        with self._lock:
            self._append(record)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(kind=record.get("stage2_ab/async/step_kind_b"), loss=f"{record['loss/total']:.3f}",
                                  ver=record.get("stage2_ab/async/ver_current"), refresh=False)

    def write_eval(self, record: dict[str, Any]) -> None:
        """Append one evaluation record (any thread): ``metrics.jsonl`` and ``eval/*`` scalars at ``record["step"]``.

        ``record["step"]`` is the optimizer steps completed when the evaluated weights were taken; the
        ``record`` key is set to ``"eval"`` here so readers can tell it from a step record.
        """
        if not self.enabled:
            return
        with self._lock:
            self._append({"record": "eval", **{k: v for k, v in record.items() if k != "record"}})

    def write_end(self, record: dict[str, Any]) -> None:
        """Append the run's ``"record": "end"`` line (rank 0, after the last step when no final checkpoint is
        written: ``training.save_final: false``): ``step`` (optimizer steps done), ``ver`` (the server's, after the
        final push) and ``sync_counts``, which the summary reads instead of the final checkpoint's trainer state."""
        if not self.enabled:
            return
        with self._lock:
            self._append({"record": "end", **{k: v for k, v in record.items() if k != "record"}})

    def _append(self, record: dict[str, Any]) -> None:
        """One JSON line (flushed) and its finite numeric values to every tracker; caller holds the lock."""
        if self._jsonl is None:  # an evaluation that finished after close(): say so rather than raise in its thread
            log.warning("metrics record of step %s arrived after the writer closed; not written", record.get("step"))
            return
        self._jsonl.write(json.dumps({**record, "run_id": self.run_id}, default=_plain) + "\n")
        self._jsonl.flush()
        if self._trackers and isinstance(record.get("step"), int) and record.get("record") in (None, "eval"):
            from learner.trackers import scalars

            values = scalars(record)
            for tracker in list(self._trackers):
                try:
                    tracker.log(values, record["step"])
                except Exception as exc:  # noqa: BLE001 - a tracker is a view of metrics.jsonl: never end the run
                    self._trackers.remove(tracker)
                    log.error("tracker %s failed at step %s (%s: %s); it gets no more records, metrics.jsonl goes on",
                              type(tracker).__name__, record["step"], type(exc).__name__, exc)

    def close(self) -> None:
        with self._lock:
            for sink in (self._jsonl, self._bar, *self._trackers):
                if sink is not None:
                    sink.close()
            self._jsonl = self._bar = None
            self._trackers = []


def set_aside_superseded(path: Path, start_step: int) -> Path | None:
    """A resume from step S trains steps S, S+1, ... again: lines an earlier attempt of the run wrote for them
    (step and evaluation records with ``step >= S``), and a line torn by a kill, move to
    ``metrics.superseded-<UTC time>.jsonl`` next to it (never deleted), so each step has one record."""
    if start_step <= 0 or not path.is_file():
        return None
    keep, gone = [], []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            step = start_step  # torn or foreign: set aside with the superseded lines
        (gone if not line.endswith("\n") or not isinstance(step, int) or step >= start_step else keep).append(line)
    if not gone:
        return None
    aside = path.with_name(f"metrics.superseded-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S')}.jsonl")
    aside.write_text("".join(gone), encoding="utf-8")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)
    log.warning("resume from step %d: %d metrics line(s) of steps it trains again moved to %s", start_step,
                len(gone), aside.name)
    return aside


def _plain(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def gather_stats_record(dist: Any, step: int, stats: RankStats, facts: dict[str, Any], ga: int,
                        packing_length: int) -> dict[str, Any] | None:
    """All-gather every rank's stats (one collective, every rank); rank 0 gets the record, others None."""
    vectors = dist.all_gather(stats.vector(ga), f"metrics all_gather at step {step}")
    if not dist.is_main:
        return None
    return step_record(step, [unpack(v, ga) for v in vectors], facts, packing_length)
