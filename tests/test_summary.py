"""The run summary (`launcher/summary.py`): what `make demo` prints and `summary.json` keeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.summary import K, format_summary, print_summary

STEPS = 4


def _run_dir(tmp_path: Path, vers: list[int], adopted: list[int]) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": i, K + "ver_current": v, "sync/count": c, K + "step_kind_b": i % 2, "loss/total": 1.0 / (i + 1)}
            for i, (v, c) in enumerate(zip(vers, adopted))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


def _checkpoint(run: Path, step: int, ver: int, successes: int, text: str | None = None) -> None:
    d = run / "checkpoints" / str(step)
    d.mkdir(parents=True)
    state = {"global_step": step, "ver": ver, "sync_counts": {"sync/successes": successes, "sync/failures": 0}}
    (d / "trainer_state.json").write_text(text if text is not None else json.dumps(state))


def test_final_ver_and_syncs_include_the_push_the_final_checkpoint_settled(tmp_path, capsys):
    # Overlap mode: the last record says ver 3, then the final checkpoint waited for the push in flight
    # and saved ver 4, the server's. The summary must report what the server holds.
    run = _run_dir(tmp_path, vers=[1, 2, 2, 3], adopted=[1, 1, 0, 1])
    _checkpoint(run, STEPS, ver=4, successes=4)
    s = print_summary(run)
    assert (s["ver_final"], s["syncs"], s["steps"], s["steps_b"]) == (4, 4, STEPS, 2)
    assert json.loads((run / "summary.json").read_text())["ver_final"] == 4
    assert "final ver              4  (syncs: 4)" in capsys.readouterr().out


def test_without_a_final_checkpoint_the_last_record_and_the_adoptions_count(tmp_path):
    run = _run_dir(tmp_path, vers=[1, 2, 2, 3], adopted=[1, 1, 0, 1])
    _checkpoint(run, 2, ver=2, successes=2)  # an earlier checkpoint is not the end of the run
    s = print_summary(run)
    assert (s["ver_final"], s["syncs"]) == (3, 3)


def test_a_torn_final_trainer_state_falls_back_to_the_records(tmp_path):
    run = _run_dir(tmp_path, vers=[1, 2, 2, 3], adopted=[1, 1, 0, 1])
    _checkpoint(run, STEPS, ver=4, successes=4, text='{"global_step": 4, "ver": ')
    s = print_summary(run)
    assert (s["ver_final"], s["syncs"]) == (3, 3)


def test_no_records_says_where_to_look(tmp_path, capsys):
    run = tmp_path / "empty"
    run.mkdir()
    assert print_summary(run) == {"steps": 0}
    assert f"no optimizer steps recorded (see {run / 'logs'})" in capsys.readouterr().out


def test_sync_stall_per_sync_and_its_share_of_training_time_blocking_and_overlap(tmp_path):
    from launcher.summary import summarize

    # blocking: sync steps carry time/sync_total; the first (group set-up) is left out of the median
    recs = [{"step": 0, "time/step": 3.0, "time/sync_stall": 2.0, "time/sync_total": 2.0},
            {"step": 1, "time/step": 1.0, "time/sync_stall": 0.0},
            {"step": 2, "time/step": 1.5, "time/sync_stall": 0.5, "time/sync_total": 0.5},
            {"step": 3, "time/step": 1.0, "time/sync_stall": 0.0},
            {"step": 4, "time/step": 1.5, "time/sync_stall": 0.3, "time/sync_total": 0.3}]
    s = summarize(recs)
    assert (s["sync_mode"], s["sync_stall_median_s"], s["sync_stall_n"]) == ("blocking", 0.4, 2)
    assert s["sync_stall_share"] == 2.8 / 8.0
    assert s["sync_stall_share_after_start"] == 0.8 / 5.0, "the steps after the start-up sync's step"
    # overlap: the step that started a push stalls for the snapshot; the adopting step's sync_total is not a stall
    recs = [{"step": 0, "time/step": 5.0, "time/sync_stall": 4.0, "sync/started": 1},
            {"step": 1, "time/step": 1.0, "time/sync_stall": 0.001, "sync/started": 0, "time/sync_total": 0.9},
            {"step": 2, "time/step": 1.0, "time/sync_stall": 0.01, "sync/started": 1},
            {"step": 3, "time/step": 1.0, "time/sync_stall": 0.02, "sync/started": 1}]
    s = summarize(recs)
    assert (s["sync_mode"], s["sync_stall_median_s"], s["sync_stall_n"]) == ("overlap", 0.015, 2)
    assert "sync stall per sync    0.015 s  (overlap, median of 2 after the first;" in format_summary(s)
    assert s["sync_stall_share_after_start"] == 0.031 / 3.0
    assert "of training time, 1.0 % after the start-up sync)" in format_summary(s)


def test_busy_is_the_records_busy_time_over_the_step_time_so_a_gpu_learners_device_time_counts():
    from launcher.summary import summarize
    from learner.metrics import metrics_line
    from learner.step_record import RankStats, StepFacts

    def gpu_record(step: int, step_s: float, fb_wall: float, fb_gpu: float) -> dict:
        r = RankStats(time_step=step_s, time_forward_backward=fb_wall, time_forward_backward_gpu=fb_gpu,
                      time_prepare_inputs=0.1, time_optimizer_step=0.2)
        return metrics_line(step, [r], StepFacts())

    # launched in 0.05 s of wall time, run for 0.6 s on the GPU; a 3 s sync step is weighed by its length
    recs = [gpu_record(0, 1.0, 0.05, 0.6), gpu_record(1, 3.0, 0.05, 0.6)]
    s = summarize(recs)
    assert s["busy_fraction"] == pytest.approx((0.6 + 0.6) / 4.0)  # not Σ forward_backward_mean / Σ step = 0.025
    assert (s["prepare_inputs_s"], s["other_s"]) == pytest.approx((0.2, (1.0 - 0.9) + (3.0 - 0.9)))
    assert "learner busy fraction  0.300  (" in format_summary(s)
    assert "inputs 0.20 s, other 2.20 s; optimizer steps 0.40 s)" in format_summary(s)


def _write(run: Path, records: list[dict]) -> Path:
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def _eval(step: int, f1: float, map_: float, **kw) -> dict:
    return {"record": "eval", "step": step, "eval/f1": f1, "eval/map": map_, "eval/parse_failure_rate": 0.0,
            "eval/objects_per_image": 2.1, "eval/gt_per_image": 2.2, "eval/n_images": 12, **kw}


def test_rollout_quality_is_aggregated_from_the_b_records_counts_not_averaged(tmp_path, capsys):
    from launcher.summary import summarize

    # Two B steps: one box matched of 1 / 1, then 0 of 9 predicted / 9 GT. Mean of step F1s = 0.5; counts: 0.1.
    recs = [{"step": 0, K + "step_kind_b": 0, "loss/total": 1.0},
            {"step": 1, K + "step_kind_b": 1, "rollout/n_matched": 1, "rollout/n_pred": 1, "rollout/n_gt": 1,
             "rollout/precision": 1.0, "rollout/recall": 1.0, "rollout/f1": 1.0},
            {"step": 2, K + "step_kind_b": 1, "rollout/n_matched": 0, "rollout/n_pred": 9, "rollout/n_gt": 9,
             "rollout/precision": 0.0, "rollout/recall": 0.0, "rollout/f1": 0.0}]
    s = summarize(recs)
    assert (s["rollout_n_matched"], s["rollout_n_pred"], s["rollout_n_gt"]) == (1, 10, 10)
    assert abs(s["rollout_f1"] - 0.1) < 1e-12 and abs(s["rollout_precision"] - 0.1) < 1e-12
    line = "rollout P / R / F1     0.100 / 0.100 / 0.100  (B packs: 1 matched of 10 predicted, 10 GT)"
    assert line in format_summary(s)

    run = _write(tmp_path / "a_only", [{"step": i, K + "step_kind_b": 0, "loss/total": 1.0} for i in range(3)])
    s = print_summary(run)
    assert s["rollout_f1"] is None and json.loads((run / "summary.json").read_text())["rollout_f1"] is None
    assert "rollout P / R / F1     n/a (no B rollouts)" in capsys.readouterr().out


def test_eval_records_are_summarised_first_best_last_and_kept_out_of_the_step_records(tmp_path, capsys):
    from launcher.summary import read_eval_records, read_metrics

    steps = [{"step": i, K + "step_kind_b": 0, "loss/total": 1.0} for i in range(31)]
    records = [_eval(0, 0.05, 0.01), *steps[:11], _eval(10, 0.62, 0.33), *steps[11:], _eval(30, 0.58, 0.31)]
    run = _write(tmp_path / "run", records)
    assert [r["step"] for r in read_metrics(run)] == list(range(31))  # existing callers see step records only
    assert [r["step"] for r in read_eval_records(run)] == [0, 10, 30]

    s = print_summary(run)
    out = capsys.readouterr().out
    assert s["steps"] == 31 and s["loss_last"] == 1.0
    assert "val F1@0.5 / mAP       first 0.050 / 0.010 (step 0) → best 0.620 / 0.330 (step 10) → " \
           "last 0.580 / 0.310 (step 30)" in out
    assert "val parse fail / obj   0.00 / 2.1 per image (GT 2.2)" in out
    saved = json.loads((run / "summary.json").read_text())["eval"]
    assert (saved["n"], saved["best"]["step"], saved["last"]["map"], saved["first"]["n_images"]) == (3, 10, 0.31, 12)


def test_a_run_without_eval_records_says_why(tmp_path, capsys):
    steps = [{"step": i, K + "step_kind_b": 0, "loss/total": 1.0} for i in range(2)]
    run = _write(tmp_path / "run", steps)
    assert print_summary(run)["eval"] is None
    assert "validation             no evaluation records" in capsys.readouterr().out
    (run / "run_config.yaml").write_text("data:\n  train_jsonl: d/train.jsonl\n  val_jsonl: null\n")
    print_summary(run)
    assert "validation             no evaluation (data.val_jsonl unset)" in capsys.readouterr().out
    (run / "run_config.yaml").write_text("data:\n  train_jsonl: d/train.jsonl\n  val_jsonl: d/val.jsonl\n")
    print_summary(run)
    assert "no evaluation records (data.val_jsonl = d/val.jsonl; did the run reach" in capsys.readouterr().out


def test_the_sync_bytes_name_what_was_left_on_the_servers_only_when_something_was():
    from launcher.summary import _sync_bytes

    assert _sync_bytes({"sync_bytes": 29.4e6, "sync_skipped_bytes": 0.0}) == "; 29.4 MB sent"
    assert _sync_bytes({"sync_bytes": 1.2e6, "sync_skipped_bytes": 14e6}) == \
        "; 1.2 MB sent, 14.0 MB left on the servers (frozen or merged there)"
    assert _sync_bytes({}) == ""


def test_the_loss_line_compares_a_steps_with_a_steps_and_b_steps_with_b_steps():
    from launcher.summary import summarize

    losses = [(0, 4.0), (1, 0.7), (0, 3.9), (1, 0.6), (0, 3.8)]  # A steps carry the coord CE, B steps do not
    records = [{"step": i, K + "step_kind_b": kind, "loss/total": loss} for i, (kind, loss) in enumerate(losses)]
    s = summarize(records)
    assert (s["loss_first_a"], s["loss_last_a"], s["loss_first_b"], s["loss_last_b"]) == (4.0, 3.8, 0.7, 0.6)
    assert "loss first → last      A 4.000 → 3.800; B 0.700 → 0.600" in format_summary(s)
    only_a = summarize([r for r in records if not r[K + "step_kind_b"]])
    assert "loss first → last      A 4.000 → 3.800\n" in format_summary(only_a) + "\n"
