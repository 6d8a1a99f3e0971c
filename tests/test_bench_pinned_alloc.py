"""bench/bench_pinned_alloc.py --quick: the pinned-allocation bench's own code on the tiny preset (nothing is pinned
without CUDA): each allocator setting in its own process, with the environment variable it names."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.server_proc import REPO


def test_the_pinned_allocation_bench_runs_each_setting_in_a_child_with_its_allocator_conf(tmp_path):
    out = tmp_path / "pinned.json"
    proc = subprocess.run([sys.executable, "bench/bench_pinned_alloc.py", "--quick", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text()) and line["preset"] == "tiny"
    default, register = line["settings"]["default"], line["settings"]["register"]
    assert default["conf"] == "" and register["conf"].startswith("pinned_use_cuda_host_register:True")
    assert "pinned_num_register_threads:8" in register["conf"]
    assert default["tensors"] == register["tensors"] > 10 and default["gb"] == register["gb"] > 0
    assert len(default["seconds"]) == 1 and default["pinned"] is False  # no CUDA here: the code path only
