"""Rank 0's metric sinks: one JSONL record per optimizer step (evaluation records interleaved), TensorBoard
scalars when asked, and which keys a step record holds (the time keys: busy and ``time/other`` on CPU and GPU)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from learner.metrics import MetricsWriter, metrics_line
from learner.pack_queue import COUNTER_NAMES
from learner.step_record import ROLLOUT_COUNTS, SCALARS, RankStats, StepFacts


def records(n: int) -> list[dict]:
    return [{"step": s, "loss/total": 5.0 - s, "stage2_ab/async/step_kind_b": s % 2, "tags": ["A", "B"]}
            for s in range(n)]


def test_jsonl_sink_writes_one_record_per_step_and_appends_on_resume(tmp_path):
    w = MetricsWriter(tmp_path, enabled=True, progress=False, start_step=0, max_steps=3)
    for r in records(3):
        w.write(r)
    w.close()
    w = MetricsWriter(tmp_path, enabled=True, progress=False, start_step=3, max_steps=4)
    w.write({"step": 3, "loss/total": 1.5})
    w.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3]


def test_tensorboard_sink_holds_every_numeric_key_per_step(tmp_path):
    pytest.importorskip("tensorboard", reason="the dev extra installs tensorboard; `pip install tensorboard`")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = MetricsWriter(tmp_path, enabled=True, report_to=["tensorboard"], progress=False, start_step=0, max_steps=4)
    for r in records(4):
        w.write(r)
    w.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss/total", "stage2_ab/async/step_kind_b"}  # lists are not scalars
    assert [(e.step, e.value) for e in acc.Scalars("loss/total")] == [(0, 5.0), (1, 4.0), (2, 3.0), (3, 2.0)]


def test_non_main_ranks_write_nothing(tmp_path):
    w = MetricsWriter(tmp_path / "r1", enabled=False, report_to=["tensorboard"], progress=True, start_step=0, max_steps=2)
    w.write({"step": 0, "loss/total": 1.0})
    w.close()
    assert not (tmp_path / "r1").exists()


def _rank(kind_b: bool, packs: int, **rollout: int) -> RankStats:
    r = RankStats(kind_b=float(kind_b), packs=float(packs), time_step=1.0)
    r.rollout.update(rollout)
    return r


def test_an_a_step_record_has_no_rollout_quality_keys():
    rec = metrics_line(0, [_rank(False, 2), _rank(False, 2)], StepFacts())
    assert not [k for k in rec if k.startswith("rollout/")]  # absent, not the 1.0 that 0/0 would give


def test_a_b_step_record_has_rollout_counts_and_ratios_from_the_summed_counts():
    rec = metrics_line(1, [_rank(True, 2, n_pred=4, n_gt=2, n_matched=2, parse_truncated=1),
                           _rank(True, 2, n_pred=0, n_gt=2, n_matched=0, invalid_rollout=1)], StepFacts())
    assert (rec["rollout/n_pred"], rec["rollout/n_gt"], rec["rollout/n_matched"]) == (4, 4, 2)
    assert (rec["rollout/parse_truncated"], rec["rollout/invalid_rollout"]) == (1, 1)
    assert (rec["rollout/precision"], rec["rollout/recall"], rec["rollout/f1"]) == (0.5, 0.5, 0.5)


def test_a_b_step_whose_packs_held_no_boxes_keeps_its_counts_but_claims_no_f1():
    rec = metrics_line(2, [_rank(True, 1, invalid_rollout=3)], StepFacts())
    assert (rec["rollout/n_pred"], rec["rollout/n_gt"], rec["rollout/invalid_rollout"]) == (0, 0, 3)
    assert "rollout/f1" not in rec and "rollout/precision" not in rec


def _timed(step: float, fb: float, fb_gpu: float = 0.0, **parts: float) -> RankStats:
    """A rank's stats with a step time, its forward/backward (wall, device) and other parts (``time_<name>``)."""
    r = _rank(False, 2)
    r.time_step, r.time_forward_backward, r.time_forward_backward_gpu = step, fb, fb_gpu
    for name, value in parts.items():
        setattr(r, f"time_{name}", value)
    return r


PARTS = {"wait_for_packs": 0.01, "wait_for_a_window": 0.02, "sync_stall": 0.03, "optimizer_step": 0.04,
         "prepare_inputs": 0.05}  # 0.15 s in all


def test_a_cpu_record_counts_wall_forward_backward_as_busy_and_names_the_rest_other():
    rec = metrics_line(0, [_timed(1.0, 0.6, **PARTS), _timed(0.9, 0.4, **PARTS)], StepFacts())
    assert "time/forward_backward_gpu" not in rec and "time/forward_backward_gpu_mean" not in rec  # absent, not 0
    assert rec["time/prepare_inputs"] == 0.05
    assert rec["learner/busy_fraction"] == pytest.approx(0.5)  # (0.6 + 0.4) / 2 over the slowest step, 1.0
    # per rank: 1.0 - 0.6 - 0.15 = 0.25 and 0.9 - 0.4 - 0.15 = 0.35; the max, not the record's 1.0 - 0.6 - 0.15
    assert rec["time/other"] == pytest.approx(0.35)


def test_a_gpu_record_counts_the_device_forward_backward_where_it_is_longer_than_the_wall_time():
    # rank 0: launching took 0.05 s of wall time, the GPU ran the spans for 0.7 s; rank 1 is launch-bound (wall
    # longer than device): each rank counts the longer of the two
    rec = metrics_line(0, [_timed(1.0, 0.05, 0.7, **PARTS), _timed(1.0, 0.3, 0.2, **PARTS)], StepFacts())
    assert (rec["time/forward_backward_gpu"], rec["time/forward_backward_gpu_mean"]) == (0.7, pytest.approx(0.45))
    assert rec["time/forward_backward"] == 0.3  # the wall time is reported as measured
    assert rec["learner/busy_fraction"] == pytest.approx((0.7 + 0.3) / 2)  # not (0.05 + 0.3) / 2
    assert rec["time/other"] == pytest.approx(1.0 - 0.3 - 0.15)  # rank 1; rank 0's 1.0 - 0.7 - 0.15 is less


def test_time_other_is_clamped_at_zero_where_the_gpu_parts_overlap_and_busy_at_one():
    # the optimizer step's norm read waited for the last backward, which the device time also counts
    rec = metrics_line(0, [_timed(1.0, 0.1, 1.2, optimizer_step=0.3)], StepFacts())
    assert rec["time/other"] == 0.0 and rec["learner/busy_fraction"] == 1.0


def test_a_rank_vector_keeps_its_length_and_carries_the_new_times():
    r = _timed(1.0, 0.2, 0.5, prepare_inputs=0.05)
    r.trained_vers = [3]
    for ga in (1, 4):
        vector = r.vector(ga)
        assert len(vector) == len(SCALARS) + len(ROLLOUT_COUNTS) + len(COUNTER_NAMES) + ga  # the same on every rank
        back = RankStats.from_vector(vector, ga)
        assert (back.time_forward_backward_gpu, back.time_prepare_inputs, back.trained_vers) == (0.5, 0.05, [3])


class _OverlapDetectingFile:
    """Wraps the JSONL file: each write holds the file for a moment and notes any write that entered meanwhile.

    CPython's buffered writes rarely tear on their own, so without this the test could pass with the
    writer's lock removed; with it, two threads writing at once are caught every time."""

    def __init__(self, f) -> None:
        self.f, self.inside, self.overlaps = f, 0, 0
        self._count = threading.Lock()

    def write(self, text: str) -> int:
        with self._count:
            self.inside += 1
            self.overlaps += self.inside > 1
        time.sleep(0.0005)
        n = self.f.write(text)
        with self._count:
            self.inside -= 1
        return n

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_eval_records_from_another_thread_interleave_as_whole_lines(tmp_path):
    w = MetricsWriter(tmp_path, enabled=True, progress=False, start_step=0, max_steps=400)
    w._jsonl = probe = _OverlapDetectingFile(w._jsonl)
    pad = "x" * 4096  # lines longer than one write buffer, so a torn line would show

    def evaluate() -> None:
        for s in range(200):
            w.write_eval({"step": s, "eval/f1": 0.5, "eval/score_source": "coord_logprob", "pad": pad})

    t = threading.Thread(target=evaluate)
    t.start()
    for s in range(200):
        w.write({"step": s, "loss/total": 1.0, "pad": pad})
    t.join(timeout=60)
    assert not t.is_alive(), "the evaluation thread did not finish within 60 s"
    w.close()
    assert probe.overlaps == 0, f"{probe.overlaps} writes entered the file while another was in progress"
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 400
    assert [r["step"] for r in lines if r.get("record") == "eval"] == list(range(200))
    assert [r["step"] for r in lines if "record" not in r] == list(range(200))


def test_eval_records_become_eval_scalars_at_their_step(tmp_path):
    pytest.importorskip("tensorboard", reason="the dev extra installs tensorboard; `pip install tensorboard`")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = MetricsWriter(tmp_path, enabled=True, report_to=["tensorboard"], progress=False, start_step=0, max_steps=4)
    w.write_eval({"step": 30, "eval/f1": 0.58, "eval/map": None, "eval/score_source": "coord_logprob"})
    w.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"eval/f1"}  # None and strings are not scalars
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("eval/f1")] == [(30, 0.58)]


class _BrokenTracker:
    """A tracker whose backend fails from its second record on (a full disk, a store gone away)."""

    def __init__(self) -> None:
        self.got: list[int] = []

    def log(self, values: dict, step: int) -> None:
        if self.got:
            raise OSError("No space left on device")
        self.got.append(step)

    def close(self) -> None:
        pass


def test_a_failing_tracker_is_dropped_with_an_error_and_metrics_jsonl_goes_on(tmp_path, caplog):
    w = MetricsWriter(tmp_path, enabled=True, progress=False, start_step=0, max_steps=3)
    w._trackers = [broken := _BrokenTracker()]
    for r in records(3):
        w.write(r)
    w.close()
    assert broken.got == [0]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert "tracker _BrokenTracker failed at step 1" in caplog.text
