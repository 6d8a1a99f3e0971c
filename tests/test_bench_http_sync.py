"""``bench/bench_http_sync.py --quick`` (issue #18's CPU benchmark runs in make test): a >= 256 MB push over the
real HTTP sync path to a real server on loopback, beside a raw loopback socket moving the same bytes."""

from __future__ import annotations

import pytest

from tests.factories import run_bench_json


@pytest.mark.slow
def test_the_quick_http_sync_bench_pushes_256_mb_lands_them_exactly_and_prints_both_rates(tmp_path):
    out = tmp_path / "http_sync.json"
    last = run_bench_json("bench_http_sync.py", ["--quick"], out, timeout_s=600)
    assert last["bytes"] >= 256 << 20 and last["n_buckets"] > 1 and last["pushes"] == 2
    assert last["digest_equal"] is True
    assert last["http_gb_s"] > 0 and last["raw_socket_gb_s"] > 0
    assert abs(last["ratio"] - last["http_gb_s"] / last["raw_socket_gb_s"]) < 1e-9
