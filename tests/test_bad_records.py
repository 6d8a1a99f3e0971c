"""``data.on_bad_record``: fail (the default) stops the start before any training work, naming each record and
the fix; skip trains on the good records, counting the bad ones and logging each kind once."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from common.config.load import load_config
from common.data.check import BadRecordError, start_problems

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo_cpu.yaml"


def cfg_of(path: Path, *overrides: str, model: Path | None = None):
    extra = [f"model.path={model}"] if model else []
    return load_config(CONFIG, [f"data.train_jsonl={path}", "data.val_jsonl=null", *extra, *overrides], world_size=1)


def test_the_start_check_lists_every_bad_record_with_its_fix_under_fail(two_of_three_bad):
    problems = start_problems(cfg_of(two_of_three_bad))
    assert len(problems) == 3, problems  # two records and the summary line
    assert problems[0].startswith("train.jsonl:2 (id synth-000001): objects[0].bbox_2d:") and "fix:" in problems[0]
    assert problems[1].startswith("train.jsonl:3") and "image not found" in problems[1]
    assert "data.on_bad_record: skip" in problems[2] and "tandem data check" in problems[2]
    assert start_problems(cfg_of(two_of_three_bad, "data.on_bad_record=skip")) == []
    assert start_problems(cfg_of(two_of_three_bad, "data.num_records_checked_at_start=1")) == []  # line 1 is good


def test_the_learner_refuses_to_start_on_bad_records_before_writing_anything(two_of_three_bad, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(REPO / "learner" / "main.py"), "--config", str(CONFIG),
                           f"data.train_jsonl={two_of_three_bad}", "data.val_jsonl=null", f"training.output_dir={out}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "train.jsonl:2" in proc.stderr and "train.jsonl:3" in proc.stderr and "on_bad_record" in proc.stderr
    assert not out.exists()  # refused before the run record, the model or torch


def test_skip_trains_on_the_good_record_and_logs_each_kind_once(two_of_three_bad, tiny_model_dir, caplog):
    from common.packing.encode import encoder_from_config
    from learner.data import ChannelAData

    cfg = cfg_of(two_of_three_bad, "data.on_bad_record=skip", model=tiny_model_dir)
    data = ChannelAData(cfg, encoder_from_config(cfg), rank=0, world_size=1, ga=1, samples=4)
    with caplog.at_level(logging.WARNING, logger="common.data.check"):
        packs = [data.next_window(ver=0) for _ in range(3)]
    ids = {s.sample_id.split("@")[0] for window in packs for p in window for s in p.segments}
    assert ids == {"A:synth-000000"}
    assert data.counters["record_errors"] >= 4  # each bad line drawn at least twice over 3 windows of 4 samples
    skipped = [r.getMessage() for r in caplog.records if "skipping records" in r.getMessage()]
    assert len(skipped) == 2 and any("objects[].bbox_2d" in m for m in skipped) and any("images[]" in m for m in skipped)


def test_fail_stops_channel_a_at_a_bad_record_past_the_start_check(two_of_three_bad, tiny_model_dir):
    from common.packing.encode import encoder_from_config
    from learner.data import ChannelAData

    cfg = cfg_of(two_of_three_bad, model=tiny_model_dir)
    data = ChannelAData(cfg, encoder_from_config(cfg), rank=0, world_size=1, ga=1, samples=4)
    with pytest.raises(BadRecordError, match=r"train\.jsonl:[23].*data\.on_bad_record = fail"):
        data.next_window(ver=0)


def test_the_launcher_refuses_bad_records_before_starting_any_process(two_of_three_bad, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "launcher", "--config", str(CONFIG),
                           f"data.train_jsonl={two_of_three_bad}", "data.val_jsonl=null", f"training.output_dir={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "bad training data" in proc.stderr and "train.jsonl:2" in proc.stderr
    assert not out.exists()  # no server, learner or actor was started (they would log under output_dir/logs)
