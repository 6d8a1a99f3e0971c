"""Rank 0's metric sinks: one JSONL record per optimizer step, and TensorBoard scalars when asked."""

from __future__ import annotations

import json

import pytest

from learner.metrics import MetricsWriter


def records(n: int) -> list[dict]:
    return [{"step": s, "loss/total": 5.0 - s, "stage2_ab/async/step_kind_b": s % 2, "tags": ["A", "B"]}
            for s in range(n)]


def test_jsonl_sink_writes_one_record_per_step_and_appends_on_resume(tmp_path):
    w = MetricsWriter(tmp_path, enabled=True, tensorboard=False, progress=False, start_step=0, max_steps=3)
    for r in records(3):
        w.write(r)
    w.close()
    w = MetricsWriter(tmp_path, enabled=True, tensorboard=False, progress=False, start_step=3, max_steps=4)
    w.write({"step": 3, "loss/total": 1.5})
    w.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3]


def test_tensorboard_sink_holds_every_numeric_key_per_step(tmp_path):
    pytest.importorskip("tensorboard", reason="the dev extra installs tensorboard; `pip install tensorboard`")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = MetricsWriter(tmp_path, enabled=True, tensorboard=True, progress=False, start_step=0, max_steps=4)
    for r in records(4):
        w.write(r)
    w.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss/total", "stage2_ab/async/step_kind_b"}  # lists are not scalars
    assert [(e.step, e.value) for e in acc.Scalars("loss/total")] == [(0, 5.0), (1, 4.0), (2, 3.0), (3, 2.0)]


def test_non_main_ranks_write_nothing(tmp_path):
    w = MetricsWriter(tmp_path / "r1", enabled=False, tensorboard=True, progress=True, start_step=0, max_steps=2)
    w.write({"step": 0, "loss/total": 1.0})
    w.close()
    assert not (tmp_path / "r1").exists()
