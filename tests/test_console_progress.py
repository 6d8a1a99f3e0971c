"""The launcher's console progress line (launcher/progress.py) read from a metrics.jsonl as rank 0 appends it."""

from __future__ import annotations

import io
import json
import os

from launcher.progress import ConsoleProgress


class Clock:
    """Seconds the test sets: the ETA is a function of time, so the test owns it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def append(path, *records, torn: str = "") -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + torn)


def step(s: int, b: bool, loss: float) -> dict:
    return {"step": s, "stage2_ab/async/step_kind_b": int(b), "loss/total": loss}


def test_one_line_with_steps_a_b_loss_val_f1_and_eta_at_most_every_interval(tmp_path):
    clock, out = Clock(), io.StringIO()
    p = ConsoleProgress(tmp_path, max_steps=10, every_s=5.0, out=out, clock=clock)
    assert p.tick() is None  # no metrics.jsonl yet: nothing to say
    append(tmp_path / "metrics.jsonl", step(0, False, 2.0))
    assert p.tick() == "step 1/10  A 1 B 0  loss 2.000"  # no rate from one step
    clock.now = 4.0
    append(tmp_path / "metrics.jsonl", step(1, True, 1.5), step(2, False, 1.25),
           {"record": "eval", "step": 2, "eval/f1": 0.25})
    assert p.tick() is None  # news, but 4 s after the last line
    clock.now = 6.0
    # 2 steps in 6 s since the first one: 3 s/step, 7 steps to go
    assert p.tick() == "step 3/10  A 2 B 1  loss 1.250  val F1 0.250 @2  3.00 s/step  ETA 0m21s"
    clock.now = 20.0
    assert p.tick() is None  # nothing new: no line
    assert out.getvalue().count("\n") == 2


def test_a_torn_last_line_waits_for_its_end_and_a_replaced_file_is_read_from_its_start(tmp_path):
    clock = Clock()
    p = ConsoleProgress(tmp_path, max_steps=4, every_s=0.0, out=io.StringIO(), clock=clock)
    path = tmp_path / "metrics.jsonl"
    append(path, step(0, False, 1.0), torn='{"step": 1, "loss/to')
    assert p.tick() == "step 1/4  A 1 B 0  loss 1.000"
    with path.open("a") as f:  # the rest of the line arrives
        f.write('tal": 0.5}\n')
    assert p.tick().startswith("step 2/4  A 2 B 0  loss 0.500")
    os.replace(path, tmp_path / "old.jsonl")  # training.overwrite moved the run aside; a new one starts
    append(path, step(0, True, 3.0))
    assert p.tick() == "step 1/4  A 0 B 1  loss 3.000"


def test_the_supervisor_prints_progress_while_its_learner_writes_metrics(tmp_path):
    import sys

    from launcher.plan import ProcessSpec
    from launcher.supervisor import Supervisor

    metrics = tmp_path / "metrics.jsonl"
    learner = ("import json, time\n"  # a stand-in learner: 3 step records, 0.3 s apart, then exit 0
               f"for s in range(3):\n    time.sleep(0.3)\n"
               f"    with open({str(metrics)!r}, 'a') as f: f.write(json.dumps({{'step': s, 'loss/total': 1.0}}) + '\\n')\n")
    out = io.StringIO()
    progress = ConsoleProgress(tmp_path, max_steps=3, every_s=0.0, out=out)
    spec = ProcessSpec(name="learner", role="learner", argv=[sys.executable, "-c", learner], log=tmp_path / "l.log")
    assert Supervisor([spec], health_timeout_s=10, grace_s=5, on_tick=progress.tick).run() == 0
    lines = out.getvalue().splitlines()
    assert lines and lines[0].startswith("step 1/3  A 1 B 0  loss 1.000"), lines
    assert len(lines) <= 3 and all(line.startswith("step ") for line in lines)
