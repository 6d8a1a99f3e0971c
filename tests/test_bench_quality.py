"""bench/bench_quality.py in its ``--quick`` form: every arm (A-only, async AB, step) really runs through the
launcher from a warm-started detector, evaluates at both ends, and the table, JSON and plot come out.
It checks the plumbing (so the benchmark cannot rot), not the quality: the quality runs are in
docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import bench_quality as bq  # noqa: E402
from tests.ports import free_port_block  # noqa: E402

pytestmark = pytest.mark.slow


def quick_argv(out: Path, model: Path, data: Path, server: int, base: int, *flags: str) -> list[str]:
    """``bench_quality.py --quick`` from the tiny detector on loopback ports of the test's own (slot 0's); each
    evaluation scores 4 of the 16 validation images (the curves' plumbing, not their values, is under test)."""
    return [sys.executable, str(REPO / "bench" / "bench_quality.py"), "--quick", *flags, "--out", str(out),
            f"model.path={model}", f"data.train_jsonl={data / 'train.jsonl'}", f"data.val_jsonl={data / 'val.jsonl'}",
            "training.eval_max_images=4",
            f"transport.base_port={base}", f"rollout_matching.vllm.servers=[{{base_url: 'http://127.0.0.1:{server}'}}]",
            f"rollout_server.port={server}"]


def test_quick_quality_bench_runs_every_arm_from_the_warm_start_and_reports_curves(tmp_path, tiny_detector_dir,
                                                                                 detector_data_dir):
    out = tmp_path / "bq"
    server, base = free_port_block(1), free_port_block(2)
    argv = quick_argv(out, tiny_detector_dir, detector_data_dir, server, base)
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    payload = json.loads((out / "quality.json").read_text())
    arms = {a["arm"]: a for a in payload["arms"]}
    assert set(arms) == {"a_only", "async_ab", "step"}
    for name, arm in arms.items():
        assert arm["learner_s"] >= payload["budget_s"] * 0.9, (name, arm["learner_s"])  # stopped by the budget
        steps = [c["step"] for c in arm["curve"]]
        assert steps[0] == 0 and steps[-1] == arm["steps"], (name, steps)  # evaluated at both ends
        assert all(c["f1"] is not None and c["ver"] >= 1 for c in arm["curve"]), arm["curve"]
    assert arms["a_only"]["b_steps"] == 0
    assert (out / "quality.png").stat().st_size > 0
    assert "F1 vs A-only" in r.stdout and "step" in r.stdout


def test_figures_put_each_evaluation_at_the_learner_seconds_spent_before_its_step():
    # step 0 holds the start-up (sync setup, CUDA init): not learner time, as training.max_train_seconds counts it
    steps = [{"step": s, "time/step": 7.0 if s == 0 else 0.5, "stage2_ab/async/step_kind_b": s % 2} for s in range(6)]
    evals = [{"step": 0, "eval/f1": 0.2, "eval/map": 0.1}, {"step": 4, "eval/f1": 0.5, "eval/map": 0.3},
             {"step": 6, "eval/f1": 0.4, "eval/map": 0.2}]
    fig = bq.arm_figures("x", steps, evals, wall_s=9.0)
    assert [c["learner_s"] for c in fig["curve"]] == [0.0, 1.5, 2.5]
    assert fig["b_steps"] == 3 and fig["learner_s"] == 2.5 and fig["startup_step_s"] == 7.0
    assert fig["first"]["f1"] == 0.2 and fig["last"]["f1"] == 0.4 and fig["best"]["f1"] == 0.5


def test_two_slots_run_the_seeds_concurrently_on_ports_of_their_own(tmp_path, tiny_detector_dir,
                                                                                  detector_data_dir):
    # the CPU has no GPUs to pin: a slot is its ports here (bench_quality.slot_overrides), as it is on GPUs too.
    # One arm, two seeds: one round of two concurrent runs (the paired statistics: tests/test_bench_quality_stats.py)
    out = tmp_path / "bq"
    server, base = free_port_block(4), free_port_block(4)
    argv = quick_argv(out, tiny_detector_dir, detector_data_dir, server, base,
                      "--seeds", "2", "--arms", "a_only", "--gpus", "0,1", "--deadline-s", "240")
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    payload = json.loads((out / "quality.json").read_text())
    assert payload["failed"] == []
    runs = {(a["seed"], a["arm"]): a for a in payload["arms"]}
    assert list(runs) == [(0, "a_only"), (1, "a_only")]  # seed-major
    assert {a["slot"] for a in runs.values()} == {0, 1}
    for (seed, arm), run in runs.items():
        assert run["curve"][-1]["step"] == run["steps"] and run["last"]["f1"] is not None, (seed, arm)
        ports = run["ports"]
        assert ports == {"rollout_server": server + 2 * run["slot"], "transport": base + 2 * run["slot"]}
        run_config = (out / bq.run_name(arm, seed, 2) / "run_config.yaml").read_text()
        assert f"port: {ports['rollout_server']}" in run_config and f"base_port: {ports['transport']}" in run_config
    stats = payload["statistics"]
    assert stats["per_arm"]["a_only"]["last_f1"]["n"] == 2
    assert payload["crowded"]["a_only"]["eval/recall"]["n"] == 2
    assert "a_only    n=2" in r.stdout and "recall" in r.stdout
