"""``bench/bench_adapter_sync.py --quick``: the adapter-vs-merged sync benchmark on CPU (the hf engine, the tiny model),
end to end against a real server on loopback: an adapter sync sends far fewer bytes than a merged one, and the
server decodes after both."""

from __future__ import annotations

from tests.factories import run_bench_json


def test_the_quick_adapter_sync_bench_sends_fewer_bytes_for_the_adapter_and_reports_every_mode(tmp_path):
    last = run_bench_json("bench_adapter_sync.py", ["--quick"], tmp_path / "adapter_sync.json", timeout_s=120)
    adapter, merged = last["modes"]["adapter"], last["modes"]["merged"]
    assert adapter["syncs"] == merged["syncs"] == 2 and adapter["transport"] == "http"
    assert 0 < adapter["bytes"] < merged["bytes"] <= last["full_bytes"]
    assert adapter["bytes"] * 4 < last["full_bytes"], "an adapter sync sends the adapter, not the weights"
    for mode in (adapter, merged):
        assert mode["median"]["total_s"] > 0 and mode["decode_tok_s_after"] > 0
    assert last["decode_tok_s_base"] > 0
