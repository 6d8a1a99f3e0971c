"""``bench/bench_http_sync.py --quick`` (issue #18's CPU benchmark runs in make test): a >= 256 MB push over the
real HTTP sync path to a real server on loopback, beside a raw loopback socket moving the same bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_quick_http_sync_bench_pushes_256_mb_lands_them_exactly_and_prints_both_rates(tmp_path):
    out = tmp_path / "http_sync.json"
    proc = subprocess.run([sys.executable, "bench/bench_http_sync.py", "--quick", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last == json.loads(out.read_text())
    assert last["bytes"] >= 256 << 20 and last["n_buckets"] > 1 and last["pushes"] == 2
    assert last["digest_equal"] is True
    assert last["http_gb_s"] > 0 and last["raw_socket_gb_s"] > 0
    assert abs(last["ratio"] - last["http_gb_s"] / last["raw_socket_gb_s"]) < 1e-9
