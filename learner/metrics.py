"""Per-optimizer-step metrics: gathered from every rank, written by rank 0 (docs/design.md section 10).

Each rank fills one ``learner.step_record.StepRecord`` per step; :func:`gather_metrics_line` all-gathers its
:class:`~learner.step_record.RankStats` as one fixed-length float vector (one collective, every rank, every
step) and rank 0 turns every rank's stats and its own ``StepFacts`` into one JSONL record
(:func:`metrics_line`; ``{training.output_dir}/metrics.jsonl``, one line per optimizer step), the same
numbers to the trackers of ``training.report_to`` (``learner/trackers.py``) and a tqdm bar.
Keys are ``<area>/<name>``; stalls are ``time/wait_*``. Each key is written out here where it is made from
the per-rank numbers (rank 0's facts name theirs in learner/step_record.py), so grepping a key finds it.

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
from learner.step_record import ROLLOUT_COUNTS, RankStats, StepFacts, StepRecord
from learner.throughput import mfu

log = logging.getLogger(__name__)

#: ``queue/rank{r}/<counter>``: each rank's ready-queue counters (learner/pack_queue.py COUNTER_NAMES), by rank.
QUEUE_RANK_KEYS = {
    "received": "queue/rank{r}/received", "trained": "queue/rank{r}/trained",
    "stale_dropped": "queue/rank{r}/stale_dropped", "oldest_dropped": "queue/rank{r}/oldest_dropped",
    "duplicate_dropped": "queue/rank{r}/duplicate_dropped", "reserved": "queue/rank{r}/reserved",
    "in_queue": "queue/rank{r}/in_queue", "malformed": "queue/rank{r}/malformed",
    "rejected_future_ver": "queue/rank{r}/rejected_future_ver", "rejected_too_long": "queue/rank{r}/rejected_too_long",
    "rejected_token_id": "queue/rank{r}/rejected_token_id", "rejected_nonfinite": "queue/rank{r}/rejected_nonfinite",
    "rejected_weight": "queue/rank{r}/rejected_weight", "rejected_position": "queue/rank{r}/rejected_position",
    "rejected_image": "queue/rank{r}/rejected_image", "rejected_meta": "queue/rank{r}/rejected_meta",
}


def rollout_keys(counts: dict[str, int]) -> dict[str, Any]:
    """The ``rollout/*`` keys of a step that trained B packs: the counts (``counts``: the actor's rollout counters,
    ``learner.step_record.ROLLOUT_COUNTS``, summed over ranks) and P/R/F1 from them.

    P/R/F1 are left out when the packs held no GT and no prediction: ``precision_recall_f1`` calls
    that case perfect (1.0), which is right for one image but would read as a perfect step in a plot.
    A steps get none of these keys (absent, not 0 or 1): readers aggregate the counts over B records.
    """
    out: dict[str, Any] = {
        "rollout/n_pred": int(counts["n_pred"]),
        "rollout/n_gt": int(counts["n_gt"]),
        "rollout/n_matched": int(counts["n_matched"]),
        "rollout/parse_truncated": int(counts["parse_truncated"]),
        "rollout/invalid_rollout": int(counts["invalid_rollout"]),
    }
    if counts["n_pred"] + counts["n_gt"] > 0:
        p, r, f1 = precision_recall_f1(int(counts["n_matched"]), int(counts["n_pred"]), int(counts["n_gt"]))
        out.update({"rollout/precision": p, "rollout/recall": r, "rollout/f1": f1})
    return out


def memory_keys(per_rank: list[RankStats]) -> dict[str, Any]:
    """``mem/*``: each rank's peak memory since its process started (GiB), the max over ranks and the list by rank.

    ``peak_rss_gb`` (host) always; ``peak_allocated_gb`` / ``peak_reserved_gb`` (CUDA allocator) only on a GPU
    learner (absent on CPU, not 0).
    """
    rss = [round(float(r.mem_peak_rss), 3) for r in per_rank]
    out: dict[str, Any] = {"mem/peak_rss_gb": max(rss), "mem/peak_rss_gb_by_rank": rss}
    allocated = [round(float(r.mem_peak_allocated), 3) for r in per_rank]
    if any(allocated):
        out.update({"mem/peak_allocated_gb": max(allocated), "mem/peak_allocated_gb_by_rank": allocated})
    reserved = [round(float(r.mem_peak_reserved), 3) for r in per_rank]
    if any(reserved):
        out.update({"mem/peak_reserved_gb": max(reserved), "mem/peak_reserved_gb_by_rank": reserved})
    return out


#: The record keys that add up to ``time/step`` on a one-rank CPU learner: forward/backward, the parts
#: (:func:`parts_seconds`), the rest.
STEP_TIME_KEYS = ("time/forward_backward", "time/wait_for_packs", "time/wait_for_a_window", "time/sync_stall",
                  "time/optimizer_step", "time/prepare_inputs", "time/other")


def busy_seconds(stats: RankStats) -> float:
    """A rank's forward/backward time of the step: the host's wall time, or the device's when longer.

    On a GPU the wall time covers launching the kernels (the loss read waits for the forward; the backward
    is only launched) and the kernels finish at a later host wait, inside another part or none; the CUDA
    events of ``time_forward_backward_gpu`` time the spans where they run. On CPU that field is 0.
    """
    return max(stats.time_forward_backward, stats.time_forward_backward_gpu)


def parts_seconds(stats: RankStats) -> float:
    """A rank's times of the step's parts besides forward/backward (:func:`busy_seconds`)."""
    return (stats.time_wait_for_packs + stats.time_wait_for_a_window + stats.time_sync_stall
            + stats.time_optimizer_step + stats.time_prepare_inputs)


def other_seconds(stats: RankStats) -> float:
    """A rank's step time that no timed part covers: ``time_step`` − :func:`busy_seconds` − :func:`parts_seconds`.

    Clamped at 0: on a GPU the parts can overlap (the optimizer step's gradient-norm read waits for the
    last backward's kernels, which the device time also counts), so this is a lower bound there.
    """
    return max(0.0, stats.time_step - busy_seconds(stats) - parts_seconds(stats))


def time_keys(per_rank: list[RankStats]) -> dict[str, Any]:
    """``time/*`` and ``learner/busy_fraction`` of a step.

    Times are the max over ranks (the slowest sets the step), ``*_mean`` the mean; ``time/other`` is the max of
    each rank's :func:`other_seconds`. ``time/forward_backward_gpu`` (and ``_mean``) only on a GPU learner:
    absent on CPU, not 0 (as ``mem/peak_allocated_gb``). Busy is :func:`busy_seconds`, the mean over ranks,
    ÷ ``time/step``, at most 1: on CPU the wall time as before, on a GPU the longer of wall and device time.
    """
    n = len(per_rank)
    step_s = max(r.time_step for r in per_rank) or 1e-9
    fb = [r.time_forward_backward for r in per_rank]
    fb_gpu = [r.time_forward_backward_gpu for r in per_rank]
    out: dict[str, Any] = {"time/step": step_s, "time/forward_backward": max(fb),
                           "time/forward_backward_mean": sum(fb) / n}
    if any(fb_gpu):
        out.update({"time/forward_backward_gpu": max(fb_gpu), "time/forward_backward_gpu_mean": sum(fb_gpu) / n})
    out["time/wait_for_packs"] = max(r.time_wait_for_packs for r in per_rank)
    out["time/wait_for_a_window"] = max(r.time_wait_for_a_window for r in per_rank)
    out["time/sync_stall"] = max(r.time_sync_stall for r in per_rank)
    out["time/optimizer_step"] = max(r.time_optimizer_step for r in per_rank)
    out["time/prepare_inputs"] = max(r.time_prepare_inputs for r in per_rank)
    out["time/other"] = max(other_seconds(r) for r in per_rank)
    out["learner/busy_fraction"] = min(1.0, (sum(busy_seconds(r) for r in per_rank) / n) / step_s)
    return out


def metrics_line(step: int, per_rank: list[RankStats], facts: StepFacts) -> dict[str, Any]:
    """The JSONL record of optimizer step ``step`` from every rank's stats and rank 0's facts.

    ``facts`` names its own entries (:meth:`StepFacts.entries`: sync, decision, optimizer, run counters);
    everything after them is made here from the per-rank numbers. ``rollout/*`` keys are present only when
    the step trained B packs (:func:`rollout_keys`).
    """
    n = len(per_rank)
    step_s = max(r.time_step for r in per_rank) or 1e-9
    packs, tokens = sum(r.packs for r in per_rank), sum(r.tokens for r in per_rank)
    segments, lags = sum(r.segments for r in per_rank), [v for r in per_rank for v in r.trained_vers]
    kind_b = any(r.kind_b for r in per_rank)  # every rank trains the decided kind

    def queue_total(name: str) -> float:
        return sum(r.queue[name] for r in per_rank)

    rec: dict[str, Any] = {
        "step": step,
        **facts.entries(),
        "stage2_ab/async/queue_depth": sum(r.queue_depth for r in per_rank) / n,
        "stage2_ab/async/queue_depth_min": min(r.queue_depth for r in per_rank),
        "stage2_ab/async/ver_lag_mean": (sum(r.ver_lag_sum for r in per_rank) / len(lags)) if lags else 0.0,
        "stage2_ab/async/ver_lag_max": max((r.ver_lag_max for r in per_rank), default=0.0) if lags else 0.0,
        "stage2_ab/async/drop_stale_total": queue_total("stale_dropped"),
        "stage2_ab/async/drop_oldest_total": queue_total("oldest_dropped"),
        "stage2_ab/async/drop_duplicate_total": queue_total("duplicate_dropped"),
        "stage2_ab/async/malformed_total": queue_total("malformed"),
        "stage2_ab/async/rejected_total": sum(queue_total(name) for name in REJECTED),
        "stage2_ab/async/trained_pack_vers": [r.trained_vers for r in per_rank],
        "stage2_ab/async/kinds_by_rank": ["B" if r.kind_b else "A" for r in per_rank],
        "stage2_ab/async/ver_current_by_rank": [int(r.ver_current) for r in per_rank],
        "sync/client_calls_by_rank": [int(r.sync_client_calls) for r in per_rank],
        "loss/total": sum(r.loss_total for r in per_rank),
        "loss/ce": sum(r.loss_ce for r in per_rank),
        "loss/bbox_smoothl1": sum(r.loss_bbox_smoothl1 for r in per_rank),
        "loss/bbox_ciou": sum(r.loss_bbox_ciou for r in per_rank),
        "loss/coord_ce": sum(r.loss_coord_ce for r in per_rank),
        **time_keys(per_rank),
        "learner/micro_steps": [int(r.micro_steps) for r in per_rank],
        "learner/forwards": [int(r.forwards) for r in per_rank],
        "learner/backwards": [int(r.backwards) for r in per_rank],
        "learner/max_forwards_per_micro_step": int(max(r.max_forwards_per_micro for r in per_rank)),
        "throughput/tokens_per_s": tokens / step_s,
        "throughput/packs_per_s": packs / step_s,
        "packing/fill": (sum(r.fill_sum for r in per_rank) / packs) if packs else 0.0,
        "packing/segments": int(segments),
        # Samples trained in this step over every rank, by channel (the other one is 0): A packs hold as many as fit.
        "train/samples_a": 0 if kind_b else int(segments),
        "train/samples_b": int(segments) if kind_b else 0,
        "packing/tokens": int(tokens),
        "packing/channel_a_dropped_total": int(sum(r.a_dropped_total for r in per_rank)),
        "packing/window_carry": int(sum(r.a_window_carry for r in per_rank)),
    }
    rec.update(memory_keys(per_rank))
    throughput = facts.run.throughput if facts.run is not None else None
    if throughput is not None:  # learner.throughput: every rank's tokens against every rank's peak
        rec["throughput/mfu"] = mfu(rec["throughput/tokens_per_s"], throughput.lm_params, throughput.peak_tflops)
    if kind_b and packs:
        rec.update(rollout_keys({k: int(sum(r.rollout[k] for r in per_rank)) for k in ROLLOUT_COUNTS}))
    for r, stats in enumerate(per_rank):
        for name in COUNTER_NAMES:
            rec[QUEUE_RANK_KEYS[name].format(r=r)] = int(stats.queue[name])
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


def gather_metrics_line(dist: Any, step: int, record: StepRecord, ga: int) -> dict[str, Any] | None:
    """All-gather every rank's stats (one collective, every rank); rank 0 gets the metrics line, others None."""
    vectors = dist.all_gather(record.stats.vector(ga), f"metrics all_gather at step {step}")
    if not dist.is_main:
        return None
    return metrics_line(step, [RankStats.from_vector(v, ga) for v in vectors], record.facts)
