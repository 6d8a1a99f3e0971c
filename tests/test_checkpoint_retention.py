"""Checkpoint retention (common/runs/retention.py) on real run directories: the newest N, the best, the final one,
one whose evaluation is still due; the config rules; the best checkpoint in summary.json.

The run directories here are laid out as the learner lays them out (run_info.json, checkpoints/<step>/
trainer_state.json with the run id, metrics.jsonl with eval records); a real learner run that deletes
is tests/test_run_bookkeeping.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.runs import retention
from common.config.load import ConfigError, load_config
from launcher.summary import print_summary

RUN_ID = "run-a"


def make_run(tmp_path: Path, steps: list[int], evals: dict[int, float], *, keep_best: str | None = None,
             other_run: list[int] = ()) -> Path:
    """A run directory with checkpoints at ``steps``, eval records {step: f1}, and checkpoints of another run."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "run_info.json").write_text(json.dumps({"run_id": RUN_ID}))
    for s in steps:
        _checkpoint(run, s, RUN_ID)
    for s in other_run:
        _checkpoint(run, s, "run-old")
    recs = [{"step": s, "loss/total": 1.0} for s in range(max(steps, default=0))]
    recs += [{"record": "eval", "step": s, "eval/f1": f1, "eval/parse_failure_rate": 1 - f1} for s, f1 in evals.items()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "run_config.yaml").write_text(f"data: {{val_jsonl: v.jsonl}}\ntraining: {{keep_best: {keep_best or 'null'}}}\n")
    return run


def _checkpoint(run: Path, step: int, run_id: str) -> None:
    d = run / "checkpoints" / str(step)
    (d / "model").mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"run_id": run_id, "global_step": step, "ver": step}))


def on_disk(run: Path) -> list[str]:
    return sorted((p.name for p in (run / "checkpoints").iterdir()), key=lambda n: (not n.isdigit(), n.zfill(9)))


def test_retention_keeps_the_newest_n_and_the_best_and_deletes_the_rest(tmp_path):
    run = make_run(tmp_path, [2, 4, 6, 8, 10], {0: 0.1, 2: 0.3, 4: 0.9, 6: 0.2, 8: 0.4, 10: 0.5})
    deleted = retention.apply(run, limit=2, keep_best="eval/f1", eval_every_steps=2)
    assert deleted == [2, 6]
    assert on_disk(run) == ["4", "8", "10"]  # 4 is the best, 8 and 10 the newest; no .deleting-* left


def test_the_final_checkpoint_is_never_deleted_even_past_the_limit(tmp_path):
    run = make_run(tmp_path, [1, 2, 3, 4], {})
    retention.apply(run, limit=1, keep_best=None, eval_every_steps=0, protect=[3])
    assert on_disk(run) == ["3", "4"]


def test_a_lower_is_better_metric_keeps_the_lowest(tmp_path):
    run = make_run(tmp_path, [2, 4, 6], {2: 0.5, 4: 0.2, 6: 0.3})  # parse_failure_rate 0.5, 0.8, 0.7
    retention.apply(run, limit=1, keep_best="eval/parse_failure_rate", eval_every_steps=2)
    assert on_disk(run) == ["2", "6"]


def test_a_checkpoint_whose_evaluation_is_still_running_is_kept_until_it_lands(tmp_path):
    # evaluations landed up to step 4; 6 and 8 are due (eval every 2) and may yet be the best
    run = make_run(tmp_path, [2, 4, 6, 8, 10], {2: 0.1, 4: 0.2})
    retention.apply(run, limit=1, keep_best="eval/f1", eval_every_steps=2)
    assert on_disk(run) == ["4", "6", "8", "10"]
    with (run / "metrics.jsonl").open("a") as f:  # they land, worse than 4
        f.write("".join(json.dumps({"record": "eval", "step": s, "eval/f1": 0.05}) + "\n" for s in (6, 8, 10)))
    retention.apply(run, limit=1, keep_best="eval/f1", eval_every_steps=2)
    assert on_disk(run) == ["4", "10"]


def test_checkpoints_of_another_run_and_unfinished_ones_are_not_the_rules(tmp_path):
    run = make_run(tmp_path, [3, 4], {}, other_run=[1, 2])
    (run / "checkpoints" / ".tmp-5").mkdir()
    retention.apply(run, limit=1, keep_best=None, eval_every_steps=0)
    assert on_disk(run) == ["1", "2", "4", ".tmp-5"]


def test_an_evaluation_line_of_another_run_never_picks_the_best(tmp_path):
    run = make_run(tmp_path, [2, 4, 6], {2: 0.3, 4: 0.1})
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"record": "eval", "step": 4, "eval/f1": 0.99, "run_id": "run-old"}) + "\n")
    assert retention.find_best(run, "eval/f1").step == 2


def test_without_a_limit_nothing_is_deleted(tmp_path):
    run = make_run(tmp_path, [1, 2, 3], {1: 0.9})
    assert retention.apply(run, limit=None, keep_best="eval/f1", eval_every_steps=1) == []
    assert on_disk(run) == ["1", "2", "3"]


def test_the_summary_names_the_best_checkpoint_still_on_disk_with_its_value(tmp_path, capsys):
    run = make_run(tmp_path, [2, 4, 6], {0: 0.95, 2: 0.3, 4: 0.7, 6: 0.6}, keep_best="eval/f1@0.5")
    s = print_summary(run)
    # step 0 scored best but has no checkpoint: the best checkpoint is 4
    assert s["best_checkpoint"] == {"step": 4, "metric": "eval/f1", "value": 0.7,
                                    "path": str(run / "checkpoints" / "4")}
    assert json.loads((run / "summary.json").read_text())["best_checkpoint"]["step"] == 4
    assert "best checkpoint        step 4 (eval/f1 0.700, the best of those kept)" in capsys.readouterr().out


def _cfg(tmp_path: Path, **training) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps({
        "model": {"path": "m"}, "data": {"train_jsonl": "t.jsonl"}, "stage2_ab": {"schedule": {"b_ratio": 0.5}},
        "training": training}))
    return path


@pytest.mark.parametrize("training, key, words", [
    ({"save_total_limit": 0}, "training.save_total_limit", "must be ≥ 1"),
    ({"keep_best": "eval/f2"}, "training.keep_best", "eval/f1 is F1@0.5"),
    ({"keep_best": "eval/f1", "eval_every_steps": 2}, "training.keep_best", "data.val_jsonl"),
    ({"keep_best": "eval/f1"}, "training.keep_best", "eval_every_steps is 0"),
    ({"keep_best": "eval/f1", "save_every_steps": 4, "eval_every_steps": 6}, "training.eval_every_steps",
     "not a multiple of training.save_every_steps = 4"),
    ({"report_to": ["tensorboard", "tensorboard"]}, "training.report_to", "lists tensorboard twice"),
    ({"tensorboard": True}, "training.tensorboard", "training.report_to: [tensorboard]"),
])
def test_bad_retention_and_tracker_settings_are_refused_naming_the_key_and_the_fix(tmp_path, training, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(_cfg(tmp_path, **training))
    assert any(p.startswith(f"{key} = ") and words in p and "Fix:" in p for p in err.value.problems), err.value.problems
