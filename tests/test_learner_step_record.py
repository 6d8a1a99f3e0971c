"""The learner's typed step records (learner/step_record.py) and the parts cut out of ``Learner``: what crosses
the metrics all_gather, the names a record's facts become, the checkpointed counters, the time budget."""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

from learner.checkpointer import TrainerState, saved_queue_counters
from learner.metrics import QUEUE_RANK_KEYS, metrics_line
from learner.pack_queue import COUNTER_NAMES
from learner.recipe import GROUP_ORDER
from learner.run_counters import REALIZED_WINDOW, RunCounters, Totals
from learner.step_record import (LR_GROUP_KEYS, ROLLOUT_COUNTS, SCALARS, OptimizerOutcome, RankStats, RunFacts,
                                 StepFacts)
from learner.throughput import Throughput
from learner.time_budget import TimeBudget

DOC = (Path(__file__).resolve().parents[1] / "docs/metrics.md").read_text()


def _every_field_set(seed: float) -> RankStats:
    """A RankStats whose every number differs (a field dropped or swapped in the vector would show)."""
    stats = RankStats(**{name: seed + i for i, name in enumerate(SCALARS)})
    stats.rollout = {k: seed + 100 + i for i, k in enumerate(ROLLOUT_COUNTS)}
    stats.queue = {k: seed + 200 + i for i, k in enumerate(COUNTER_NAMES)}
    stats.trained_vers = [7, 8]
    return stats


def test_every_rank_stat_survives_the_all_gather_vector_and_the_length_does_not_depend_on_what_was_trained():
    stats = _every_field_set(1.0)
    for ga in (2, 4):
        back = RankStats.from_vector(stats.vector(ga), ga)
        assert back == stats
        assert len(RankStats().vector(ga)) == len(stats.vector(ga))  # an A step's rank sends as many numbers
    assert set(SCALARS) == {f.name for f in fields(RankStats)} - {"rollout", "queue", "trained_vers"}


def _full_facts() -> StepFacts:
    totals = Totals(steps_a=3, steps_b=2, b_skipped_due_to_queue=1, optimizer_updates=4, forwards=10, nonfinite_skipped=1)
    return StepFacts(
        sync={"time/sync_total": 0.5, "sync/ok": 1, "sync/count": 1},
        policy_wants_b=True, step_kind_b=True, min_eligible=2,
        optimizer=OptimizerOutcome(grad_norm=1.5, skipped=False, lr=1e-4,
                                   lr_by_group={"vision": 1e-5, "merger": 1e-4, "llm": 1e-4}, seconds=0.01),
        run=RunFacts(global_step=5, parallel="ddp", ver_current=3, b_ratio_realized=0.4,
                     b_ratio_realized_cumulative=0.4, sync_counts={"sync/attempts": 2, "sync/successes": 2},
                     totals=totals, throughput=Throughput(1000, 10.0, 2, "measured")),
    )


def test_the_facts_keep_the_order_metrics_jsonl_has_always_had():
    keys = list(_full_facts().entries())
    assert keys == [
        "time/sync_total", "sync/ok", "sync/count",
        "stage2_ab/async/policy_wants_b", "stage2_ab/async/step_kind_b", "stage2_ab/async/b_step_skipped_due_to_queue",
        "stage2_ab/async/min_eligible",
        "train/grad_norm", "train/nonfinite_skipped", "train/lr", "train/lr_vision", "train/lr_merger", "train/lr_llm",
        "global_step", "learner/parallel", "stage2_ab/async/ver_current", "stage2_ab/async/b_ratio_realized",
        "stage2_ab/async/b_ratio_realized_cumulative", "sync/attempts", "sync/successes",
        "learner/steps_a_total", "learner/steps_b_total", "learner/b_skipped_due_to_queue_total",
        "learner/optimizer_updates_total", "learner/forwards_total", "learner/nonfinite_skipped_total",
        "throughput/lm_params_non_embedding", "throughput/peak_tflops", "throughput/peak_source",
    ]


def test_a_skipped_steps_non_finite_gradient_norm_is_written_as_null_and_counted():
    outcome = OptimizerOutcome(grad_norm=math.inf, skipped=True, lr=1e-4, lr_by_group={}, seconds=0.0)
    assert outcome.entries() == {"train/grad_norm": None, "train/nonfinite_skipped": 1, "train/lr": 1e-4}


def test_every_key_a_full_record_holds_is_documented_in_docs_metrics():
    """Without a run: every key a fully populated two-rank B-step record holds (per-rank keys as rank{r})."""
    per_rank = [_every_field_set(1.0), _every_field_set(2.0)]
    rec = metrics_line(4, per_rank, _full_facts())
    assert "rollout/f1" in rec and "mem/peak_allocated_gb" in rec and "throughput/mfu" in rec
    emitted = {re.sub(r"rank\d+", "rank{r}", k) for k in rec} - {"step"}
    emitted -= {"time/sync_total", "sync/ok", "sync/count", "sync/attempts", "sync/successes"}  # the test's sync entries
    undocumented = sorted(k for k in emitted if f"`{k}`" not in DOC)
    assert not undocumented, f"add these keys to docs/metrics.md: {undocumented}"
    assert rec["queue/rank1/received"] == int(per_rank[1].queue["received"])


def test_the_written_out_names_cover_every_queue_counter_and_parameter_group():
    assert tuple(QUEUE_RANK_KEYS) == COUNTER_NAMES
    assert all(key == f"queue/rank{{r}}/{name}" for name, key in QUEUE_RANK_KEYS.items())
    assert set(LR_GROUP_KEYS) == set(GROUP_ORDER)
    assert all(key == f"train/lr_{name}" for name, key in LR_GROUP_KEYS.items())


def test_the_trainer_state_keeps_its_json_layout_and_the_counters_come_back_on_resume():
    counters = RunCounters()
    for kind_b, skipped in [(False, False), (True, False), (False, True)] * 40:  # more than the realized window
        counters.count_step(kind_b=kind_b, skipped=skipped)
    state = TrainerState(run_id="r", global_step=120, ver=3, totals=counters.totals.state(),
                         sync_counts={"sync/attempts": 1}, recent_kinds_b=list(counters.recent_kinds),
                         realized_total_steps=counters.realized.total_steps, realized_total_b=counters.realized.total_b)
    text = json.dumps(state.to_json())
    assert list(json.loads(text)) == ["run_id", "global_step", "ver", "totals", "sync_counts", "recent_kinds_b",
                                      "realized_total_steps", "realized_total_b"]
    back = TrainerState.from_json({**json.loads(text), "world_size": 1, "parallel": "ddp", "model_path": "m"})
    assert back == state
    resumed = RunCounters()
    resumed.restore(back.totals, back.recent_kinds_b, back.realized_total_steps, back.realized_total_b)
    assert resumed.totals == counters.totals == Totals(steps_a=80, steps_b=40, optimizer_updates=80, nonfinite_skipped=40)
    assert len(resumed.recent_kinds) == REALIZED_WINDOW
    assert (resumed.realized.value, resumed.realized.cumulative) == (counters.realized.value, counters.realized.cumulative)


def test_a_checkpoint_keeps_no_waiting_packs_in_the_queue_counters():
    counters = {**dict.fromkeys(COUNTER_NAMES, 0), "received": 10, "trained": 6, "reserved": 1, "in_queue": 3}
    saved = saved_queue_counters(counters)
    assert saved["received"] == 6 and "in_queue" not in saved and "reserved" not in saved
    assert counters["received"] == 10  # the live queue's snapshot is left as it was


def test_the_time_budget_charges_no_start_up_step_and_rank_zero_decides():
    broadcasts = []

    def broadcast(values, what):
        broadcasts.append(what)
        return values

    budget = TimeBudget(5.0, SimpleNamespace(broadcast=broadcast))
    budget.add(100.0)  # the process's first step: start-up
    budget.check(1)
    assert budget.train_seconds == 0.0 and not budget.out_of_time
    budget.add(5.0)
    budget.check(2)
    assert budget.out_of_time and broadcasts == ["time-budget broadcast at step 1", "time-budget broadcast at step 2"]
    no_budget = TimeBudget(None, SimpleNamespace(broadcast=broadcast))
    no_budget.add(1.0)
    no_budget.check(1)
    assert not no_budget.out_of_time and len(broadcasts) == 2  # no collective without a budget
