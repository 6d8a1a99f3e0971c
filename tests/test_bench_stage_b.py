"""``bench/bench_stage_b.py --quick``: real ``stage_b.launch`` runs at world sizes 1 and 2 (CPU, gloo, tiny model),
then the rank-0-only check run again on the 2-rank output with a file planted by someone other than rank 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import bench_stage_b as bench  # noqa: E402

pytestmark = pytest.mark.slow

QUICK_DEADLINE_S = 180.0  # the whole bench: two launcher runs of ~10 s each on 2 cores


@pytest.fixture(scope="module")
def quick(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("bench_stage_b")
    out = tmp / "quick.json"
    cmd = [sys.executable, "bench/bench_stage_b.py", "--quick", "--work-dir", str(tmp / "work"), "--out", str(out)]
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=QUICK_DEADLINE_S)
    except subprocess.TimeoutExpired as exc:  # each run has its own deadline (150 s) inside; this is the backstop
        pytest.fail(f"bench_stage_b --quick still running after {QUICK_DEADLINE_S:.0f}s:\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"result": json.loads(out.read_text()), "stdout": proc.stdout, "work": tmp / "work"}


def test_quick_bench_reports_both_world_sizes_with_throughput_and_rank_zero_only_artifacts(quick):
    rows = {r["world_size"]: r for r in quick["result"]["rows"]}
    assert set(rows) == {1, 2}
    for w, r in rows.items():
        assert r["status"] == "ok" and r["exit_code"] == 0, r
        assert r["rank0_only"] is True and r["rank0_problems"] == [], r
        assert r["tickets"] == 12 and r["tickets_per_s"] > 0 and r["rollout_s"] > 0, r  # the demo's 12 tickets
        assert r["global_batches"] == 12 // (2 * w)  # 2 tickets per rank per batch
        assert r["wall_s"] > r["loop_s"] > 0
    assert rows[1]["speedup"] == 1.0 and rows[2]["speedup"] > 0
    assert "| world size |" in quick["stdout"] and "| 2 | 0,1 | ok |" in quick["stdout"]


def test_rank_zero_only_check_names_a_file_rank_zero_did_not_write(quick):
    out_root = quick["work"] / "ws2" / "out"
    assert bench.read_run(out_root, 2)["rank0_only"]
    run_dir = Path(quick["result"]["rows"][1]["run_dir"])
    (run_dir / "trajectories_rank1.jsonl").write_text("{}\n")  # what a rank writing its own shard would leave
    got = bench.read_run(out_root, 2)
    assert not got["rank0_only"] and "trajectories_rank1.jsonl" in got["rank0_problems"][0]
    assert not bench.read_run(out_root, 4)["rank0_only"]  # the summary says world size 2


def test_world_sizes_map_to_the_first_gpu_ids_and_bad_lists_are_refused():
    assert bench.gpu_lists("1,2,4", None) == ["0", "0,1", "0,1,2,3"]
    assert bench.gpu_lists(None, ["0", "2,3"]) == ["0", "2,3"]
    for bad in ("", "0", "1,1", "x"):
        with pytest.raises(ValueError):
            bench.gpu_lists(bad, None)
    for bad_list in (["0", "1"], ["0,0"], ["a"]):
        with pytest.raises(ValueError):
            bench.gpu_lists(None, bad_list)
