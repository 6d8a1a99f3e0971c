"""A run never overwrites or deletes another run's output: a used output_dir is refused (exit 2, nothing
started, nothing written) unless resuming or told to overwrite, which moves the old run aside."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.runs.checkpoints import latest_checkpoint, resolve_resume_checkpoint
from common.config.load import load_config
from common.runs.output_dir import StartRefused, prepare_start

REPO = Path(__file__).resolve().parents[1]


def cfg_for(out: Path, *overrides: str):
    return load_config(None, ["model.path=m", "data.train_jsonl=d.jsonl", "stage2_ab.schedule.b_ratio=0.5",
                              f"training.output_dir={out}", *overrides], world_size=1)


def old_run(out: Path, run_id: str = "a" * 32, steps: tuple[int, ...] = (15, 30, 45, 60)) -> Path:
    """What a finished run leaves: its record, metrics and checkpoints (each naming its run id)."""
    out.mkdir(parents=True)
    (out / "run_info.json").write_text(json.dumps({"run_id": run_id, "started_utc": "2026-11-30T09:05:00+00:00"}))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "run_id": run_id}) + "\n" for s in range(60)))
    for s in steps:
        (out / "checkpoints" / str(s)).mkdir(parents=True)
        (out / "checkpoints" / str(s) / "trainer_state.json").write_text(json.dumps({"run_id": run_id, "global_step": s}))
    return out


def test_a_fresh_start_into_a_used_output_dir_is_refused_naming_what_is_there_and_the_three_fixes(tmp_path):
    out = old_run(tmp_path / "run")
    with pytest.raises(StartRefused) as exc:
        prepare_start(cfg_for(out))
    msg = str(exc.value)
    assert str(out) in msg and "metrics.jsonl (60 records)" in msg and "checkpoints/ 15, 30, 45, 60" in msg
    assert "training.resume=auto (from checkpoints/60)" in msg and "training.overwrite=true" in msg
    assert f"training.output_dir={out}-2" in msg
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "metrics.jsonl", "run_info.json"]  # untouched


def test_overwrite_moves_the_old_run_aside_whole_and_deletes_nothing(tmp_path):
    out = old_run(tmp_path / "run")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    aside = prepare_start(cfg_for(out, "training.overwrite=true"))
    assert aside == tmp_path / "run.old-20261130T090500" and not out.exists()
    assert sorted(str(p.relative_to(aside)) for p in aside.rglob("*")) == before
    assert prepare_start(cfg_for(out)) is None  # the directory is free: a fresh start
    assert prepare_start(cfg_for(out, "training.overwrite=true", "training.resume=auto"), move=False) is None


def test_resume_auto_continues_only_the_directory_s_own_run(tmp_path):
    out = old_run(tmp_path / "run", run_id="b" * 32, steps=(15,))
    for s in (30, 45, 60):  # checkpoints another run left behind (older layout, other run id)
        (out / "checkpoints" / str(s)).mkdir()
        (out / "checkpoints" / str(s) / "trainer_state.json").write_text(json.dumps({"run_id": "a" * 32}))
    assert latest_checkpoint(out) == out / "checkpoints" / "15"
    assert prepare_start(cfg_for(out, "training.resume=auto")) is None  # resumes its own step 15, not 60
    (out / "checkpoints" / "15" / "trainer_state.json").write_text(json.dumps({"run_id": "c" * 32}))
    assert resolve_resume_checkpoint("auto", out) is None
    with pytest.raises(StartRefused, match="found no checkpoint of that run"):
        prepare_start(cfg_for(out, "training.resume=auto"))


def test_a_directory_without_a_run_is_a_fresh_start(tmp_path):
    (tmp_path / "run" / "logs").mkdir(parents=True)
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    assert prepare_start(cfg_for(tmp_path / "run")) is None
    assert prepare_start(cfg_for(tmp_path / "absent")) is None


def test_resuming_another_run_s_checkpoint_into_a_used_directory_is_refused(tmp_path):
    other = old_run(tmp_path / "other", run_id="d" * 32, steps=(10,))
    out = old_run(tmp_path / "run")
    with pytest.raises(StartRefused, match="would mix"):
        prepare_start(cfg_for(out, f"training.resume={other / 'checkpoints' / '10'}"))
    assert prepare_start(cfg_for(tmp_path / "new", f"training.resume={other / 'checkpoints' / '10'}")) is None


@pytest.mark.parametrize("entry", [["-m", "launcher"], ["learner/main.py"]])
def test_the_launcher_and_the_learner_refuse_with_exit_2_before_anything_starts(tmp_path, entry):
    out = old_run(tmp_path / "run")
    before = sorted(p.name for p in out.iterdir())
    proc = subprocess.run([sys.executable, *entry, "--config", str(REPO / "configs" / "demo_cpu.yaml"),
                           f"training.output_dir={out}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "holds a run" in proc.stderr and "training.overwrite=true" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == before  # no logs/, no run record: nothing started


def test_a_resume_sets_aside_the_lines_of_the_steps_it_trains_again_and_a_torn_line(tmp_path):
    from learner.metrics import MetricsWriter

    lines = [{"step": s} for s in range(22)] + [{"record": "eval", "step": 20}]  # crashed at 22, checkpoint 15
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 22, "lo')
    writer = MetricsWriter(tmp_path, enabled=True, progress=False, start_step=15, max_steps=30,
                           run_id="r")
    writer.write({"step": 15, "loss/total": 1.0})
    writer.close()
    kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == list(range(16)) and kept[-1]["run_id"] == "r"
    (aside,) = tmp_path.glob("metrics.superseded-*.jsonl")
    assert aside.read_text().count("\n") == 8 and aside.read_text().endswith('"lo')  # steps 15-21, eval 20, torn 22


def test_a_start_that_failed_before_its_first_step_leaves_a_directory_the_corrected_start_may_use(tmp_path):
    """Only run_info.json (e.g. a bad model.path stopped the learner): nothing was trained, so no refusal."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run_info.json").write_text(json.dumps({"run_id": "c" * 32, "started_utc": "2026-11-30T09:05:00+00:00"}))
    assert prepare_start(cfg_for(out)) is None
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "run_id": "c" * 32}) + "\n")
    with pytest.raises(StartRefused, match="run id c+"):
        prepare_start(cfg_for(out))
