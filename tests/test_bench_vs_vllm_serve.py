"""bench/bench_vs_vllm_serve.py without a GPU: its request drivers (the official openai client on
/v1/completions, httpx on /infer) and statistics against tandem's server with the hf engine on CPU."""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.server_proc import REPO

sys.path.insert(0, str(REPO / "bench"))

import bench_vs_vllm_serve as bench  # noqa: E402
import serve_compare_lib as lib  # noqa: E402

pytestmark = pytest.mark.slow


def test_every_request_generates_max_tokens_on_both_routes_and_the_last_line_is_the_json(tiny_model_dir, capsys):
    rc = bench.main(["--servers", "tandem", "--tandem-config", str(REPO / "configs" / "demo_cpu.yaml"),
                     "--model", str(tiny_model_dir), "--requests", "6", "--concurrency", "3", "--max-tokens", "5",
                     "--rounds", "2", "--infer-batch", "2", "--start-timeout", "120", "--round-timeout", "120"])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert rc == 0, out
    comp, infer = result["servers"]["tandem"], result["servers"]["tandem /infer"]
    # ignore_eos: 6 prompts x 5 tokens in every round, counted from usage.completion_tokens and token_ids
    assert comp["tokens_per_round"] == [30, 30] and infer["tokens_per_round"] == [30, 30], result
    assert comp["full_length"] and infer["full_length"]
    assert comp["requests_per_s"] > 0 and infer["items_per_s"] > infer["requests_per_s"]  # 2 items per request
    assert 0 < comp["latency_p50_s"] <= comp["latency_p90_s"]
    assert result["ratio_vs_vllm_serve"] == {}  # no vllm serve ran: no ratio is made up
    # the ratio is the quotient of the two measured medians (here /infer over /v1/completions)
    rat = lib.ratios({"vllm_serve": comp, "tandem /infer": infer})
    assert rat == {"tandem /infer": infer["tokens_per_s"] / comp["tokens_per_s"]}
    assert "tandem /infer" in lib.table({"tandem /infer": infer}, rat)


def test_a_short_round_is_flagged_and_summaries_are_medians_over_rounds():
    full = lib.RoundResult("completions", 2.0, 4, 4, 40, 40, [0.1, 0.2, 0.3, 0.4])
    slow = lib.RoundResult("completions", 4.0, 4, 4, 40, 40, [0.2, 0.2, 0.2, 0.2])
    short = lib.RoundResult("completions", 1.0, 4, 4, 39, 40, [0.1] * 4)
    s = lib.summarize([full, slow, short])
    assert s["tokens_per_s"] == 20.0 and s["tokens_per_round"] == [40, 40, 39]  # median of 20, 10, 39
    assert not s["full_length"] and lib.summarize([full, slow])["full_length"]
    assert full.summary()["latency_p50_s"] == pytest.approx(0.25)
    assert full.summary()["latency_p90_s"] == pytest.approx(0.37)


def test_vllm_serve_gets_the_settings_tandem_passes_to_asyncllm(monkeypatch):
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: object())  # vLLM importable: its module
    cmd = bench.vllm_serve_command("/m", 8431, 0.3, 4096, ["--max-num-seqs", "128"])
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1]

    assert flag("--gpu-memory-utilization") == "0.3" and flag("--max-model-len") == "4096"
    assert flag("--generation-config") == "vllm" and flag("--max-num-seqs") == "128" and flag("--dtype") == "bfloat16"
    assert "--enforce-eager" not in cmd
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)  # not importable: the script
    monkeypatch.setattr(bench.shutil, "which", lambda name: "/usr/bin/vllm")
    assert bench.vllm_serve_command("/m", 1, 0.3, 4096, [])[:3] == ["/usr/bin/vllm", "serve", "/m"]
    monkeypatch.setattr(bench.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="PATH"):
        bench.vllm_serve_command("/m", 1, 0.3, 4096, [])
    assert "rollout_server.enforce_eager=false" in bench.tandem_overrides(0.3, 4096, [])


def test_a_server_launched_in_its_own_group_is_health_waited_on_an_empty_200_and_stopped_with_its_children():
    from tests.ports import free_port_block
    from tests.server_proc import _live_members, launch, wait_healthy

    port = free_port_block(1)
    # like vllm serve: a leader that starts a worker process, then answers /health with an empty 200
    code = ("import http.server, subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.send_header('Content-Length', '0'); self.end_headers()\n"
            f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    srv = launch([sys.executable, "-c", code], port, name="fake serve", new_session=True)
    try:
        wait_healthy(srv, 30)
        assert srv.statuses_seen == ["200"]
        deadline = time.monotonic() + 10
        while len(_live_members(srv.proc.pid)) < 2:  # the leader and its worker
            assert time.monotonic() < deadline, "the worker never started"
            time.sleep(0.05)
    finally:
        srv.stop(deadline_s=10)
    assert _live_members(srv.proc.pid) == [], "the worker outlived its server"
