"""What one optimizer step leaves on one rank, typed: the numbers every rank measures and rank 0's facts.

A loop (``learner/train.py``'s ``async_step``, ``learner/modes.py``) opens one :class:`StepRecord` per
optimizer step and hands it to the step's pieces (``learner/rank.py``); each piece adds what it measured::

    StepRecord ─┬─ stats: RankStats   this rank's own numbers: times, counts, losses, queue counters, memory
                │    └─ vector() ─► all_gather (learner/metrics.py) ─► RankStats.from_vector on rank 0
                └─ facts: StepFacts   rank 0's values (the same on every rank, or rank 0's): the sync outcome,
                     │                the A/B decision, the optimizer's outcome, the run's counters after the step
                     └─ entries() on rank 0
    rank 0: metrics_line(step, every rank's RankStats, StepFacts) ─► one line of metrics.jsonl

Why typed records and not two dicts: a misspelt key was a silent new metric (or a silent 0); here it is an
AttributeError. Every metric name a fact becomes is written out once, in the ``entries()`` of the record that
holds it, so grepping a metric finds its producer; the per-rank numbers are named in learner/metrics.py.

What this module does not know: how a value is measured, collectives, or how ranks are aggregated
(learner/metrics.py does that).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Any

from learner.pack_queue import COUNTER_NAMES
from learner.run_counters import Totals
from learner.throughput import Throughput

#: The actor's per-segment rollout counters a trained B pack carries (summed by :meth:`RankStats.add_pack_meta`).
ROLLOUT_COUNTS = ("n_pred", "n_gt", "n_matched", "parse_truncated", "invalid_rollout")


@dataclass
class RankStats:
    """This rank's numbers for one optimizer step: what every rank sends in the step's one all_gather.

    Every number is a float (the all_gather's dtype); counts are whole. ``time_*`` are seconds of this rank's
    host clock, ``mem_peak_*`` GiB since the process started, ``queue`` the ready queue's cumulative counters.
    """

    kind_b: float = 0.0  # 1.0 on a Channel-B step
    micro_steps: float = 0.0
    forwards: float = 0.0  # counted by the model's forward hook, not assumed
    backwards: float = 0.0  # counted by a hook on the loss
    max_forwards_per_micro: float = 0.0
    packs: float = 0.0
    segments: float = 0.0
    tokens: float = 0.0
    time_forward_backward: float = 0.0
    time_wait_for_packs: float = 0.0
    time_wait_for_a_window: float = 0.0
    time_step: float = 0.0
    time_sync_stall: float = 0.0
    time_optimizer_step: float = 0.0
    time_prepare_inputs: float = 0.0
    time_forward_backward_gpu: float = 0.0  # 0 on a CPU learner
    loss_total: float = 0.0
    loss_ce: float = 0.0
    loss_bbox_smoothl1: float = 0.0
    loss_bbox_ciou: float = 0.0
    loss_coord_ce: float = 0.0
    ver_lag_sum: float = 0.0  # over the trained B packs: ver_current − the pack's ver
    ver_lag_max: float = 0.0
    queue_depth: float = 0.0  # eligible packs at the decision
    fill_sum: float = 0.0  # Σ tokens / packing_length over the step's packs
    ver_current: float = 0.0
    sync_client_calls: float = 0.0
    a_dropped_total: float = 0.0
    a_window_carry: float = 0.0
    mem_peak_rss: float = 0.0
    mem_peak_allocated: float = 0.0  # 0 on a CPU learner
    mem_peak_reserved: float = 0.0
    rollout: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ROLLOUT_COUNTS, 0.0))
    queue: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTER_NAMES, 0.0))
    trained_vers: list[int] = field(default_factory=list)  # the ver of each trained B pack (at most GA)

    def add_pack_meta(self, segment_meta: list[dict[str, Any]]) -> None:
        """Sum the actor's per-segment rollout counters of a trained B pack."""
        for m in segment_meta:
            inner = m.get("meta", {})
            for key in ROLLOUT_COUNTS:
                value = inner.get(key, 0)
                if isinstance(value, (int, float)):
                    self.rollout[key] += value

    def add_losses(self, terms: Any, scale: float) -> None:
        """Add one pack's ``learner.loss.LossTerms`` (the logged values, × ``scale``)."""
        self.loss_total += terms.total * scale
        self.loss_ce += terms.ce * scale
        self.loss_bbox_smoothl1 += terms.bbox_smoothl1 * scale
        self.loss_bbox_ciou += terms.bbox_ciou * scale
        self.loss_coord_ce += terms.coord_ce * scale

    def add_ver_lag(self, ver_current: int, pack_ver: int) -> None:
        """A trained B pack: its ver and how far it lags the ver this step trains at."""
        lag = ver_current - pack_ver
        self.ver_lag_sum += lag
        self.ver_lag_max = max(self.ver_lag_max, lag)
        self.trained_vers.append(pack_ver)

    def vector(self, ga: int) -> list[float]:
        """The all_gather payload: the scalars in field order, the rollout and queue counters in their names'
        order, then the trained pack vers padded to ``ga`` with -1 (the same length on every rank)."""
        vers = (self.trained_vers + [-1] * ga)[:ga]
        return ([float(getattr(self, f)) for f in SCALARS] + [float(self.rollout[k]) for k in ROLLOUT_COUNTS]
                + [float(self.queue[k]) for k in COUNTER_NAMES] + [float(v) for v in vers])

    @classmethod
    def from_vector(cls, vector: list[float], ga: int) -> RankStats:
        """The inverse of :meth:`vector`."""
        n, r = len(SCALARS), len(ROLLOUT_COUNTS)
        q = n + r + len(COUNTER_NAMES)
        stats = cls(**dict(zip(SCALARS, vector[:n])))
        stats.rollout = dict(zip(ROLLOUT_COUNTS, vector[n:n + r]))
        stats.queue = dict(zip(COUNTER_NAMES, vector[n + r:q]))
        stats.trained_vers = [int(v) for v in vector[q:q + ga] if v >= 0]
        return stats


#: The scalar fields of :class:`RankStats`, in vector order.
SCALARS = tuple(f.name for f in fields(RankStats) if f.name not in ("rollout", "queue", "trained_vers"))

#: ``train/lr_<group>`` for each AdamW parameter group ``training.lr_groups`` can make (learner/recipe.py).
LR_GROUP_KEYS = {"vision": "train/lr_vision", "merger": "train/lr_merger", "llm": "train/lr_llm",
                 "rest": "train/lr_rest"}


@dataclass(frozen=True)
class OptimizerOutcome:
    """What the step's optimizer update did (learner/optimizer_step.py); the same on every rank."""

    grad_norm: float  # pre-clip; NaN or inf when the step was skipped for it
    skipped: bool  # a non-finite loss or gradient norm: no update, gradients dropped
    lr: float  # the first parameter group's, after the scheduler stepped
    lr_by_group: dict[str, float]  # {group name: lr} with several groups (training.lr_groups), else empty
    seconds: float  # the clip + step + zero on the host (time/optimizer_step)

    def entries(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "train/grad_norm": self.grad_norm if math.isfinite(self.grad_norm) else None,
            "train/nonfinite_skipped": int(self.skipped),
            "train/lr": self.lr,
        }
        for group, lr in self.lr_by_group.items():
            out[LR_GROUP_KEYS[group]] = lr
        return out


@dataclass(frozen=True)
class RunFacts:
    """The run's state after the step (learner/rank.py ``finish_step``): counters that continue across a resume."""

    global_step: int  # optimizer steps done, this one included
    parallel: str  # learner.parallel: ddp or fsdp
    ver_current: int
    b_ratio_realized: float  # over the last REALIZED_WINDOW steps (learner/run_counters.py)
    b_ratio_realized_cumulative: float
    sync_counts: dict[str, int]  # learner/weight_sync's cumulative sync/* counts, named there
    totals: Totals
    throughput: Throughput | None  # rank 0's MFU inputs (None on the other ranks)

    def entries(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "global_step": self.global_step,
            "learner/parallel": self.parallel,
            "stage2_ab/async/ver_current": self.ver_current,
            "stage2_ab/async/b_ratio_realized": self.b_ratio_realized,
            "stage2_ab/async/b_ratio_realized_cumulative": self.b_ratio_realized_cumulative,
        }
        out.update(self.sync_counts)
        out.update(self.totals.entries())
        if self.throughput is not None:
            out.update(self.throughput.entries())
        return out


@dataclass
class StepFacts:
    """Rank 0's values of one step, each written into the record under the name :meth:`entries` gives it.

    Filled in step order: ``sync`` by the boundary (``Learner.maybe_sync``), the decision by the loop,
    ``optimizer`` and ``run`` by ``Learner.finish_step``.
    """

    sync: dict[str, Any] = field(default_factory=dict)  # learner/weight_sync's sync/* and time/sync_* entries
    policy_wants_b: bool = False  # the schedule asked for B
    step_kind_b: bool = False  # and the step trained B
    b_step_skipped_due_to_queue: bool = False  # the schedule asked for B, a rank had too few packs: an A step
    min_eligible: int | None = None  # the async mode's decision: the fewest eligible packs of any rank
    mode: str | None = None  # the one-process modes only: learner/mode (step | micro)
    optimizer: OptimizerOutcome | None = None
    run: RunFacts | None = None

    def entries(self) -> dict[str, Any]:
        """The record's rank-0 entries, in the order metrics.jsonl has always had them."""
        out: dict[str, Any] = dict(self.sync)
        out["stage2_ab/async/policy_wants_b"] = int(self.policy_wants_b)
        out["stage2_ab/async/step_kind_b"] = int(self.step_kind_b)
        out["stage2_ab/async/b_step_skipped_due_to_queue"] = int(self.b_step_skipped_due_to_queue)
        if self.min_eligible is not None:
            out["stage2_ab/async/min_eligible"] = self.min_eligible
        if self.mode is not None:
            out["learner/mode"] = self.mode
        if self.optimizer is not None:
            out.update(self.optimizer.entries())
        if self.run is not None:
            out.update(self.run.entries())
        return out


@dataclass
class StepRecord:
    """One optimizer step in the making on this rank: opened by the loop, closed by ``Learner.finish_step``."""

    started: float = field(default_factory=time.monotonic)  # time/step counts from here
    stats: RankStats = field(default_factory=RankStats)
    facts: StepFacts = field(default_factory=StepFacts)
