"""bench/bench_learner.py runs end to end on the tiny model (it once crashed in setup unnoticed: nothing ran it)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.server_proc import REPO


def test_the_learner_bench_times_its_three_phases_from_the_learners_own_records(tmp_path):
    out = tmp_path / "bench_learner.json"
    proc = subprocess.run([sys.executable, "bench/bench_learner.py", "--steps", "2", "--warmup", "1", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, fed, slow = json.loads(out.read_text())["results"]
    assert (a["phase"], a["steps"], a["b_steps"]) == ("A", 2, 0)
    assert (fed["steps"], fed["b_steps"], fed["skipped_b"]) == (2, 2, 0), "a fed queue must give every wanted B step"
    assert slow["b_steps"] + slow["skipped_b"] == 2, "b_ratio 1: every step wants B; a short queue skips to A"
    for r in (a, fed, slow):
        parts = r["forward_backward_s"] + r["prepare_inputs_s"] + r["other_s"]
        assert 0 < r["busy_fraction"] <= 1, r
        assert r["prepare_inputs_s"] > 0 and r["other_s"] >= 0, r
        assert parts <= r["time_step_s"] * 1.05, f"parts of a step exceed the step: {r}"
        assert "forward_backward_gpu_s" not in r, "no GPU here: the device time is absent, not 0"
