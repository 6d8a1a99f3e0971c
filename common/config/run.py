"""A run's bookkeeping keys of the ``training`` section: checkpoint retention, the best checkpoint, trackers.

Split from ``common/config/schema.py``: :class:`TrainingRunKeys` is a base of its ``TrainingConfig`` (so the
keys are ``training.save_total_limit``, ``training.keep_best``, ``training.report_to``), and
:func:`check_run_rules` their cross-field rules, called by :func:`common.config.load._check_rules` with its
problem list; each problem names the dotted key, the value and the fix.

What this module does not know: how retention runs (``common/runs/retention.py``) or how trackers write
(``learner/trackers.py``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

from common.config.fields import doc
from common.runs.retention import metric_key


@dataclass
class TrainingRunKeys:
    """Checkpoint retention and trackers (the base of ``TrainingConfig``: its keys are ``training.*``)."""

    save_total_limit: int | None = doc(
        "Keep the newest N checkpoints of this run (checkpoints/<step>) and delete older ones, never the best "
        "(keep_best), the final one, one whose evaluation is still due, or the one this process resumed from. "
        "Rank 0 deletes, after every rank finished writing the new one (common/runs/retention.py; docs/runbook.md, "
        "Retention). None = keep all.", None)
    keep_best: str | None = doc(
        "Also keep the checkpoint whose evaluation scored best on this eval record key (eval/f1 = F1@0.5, "
        "eval/map, eval/map_50, eval/map_per_class, eval/lvis_map, eval/recall, ...; eval/parse_failure_rate and "
        "eval/truncated_rate: lower is better); summary.json names it (best_checkpoint). An evaluation counts "
        "for the checkpoint of its step, so eval_every_steps must be a multiple of save_every_steps. Needs "
        "data.val_jsonl; without save_total_limit nothing is deleted and the summary still names the best. "
        "None = no best checkpoint.", None)
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = doc(
        "Trackers that get every numeric metric of metrics.jsonl at its step (rank 0; metrics.jsonl is always "
        "written): tensorboard (output_dir/tensorboard), wandb (output_dir/wandb; WANDB_MODE=offline works "
        "without network), mlflow (MLFLOW_TRACKING_URI, else a file store at output_dir/mlruns). Each package is "
        "imported only when listed; a listed one that is not installed is refused at start (pip install -e "
        "'.[trackers]'). docs/metrics.md, Trackers.", factory=list)

#: ``training.report_to`` entry -> (the module it needs, the package that provides it).
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "mlflow": ("mlflow", "mlflow-skinny")}


def check_run_rules(cfg: Any, problems: Any) -> None:
    """Append the problems of ``training.save_total_limit``, ``training.keep_best`` and ``training.report_to``."""
    t = cfg.training
    if isinstance(t.save_total_limit, int) and t.save_total_limit < 1:
        problems.add("training.save_total_limit", t.save_total_limit, "must be ≥ 1 (the newest checkpoint is "
                     "always kept)", "use null to keep every checkpoint, or e.g. 3")
    if isinstance(t.keep_best, str):
        try:
            metric_key(t.keep_best)
        except ValueError as exc:
            problems.add("training.keep_best", t.keep_best, str(exc), "e.g. keep_best: eval/f1")
        if not cfg.data.val_jsonl:
            problems.add("training.keep_best", t.keep_best, "no evaluation runs without data.val_jsonl, so no "
                         "checkpoint is ever scored", "set data.val_jsonl, or remove training.keep_best")
        if isinstance(t.eval_every_steps, int) and t.eval_every_steps == 0:
            problems.add("training.keep_best", t.keep_best, "training.eval_every_steps is 0: only the start and "
                         "the final weights are evaluated, so the best is always the final checkpoint",
                         "set training.eval_every_steps to a multiple of training.save_every_steps")
        elif (isinstance(t.eval_every_steps, int) and isinstance(t.save_every_steps, int) and t.save_every_steps > 0
              and t.eval_every_steps % t.save_every_steps):
            problems.add("training.eval_every_steps", t.eval_every_steps, f"not a multiple of "
                         f"training.save_every_steps = {t.save_every_steps}: an evaluation counts for the checkpoint "
                         "of its step (training.keep_best), and most would have none",
                         f"set it to a multiple of {t.save_every_steps}, e.g. {t.save_every_steps}")
    names = t.report_to if isinstance(t.report_to, list) else []
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.add("training.report_to", names, f"lists {name} twice", "list each tracker once")
    for name in dict.fromkeys(names):
        if name in TRACKER_PACKAGES and importlib.util.find_spec(TRACKER_PACKAGES[name][0]) is None:
            package = TRACKER_PACKAGES[name][1]
            problems.add("training.report_to", names, f"lists {name} but the {package} package is not installed",
                         f"pip install {package} (all three: pip install -e '.[trackers]'), or remove {name}")
