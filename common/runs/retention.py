"""Checkpoint retention and the best checkpoint: which ``checkpoints/<step>`` directories a run keeps.

The rule (``training.save_total_limit: N``, ``training.keep_best: eval/<metric>``), applied by rank 0
after every checkpoint has been written by all ranks and renamed into place, and once more after the
final evaluation::

    this run's checkpoints (trainer_state.json run_id == run_info.json's)      e.g. 2 4 6 8 10
      kept: the newest N                                             N = 2 ─►        8 10
            the best: the best eval/<metric> among evaluations whose step has a checkpoint
            one not evaluated yet: at an evaluation step (step % eval_every_steps == 0) with no
                evaluation recorded at or after it (its evaluation runs on a thread and lands later)
            the final one (written after the last step) and the one this process resumed from
      deleted: the rest, each renamed to ``.deleting-<step>`` first, then removed

Example: save every 2 steps, evaluate every 2, N = 2, best f1 at step 4 ⇒ after step 10 the run holds
4, 8 and 10. Nothing else is ever deleted: checkpoints another run left in the directory, ``.tmp-*``
directories and files are not this rule's. A deleted checkpoint is renamed before it is removed, so a
crash mid-delete leaves a dot-directory that ``auto`` resume ignores, never a torn ``<step>``.

Why recompute from disk each time (checkpoint directories + ``metrics.jsonl``'s eval records) rather
than keep state: a resumed run applies the same rule with nothing carried over, and the summary
(``launcher/summary.py``) names the same best checkpoint from the same two sources.

What this module does not know: torch, ranks (the caller is rank 0), or how an evaluation is made.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.runs.checkpoints import checkpoint_run_id, run_id_of, step_checkpoints

log = logging.getLogger(__name__)

#: ``training.keep_best`` values: the eval record key and whether higher ("max") or lower ("min") is better.
METRIC_DIRECTIONS = {
    "eval/f1": "max",  # matcher F1 at IoU 0.5 (common/evaluation/metrics.py)
    "eval/precision": "max",
    "eval/recall": "max",
    "eval/map": "max",  # COCO mAP@[.5:.95], class-agnostic
    "eval/map_50": "max",
    "eval/map_per_class": "max",  # COCO mAP@[.5:.95] over the eval set's categories (descs)
    "eval/map_50_per_class": "max",
    "eval/lvis_map": "max",  # LVIS federated AP@[.5:.95] (common/evaluation/lvis.py)
    "eval/mean_matched_iou": "max",
    "eval/parse_failure_rate": "min",
    "eval/truncated_rate": "min",
}
#: Names users write for a metric that the eval record spells otherwise.
ALIASES = {"eval/f1@0.5": "eval/f1", "eval/map50": "eval/map_50", "eval/ap": "eval/map", "eval/ap50": "eval/map_50"}


def metric_key(keep_best: str) -> str:
    """The eval record key ``training.keep_best`` names (aliases resolved); ValueError naming the choices."""
    key = ALIASES.get(keep_best, keep_best)
    if key not in METRIC_DIRECTIONS:
        raise ValueError(f"not an evaluation metric; use one of {', '.join(METRIC_DIRECTIONS)} "
                         f"(eval/f1 is F1@0.5, eval/map COCO mAP@[.5:.95])")
    return key


@dataclass(frozen=True)
class Best:
    """The best checkpoint: its step, the metric and the value its evaluation scored."""

    step: int
    metric: str
    value: float
    path: str

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "metric": self.metric, "value": self.value, "path": self.path}


def read_eval_records(output_dir: str | Path) -> list[dict[str, Any]]:
    """The ``"record": "eval"`` lines of ``{output_dir}/metrics.jsonl`` written by the directory's run (a line
    of another run id is not this run's evaluation; a torn last line is skipped)."""
    path = Path(output_dir) / "metrics.jsonl"
    run_id = run_id_of(output_dir)
    out = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if (isinstance(rec, dict) and rec.get("record") == "eval" and isinstance(rec.get("step"), int)
                    and rec.get("run_id", run_id) == run_id):
                out.append(rec)
    return out


def best_step(evals: Iterable[dict[str, Any]], steps: Iterable[int], metric: str) -> tuple[int, float] | None:
    """(step, value) of the best evaluation of ``metric`` among those whose step is in ``steps``; ties: the later."""
    better = max if METRIC_DIRECTIONS[metric] == "max" else min
    have = set(steps)
    scored = [(r["step"], float(r[metric])) for r in evals
              if r["step"] in have and isinstance(r.get(metric), (int, float)) and not isinstance(r.get(metric), bool)]
    if not scored:
        return None
    value = better(v for _, v in scored)
    return max(s for s, v in scored if v == value), value


def own_checkpoints(output_dir: str | Path) -> dict[int, Path]:
    """{step: directory} of the finished checkpoints of ``output_dir``'s own run (common/runs/checkpoints.py)."""
    run_id = run_id_of(output_dir)
    return {int(p.name): p for p in step_checkpoints(output_dir) if checkpoint_run_id(p) == run_id}


def find_best(output_dir: str | Path, keep_best: str) -> Best | None:
    """The best checkpoint of the run in ``output_dir`` by ``keep_best`` (None before any evaluated checkpoint)."""
    metric = metric_key(keep_best)
    ckpts = own_checkpoints(output_dir)
    found = best_step(read_eval_records(output_dir), ckpts, metric)
    if found is None:
        return None
    return Best(found[0], metric, found[1], str(ckpts[found[0]]))


def plan(steps: Iterable[int], evals: list[dict[str, Any]], *, limit: int | None, metric: str | None,
         eval_every_steps: int, protect: Iterable[int] = ()) -> tuple[list[int], list[int]]:
    """(kept, deleted) steps under the module's rule; ``protect``: the final and the resumed-from steps."""
    steps = sorted(steps)
    if limit is None:
        return steps, []
    keep = set(steps[-limit:]) | set(protect)
    if metric is not None:
        found = best_step(evals, steps, metric)
        if found is not None:
            keep.add(found[0])
        last_eval = max((r["step"] for r in evals), default=-1)
        if eval_every_steps > 0:  # its evaluation may still be running: it could become the best
            keep |= {s for s in steps if s > last_eval and s % eval_every_steps == 0}
    return [s for s in steps if s in keep], [s for s in steps if s not in keep]


def apply(output_dir: str | Path, *, limit: int | None, keep_best: str | None, eval_every_steps: int,
          protect: Iterable[int] = ()) -> list[int]:
    """Delete the checkpoints :func:`plan` drops (rank 0 only, after a save completed); returns their steps."""
    if limit is None:
        return []
    ckpts = own_checkpoints(output_dir)
    metric = metric_key(keep_best) if keep_best else None
    evals = read_eval_records(output_dir) if metric else []
    _, drop = plan(ckpts, evals, limit=limit, metric=metric, eval_every_steps=eval_every_steps, protect=protect)
    deleted = []
    for left in Path(output_dir, "checkpoints").glob(".deleting-*"):  # a crash mid-delete left it: finish the job
        shutil.rmtree(left, ignore_errors=True)
    for step in drop:
        path = ckpts[step]
        doomed = path.with_name(f".deleting-{step}")
        try:
            path.rename(doomed)  # atomic: from here on no reader takes it for a finished checkpoint
            shutil.rmtree(doomed)
            deleted.append(step)
        except OSError as exc:  # a read-only or failing disk must not end the run: logged, tried again next save
            log.warning("checkpoint retention: could not delete %s (%s)", path, exc)
    if deleted:
        log.info("checkpoint retention (save_total_limit %d%s): deleted step(s) %s", limit,
                 f", keep_best {metric}" if metric else "", ", ".join(map(str, deleted)))
    return deleted


def apply_after_save(training: Any, output_dir: str | Path, step: int, *, final: bool,
                     resumed_from: Path | None) -> list[int]:
    """:func:`apply` with ``training``'s keys (``training.save_total_limit``, ``keep_best``, ``eval_every_steps``),
    protecting checkpoint ``step`` when it is the run's ``final`` one and the checkpoint this process resumed from
    (a restarted actor reads its B ledger: actor/loop.py). Rank 0 calls it, after the save's last barrier."""
    protect = [step] if final else []
    if (resumed_from is not None and resumed_from.name.isdigit()
            and resumed_from.parent.resolve() == (Path(output_dir) / "checkpoints").resolve()):
        protect.append(int(resumed_from.name))
    return apply(output_dir, limit=training.save_total_limit, keep_best=training.keep_best,
                 eval_every_steps=training.eval_every_steps, protect=protect)
