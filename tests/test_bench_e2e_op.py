"""bench/bench_e2e_op.py --quick: the end-to-end operating-point driver's own code on the tiny model, on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server_proc import REPO


@pytest.mark.slow
def test_the_end_to_end_bench_runs_the_whole_topology_and_reports_the_run_summary(tmp_path):
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, "bench/bench_e2e_op.py", "--quick", "--work", str(tmp_path / "w"),
                           "--out", str(out), "--vocab", "4096"], cwd=REPO, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    assert line["launcher_rc"] == 0 and line["steps"] == 6 == line["steps_a"] + line["steps_b"]
    assert line["syncs"] >= 2 and line["ver_final"] >= 2, "the quick form syncs every 2 steps"
    assert 0 < line["busy_fraction"] <= 1 and 0 <= line["sync_stall_share"] < 1
    assert line["tokens_per_s_median"] > 0 and line["mfu_median"] > 0 and line["peak_source"] == "measured"
    assert line["mean_fill_a"] > 0.5 and line["device"] == "cpu"
    # the model the driver built: the widened embedding and a processor taking the --side images whole
    model = next((tmp_path / "w").glob("model-*"))
    assert json.loads((model / "config.json").read_text())["text_config"]["vocab_size"] == 4096
    assert json.loads((model / "preprocessor_config.json").read_text())["size"]["longest_edge"] == 112 * 112


def test_the_end_to_end_bench_refuses_a_stray_argument():
    proc = subprocess.run([sys.executable, "bench/bench_e2e_op.py", "--quick", "--stesp", "3"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--stesp" in proc.stderr
