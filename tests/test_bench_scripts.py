"""CPU checks of the GPU bench scripts' pure parts: bench/weight_sync_lib.py, bench_weight_sync.py's server-log
reading and CLI, the scenario runner (bench/run_scenario.py) and the run evidence (bench/run_evidence.py).

The GPU runs themselves happen on lent machines (docs/gpu.md); here: the push order (warm-ups, then the
load paths alternated), per-path medians and the table, the digest check's verdicts against a fake
server (including a fast path that leaves a tensor stale, which only the fast-then-native pair catches),
the exit code, the server overrides as the config loader reads them; every scenario file, the runner's
refusal on a machine without what a scenario needs, its step deadlines and budget, and the run evidence
on fake metrics.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import bench_weight_sync as b  # noqa: E402
import weight_sync_lib as lib  # noqa: E402

GB = 10**9


def test_help_runs_without_a_gpu():
    r = subprocess.run([sys.executable, str(REPO / "bench/bench_weight_sync.py"), "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for flag in ("--weight-load", "--server-gpus", "--tp", "--learner-gpu", "--syncs"):
        assert flag in r.stdout


def test_cli_lists_are_parsed_and_bad_topologies_refused():
    assert lib.parse_modes("fast,native") == ["fast", "native"]
    assert lib.parse_modes(" native ") == ["native"]
    for bad in ("", "fast,fast", "fast,slow"):
        with pytest.raises(ValueError):
            lib.parse_modes(bad)
    assert lib.parse_gpus("0,1") == [0, 1]
    with pytest.raises(ValueError):
        lib.parse_gpus("0,0")
    lib.check_topology([0, 1], 2, 2)
    with pytest.raises(ValueError, match="divide"):
        lib.check_topology([0, 1, 2], 2, 3)
    with pytest.raises(ValueError, match="learner-gpu"):
        lib.check_topology([0, 1], 2, 1)


def test_main_rejects_a_learner_gpu_among_the_server_gpus():
    with pytest.raises(SystemExit) as exc:
        b.main(["--server-gpus", "0,1", "--tp", "2", "--learner-gpu", "1"])
    assert exc.value.code == 2


def test_sync_order_is_a_block_per_path_warm_up_first():
    order = lib.sync_order(["fast", "native"], 3)
    assert order == [("fast", True)] + [("fast", False)] * 3 + [("native", True)] + [("native", False)] * 3
    assert lib.sync_order(["native"], 2) == [("native", True), ("native", False), ("native", False)]


def test_server_overrides_read_back_through_the_config_loader():
    from common.config.load import load_config

    ov = lib.server_overrides("/tmp/m", 8123, 0.35, [0, 1], 2, 2)
    cfg = load_config(REPO / "configs/gpu/split_1p1.yaml", ov)
    srv = cfg.rollout_server
    assert (srv.gpus, srv.tensor_parallel_size, srv.port, srv.load_format) == ([0, 1], 2, 8123, "dummy")
    assert cfg.learner.gpus == [2] and cfg.model.path == "/tmp/m"
    cfg = load_config(REPO / "configs/gpu/split_1p1.yaml", lib.server_overrides("/tmp/m", 8123, 0.35, [0], 1, 1))
    assert cfg.rollout_server.gpus == [0] and cfg.learner.gpus == [1]


def test_raw_broadcast_puts_rank_0_on_the_learner_gpu_and_one_rank_per_server_gpu():
    assert lib.raw_ranks(1, [0]) == [(0, 1), (1, 0)]
    assert lib.raw_ranks(2, [0, 1]) == [(0, 2), (1, 0), (2, 1)]


def _rec(mode, warm, wire, total=None, ver=1):
    return {"mode": mode, "warmup": warm, "ver": ver, "prep_s": 0.04, "fence_s": 0.02, "wire_s": wire, "commit_s": 0.01,
            "total_s": total if total is not None else wire + 0.05, "server_update_s": wire - 0.01, "bytes": 2 * GB,
            "load_path": mode, "rpc_s": wire - 0.002, "worker_s": wire - 0.003, "gpu_s": wire - 0.004}


RAW = {"single_s": {"gb_s": 400.0, "median_s": 0.005, "best_s": 0.005},
       "chunked_s": {"gb_s": 200.0, "median_s": 0.01, "best_s": 0.01}}


def test_mode_stats_are_medians_of_the_timed_pushes_per_path():
    records = [_rec("fast", True, 3.0), _rec("native", True, 9.0),
               _rec("fast", False, 0.02), _rec("native", False, 0.2),
               _rec("fast", False, 0.01), _rec("native", False, 0.1),
               _rec("fast", False, 0.04), _rec("native", False, 0.3)]
    s = lib.mode_stats(records, 2 * GB, RAW)
    assert list(s) == ["fast", "native"]
    assert s["fast"]["n"] == 3 and s["fast"]["median"]["wire_s"] == pytest.approx(0.02)
    assert s["native"]["median"]["wire_s"] == pytest.approx(0.2)
    assert s["fast"]["warmup"]["wire_s"] == 3.0  # warm-ups are kept apart, not in the medians
    assert s["fast"]["sync_gb_s"] == pytest.approx(100.0)
    assert s["fast"]["vs_raw_single"] == pytest.approx(0.25) and s["fast"]["vs_raw_chunked"] == pytest.approx(0.5)
    assert s["native"]["sync_gb_s"] == pytest.approx(10.0)
    assert s["fast"]["median"]["gpu_s"] == pytest.approx(0.016)  # the data plane alone, GPU-timed
    assert s["fast"]["data_gb_s"] == pytest.approx(125.0) and s["fast"]["data_vs_raw_chunked"] == pytest.approx(0.625)
    assert "vs_raw_single" not in lib.mode_stats(records, 2 * GB, None)["fast"]
    no_gpu = [{**r, "gpu_s": None} for r in records]  # e.g. the hf engine: no GPU timing in its reply
    assert "data_gb_s" not in lib.mode_stats(no_gpu, 2 * GB, RAW)["fast"]


class FakeServer:
    """Served weights as a dict; ``stale`` = a tensor the fast path skips, ``garble`` = one it writes wrong."""

    def __init__(self, workers=2, stale=None, garble=None, defer_fast=0):
        self.served: dict[str, float] = {}
        self.ver, self.workers, self.stale, self.garble = 0, workers, stale, garble
        self.defer_fast = defer_fast  # fast pushes that run native first (a dummy-loaded vLLM's deferral)
        self.weights = {"a": 1.0, "b": 2.0, "c": 3.0}
        self.log: list[str] = []

    def perturb(self):
        self.weights = {k: v + 0.5 for k, v in self.weights.items()}

    def push(self, mode):
        if mode == "fast" and self.defer_fast:
            self.defer_fast -= 1
            mode = "native"
        for k, v in self.weights.items():
            if mode == "fast" and k == self.stale:
                continue
            self.served[k] = v + (100.0 if mode == "fast" and k == self.garble else 0.0)
        self.ver += 1
        self.log.append(mode)
        return {**_rec(mode, False, 0.1), "ver": self.ver}

    def digest(self):
        text = json.dumps(sorted(self.served.items()))
        return {"engine": "fake", "ver": self.ver,
                "digests": [hashlib.sha256(f"{w}{text}".encode()).hexdigest()[:16] for w in range(self.workers)]}


def test_run_pushes_alternates_and_a_correct_fast_path_passes_the_digest_check():
    srv = FakeServer()
    res = lib.run_pushes(srv.push, srv.perturb, srv.digest, ["fast", "native"], 2)
    assert [r["mode"] for r in res["records"]] == ["fast"] * 3 + ["native"] * 3
    assert [r["warmup"] for r in res["records"]] == [True, False, False, True, False, False]
    assert res["records"][0]["first"] and not res["records"][1]["first"]
    d = res["digest"]
    assert [s["mode"] for s in d["steps"]] == ["fast", "native", "native", "fast"]
    assert srv.log[-4:] == ["fast", "native", "native", "fast"]
    assert d["digest_equal"] and d["changes_with_weights"] and d["changes_on_every_worker"] and d["ok"]
    assert lib.digest_verdict(d) == "equal"


def test_a_deferred_fast_warm_up_is_repeated_until_the_fast_path_runs():
    srv = FakeServer(defer_fast=2)
    res = lib.run_pushes(srv.push, srv.perturb, srv.digest, ["fast", "native"], 2)
    recs = res["records"]
    assert [(r["mode"], r["load_path"], r["warmup"]) for r in recs[:4]] == [
        ("fast", "native", True), ("fast", "native", True), ("fast", "fast", True), ("fast", "fast", False)]
    assert all(r["load_path"] == r["mode"] for r in recs if not r["warmup"])
    assert lib.fast_effective(recs, res["digest"], {"fast_refused": 0})
    never = FakeServer(defer_fast=99)  # the fast path never ran: give up after WARMUP_TRIES, then it shows
    res = lib.run_pushes(never.push, never.perturb, never.digest, ["fast", "native"], 1)
    assert sum(r["warmup"] and r["mode"] == "fast" for r in res["records"]) == lib.WARMUP_TRIES
    assert not lib.fast_effective(res["records"], res["digest"], {"fast_refused": 0})


def test_a_fast_path_that_leaves_a_tensor_stale_is_caught_by_the_fast_then_native_pair():
    srv = FakeServer(stale="b")
    d = lib.run_pushes(srv.push, srv.perturb, srv.digest, ["fast", "native"], 1)["digest"]
    assert not d["fast_then_native_equal"]  # fast left "b" from the previous weights; native then loaded it
    assert d["native_then_fast_equal"]  # the pair the brief sketches alone would not see it
    assert not d["digest_equal"] and not d["ok"] and lib.digest_verdict(d) == "MISMATCH"


def test_a_fast_path_that_writes_wrong_values_fails_both_pairs():
    srv = FakeServer(garble="c")
    d = lib.run_pushes(srv.push, srv.perturb, srv.digest, ["fast", "native"], 1)["digest"]
    assert not d["fast_then_native_equal"] and not d["native_then_fast_equal"] and not d["ok"]


def test_digest_route_errors_and_ver_mismatches_are_reported_not_raised():
    srv = FakeServer()

    def missing():
        raise RuntimeError("GET /sync/digest -> 404")

    d = lib.run_pushes(srv.push, srv.perturb, missing, ["fast", "native"], 1)["digest"]
    assert d["ok"] is False and "404" in d["error"] and lib.digest_verdict(d) == "ERROR"
    d = lib.run_pushes(srv.push, srv.perturb, lambda: {**srv.digest(), "ver": 0}, ["fast", "native"], 1)["digest"]
    assert d["ok"] is False and "ver" in d["error"]
    # one path only: no digest check (nothing to compare)
    assert lib.run_pushes(srv.push, srv.perturb, srv.digest, ["native"], 1)["digest"] is None


def test_server_log_lines_and_fast_effectiveness():
    text = "\n".join([
        "2026 INFO [rollout_server 1] rollout_server.engines.vllm.engine: fast update: 680 tensors, 2.05 GB, 4 chunks: ...",
        "2026 INFO [rollout_server 1] rollout_server.engines.vllm.engine: nccl update: 680 tensors, 2.05 GB: ...",
        "2026 INFO [rollout_server 1] uvicorn: GET /health 200",
    ])
    lines = b.server_log_lines(text)
    assert lines == ["fast update: 680 tensors, 2.05 GB, 4 chunks: ...", "nccl update: 680 tensors, 2.05 GB: ..."]
    counts = b.log_counts(lines)
    assert counts == {"fast": 1, "native": 1, "fast_refused": 0}
    records = [{"mode": "fast", "warmup": False, "load_path": "fast"},
               {"mode": "native", "warmup": False, "load_path": "native"}]
    digest = {"steps": [{"mode": "fast", "load_path": "fast"}, {"mode": "native", "load_path": "native"}]}
    assert lib.count_fast_pushes(records, digest) == 2
    assert lib.fast_effective(records, digest, counts)
    assert not lib.fast_effective(records, {"steps": [{"mode": "fast", "load_path": "native"}]}, counts)
    assert not lib.fast_effective([{**records[0], "load_path": None}], None, counts)  # no reply: not shown
    refused = b.log_counts(b.server_log_lines("x vllm: fast weight load refused (tied)\nx vllm: fast update: 1"))
    assert not lib.fast_effective(records, digest, refused)


def _result(digest_ok=True, fast_effective=True):
    srv = FakeServer(stale=None if digest_ok else "a")
    res = lib.run_pushes(srv.push, srv.perturb, srv.digest, ["fast", "native"], 2)
    return {"preset": "0.5b", "tp": 1, "bytes": 2 * GB, "chunks": 4, "raw": RAW, "fast_effective": fast_effective,
            "modes": lib.mode_stats(res["records"], 2 * GB, RAW), "digest": res["digest"]}


def test_table_has_one_row_per_preset_and_path_and_flags_problems():
    rows = lib.table([_result(), {**_result(), "preset": "7b", "tp": 2}]).splitlines()
    assert len(rows) == 2 + 4
    assert rows[2].startswith("| 0.5b | 1 | 2.00 | 4 | fast | 0.040 | 0.020 |")  # prep, then fence
    assert rows[3].startswith("| 0.5b | 1 | 2.00 | 4 | native |")
    assert rows[4].startswith("| 7b | 2 |")
    assert all(r.rstrip().endswith("| equal |") for r in rows[2:])
    assert all(len(r.split("|")) == len(rows[0].split("|")) for r in rows)
    bad = lib.table([_result(digest_ok=False, fast_effective=False)])
    assert "MISMATCH" in bad and "REFUSED" in bad


def test_exit_code_is_non_zero_on_a_digest_mismatch_or_a_refused_fast_path(monkeypatch, tmp_path):
    out = tmp_path / "r.json"
    for result, code in ((_result(), 0), (_result(digest_ok=False), 2), (_result(fast_effective=False), 1)):
        monkeypatch.setattr(b, "bench_preset", lambda preset, args, tmp, r=result: r)
        assert b.main(["--presets", "0.5b", "--out", str(out)]) == code
        assert json.loads(out.read_text())[0]["preset"] == "0.5b"
    assert lib.run_ok(_result(), ["native"]) == []  # one path: no digest check owed

    def boom(preset, args, tmp):
        raise RuntimeError("server exited 3")

    monkeypatch.setattr(b, "bench_preset", boom)
    assert b.main(["--presets", "0.5b", "--out", str(out)]) == 1


# ------------------------------------------------------------------------------------ scenarios

import run_scenario as rs  # noqa: E402

REFERENCE = re.compile(r"(?:bench|configs|tests|tools)/[\w./-]+\.(?:py|yaml|sh)")


@pytest.mark.parametrize("name", rs.names())
def test_every_scenario_loads_and_names_only_files_that_exist(name):
    sc = rs.load(name)
    assert sc.what and sc.steps and sc.minutes > 0, name
    text = (rs.SCENARIOS / f"{name}.yaml").read_text()
    missing = [ref for ref in REFERENCE.findall(text) if not (REPO / ref).exists()]
    assert not missing, f"{name}.yaml names files that do not exist: {missing}"
    env = rs.environment(sc, {}, Path("/tmp/out"), [])
    for step, command, _, _ in rs.plan(sc, env):
        r = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"{name}.yaml, step {step}: {r.stderr}"


def test_the_list_names_every_scenario_with_its_machine():
    r = subprocess.run([sys.executable, str(REPO / "bench/run_scenario.py"), "--list"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    for name in rs.names():
        sc = rs.load(name)
        assert f"| {name} | {sc.gpus} | {'yes' if sc.vllm else 'no'} |" in r.stdout


def test_a_scenario_is_refused_with_what_the_machine_lacks():
    sc = rs.load("train-split-2p2")
    why = rs.refusal(sc, (1, "nvidia-smi -L lists 1"), has_vllm=False)
    assert "needs 4 GPU(s), this machine has 1 (nvidia-smi -L lists 1)" in why and "vLLM importable" in why
    assert rs.refusal(sc, (4, ""), has_vllm=True) is None
    if rs.gpu_count()[0] == 0:  # the CPU box: the CLI refuses before running anything
        r = subprocess.run([sys.executable, str(REPO / "bench/run_scenario.py"), "weight-sync-nccl"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "needs 2 GPU(s), this machine has 0" in r.stderr, r.stderr


def test_unknown_scenarios_params_and_keys_are_refused(tmp_path, monkeypatch):
    assert rs.main(["no-such-scenario"]) == 2
    assert rs.main(["train-split-2p2", "--set", "NO_SUCH=1", "--dry-run"]) == 2
    monkeypatch.setattr(rs, "SCENARIOS", tmp_path)
    (tmp_path / "bad.yaml").write_text("what: x\nneeds: {gpus: 0}\nminutes: 1\nsteps: [{name: a, run: b}]\nextra: 1\n")
    with pytest.raises(rs.ScenarioError, match="unknown key 'extra'.*missing key 'deadline_s'"):
        rs.load("bad")


def test_the_2p2_scenario_runs_the_split_config_with_fast_load_and_for_each_expands_a_step(capsys):
    assert rs.main(["train-split-2p2", "--set", "STEPS=7", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "python3 -m launcher --config configs/gpu/split_2p2.yaml training.max_steps=$STEPS" in out
    for arg in ("rollout_server.weight_load=fast", "training.output_dir=runs/bench-2p2", "--grace-s 20",
                "bench/run_evidence.py --json $OUT/evidence.json runs/bench-2p2"):
        assert arg in out, arg
    sc = rs.load("sweep-b-ratio")
    steps = rs.plan(sc, rs.environment(sc, {"B_RATIOS": "0.1, 0.3"}, Path("/tmp/o"), []))
    names = [s[0] for s in steps if not s[0].startswith("asset ")]
    assert names == ["b_ratio 0.1", "b_ratio 0.3"] and steps[-1][1].startswith("ITEM=0.3\n")


def test_a_step_logs_both_streams_and_its_exit_code_and_honours_deadline_and_budget(tmp_path):
    log = rs.Log(tmp_path / "scenario.log", None)
    env = {**os.environ}
    assert rs.run_step(log, "ok", "echo to-stdout; echo to-stderr >&2; exit 3", 20, env) == 3
    assert rs.run_step(log, "slow", "sleep 30", 1, env, kill_after_s=2) == 124
    text = (tmp_path / "scenario.log").read_text()
    assert "to-stdout" in text and "to-stderr" in text and "ok -> rc=3" in text and "slow -> rc=124" in text
    tight = rs.Log(tmp_path / "tight.log", budget_s=10)
    assert rs.run_step(tight, "skipped", "true", 60, env) is None
    assert "skipped SKIPPED" in (tmp_path / "tight.log").read_text()


def _write_run(run: Path, overlap: bool) -> None:
    run.mkdir(parents=True)
    lines = []
    for s in range(8):
        r = {"global_step": s + 1, "stage2_ab/async/step_kind_b": s % 2, "stage2_ab/async/ver_current": s // 2 + 1,
             "time/sync_stall": 0.0, "time/forward_backward": 0.2, "sync/failures": 0}
        if overlap:
            r.update({"sync/started": int(s % 2 == 0), "sync/in_flight": int(s % 2 == 0),
                      "time/sync_stall": 0.01 if s % 2 == 0 else 0.002})
        elif s % 2 == 0:
            r.update({"time/sync_total": 1.5, "time/sync_stall": 9.0 if s == 0 else 1.5})
        lines.append(json.dumps(r))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n{\"torn")
    (run / "logs").mkdir()
    (run / "logs/learner.log").write_text("x learner.sync.nccl: weights synced to http://h over NCCL: ver 4\n")


def test_the_run_evidence_scenario_prints_the_stall_comparison_and_writes_the_figures(tmp_path):
    _write_run(tmp_path / "runs/blocking", overlap=False)
    _write_run(tmp_path / "runs/overlap", overlap=True)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(REPO / "bench/run_scenario.py"), "run-evidence", "--out", str(out), "--",
                        str(tmp_path / "runs/blocking"), str(tmp_path / "runs/overlap")],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (out / "scenario.log").read_text()
    assert "[blocking] blocking: records 8, optimizer steps 8, B steps 4" in log
    assert "[overlap] overlap:" in log
    assert "blocking 1.5s (blocking) vs overlap 0.01s (overlap)" in log  # the first sync is left out
    assert "weights synced to http://h over NCCL: ver 4" in log
    ev = json.loads((out / "evidence.json").read_text())
    assert ev["blocking"]["sync_stall_sync_steps"]["max"] == 9.0
    assert ev["overlap"]["vers"] == [1, 2, 3, 4] and ev["overlap"]["ver_monotonic"]


def test_bundle_cuts_logs_to_their_last_lines(tmp_path, monkeypatch):
    import tarfile

    run = tmp_path / "r"
    (run / "logs").mkdir(parents=True)
    (run / "logs/a.log").write_text("".join(f"{i}\n" for i in range(5000)))
    (run / "summary.json").write_text("{}")
    (run / "model.safetensors").write_bytes(b"0" * 10)
    target = rs.bundle(tmp_path, [str(run)], {})
    with tarfile.open(target) as tar:
        members = {m.name: m for m in tar.getmembers()}
        log = next(n for n in members if n.endswith("logs/a.log"))
        lines = tar.extractfile(log).read().decode().splitlines()
    assert len(lines) == 3000 and lines[-1] == "4999"
    assert any(n.endswith("summary.json") for n in members) and not any(n.endswith(".safetensors") for n in members)


def test_config_only_model_dirs_name_their_architecture(tmp_path):
    """vLLM picks the model class from config.json's ``architectures``; without it, it resolved a
    pooling adapter whose loader clones every weight (the fast load path was refused on the bench)."""
    out = b.build_config_dir("0.5b", tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert not list(out.glob("*.safetensors"))  # config, tokenizer and processor only


def test_compare_runs_reports_waiting_and_b_throughput_against_the_first_run(tmp_path):
    from bench.compare_runs import compare, main

    K = "stage2_ab/async/"

    def write(name, steps):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, **r}) + "\n" for i, r in enumerate(steps)))
        return d

    a = {K + "step_kind_b": 0, "time/step": 1.0, "time/wait_for_packs": 0.0}
    fast = write("async", [a, {K + "step_kind_b": 1, "time/step": 1.0, "time/wait_for_packs": 0.0,
                               "packing/segments": 6, "packing/tokens": 3000}])
    slow = write("step", [a, {K + "step_kind_b": 1, "time/step": 3.0, "time/wait_for_packs": 2.0,
                              "packing/segments": 6, "packing/tokens": 3000}])
    out = compare([fast, slow])
    f, s = out[str(fast)], out[str(slow)]
    assert (f["train_s"], f["b_steps"], f["b_samples"], f["wait_fraction"]) == (2.0, 1, 6, 0.0)
    assert (s["train_s"], s["wait_for_rollouts_s"], s["wait_fraction"]) == (4.0, 2.0, 0.5)
    assert s["b_samples_rate_vs_first"] == 0.5 and s["steps_rate_vs_first"] == 0.5
    assert main([str(fast), str(tmp_path / "missing")]) == 1  # a run without records is an error


@pytest.mark.slow
def test_the_overload_soak_quick_run_balances_its_books_and_the_actor_exits_on_the_learners_done(tmp_path):
    """bench/bench_soak.py --quick: a fast actor and a credit-ignoring peer against a learner rank's ready queue."""
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(REPO / "bench/bench_soak.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=180, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["conservation"] == {"learner": True, "actor": True}
    q = res["learner"]["queue"]
    assert q["oldest_dropped"] > 0 and q["trained"] > 0  # overloaded: the queue dropped, and it kept training
    assert res["actor"]["exit"] == 0 and res["actor"]["exit_after_learner_s"] < 10  # on the learner's done
    for name in ("learner", "actor", "flood"):
        p = res["processes"][name]
        assert {"rss_mb", "threads", "fds", "sockets"} <= set(p) and p["rss_mb"]["end"] > 0, name


@pytest.mark.parametrize("env, says", [
    ({"STAGE": "warm", "WS_CURRICULUM": "800:3:0.25/0.6,800:x"}, "WS_CURRICULUM stage '800:x': not STEPS:MAX_OBJECTS"),
    ({"STAGE": "warm", "WS_FROM": "/nonexistent/det"}, "WS_FROM=/nonexistent/det: no config.json there. Fix:"),
    ({"STAGE": "later"}, "STAGE=later: one of all, warm, bench"),
    ({"STAGE": "warm", "TASK": "sparse"}, "TASK=sparse: one of crowded"),
    ({"STAGE": "warm", "SCORE_PORT": "87x0"}, "SCORE_PORT=87x0: not a port. Fix:"),
    ({"STAGE": "warm", "SCORE_PORT": "80"}, "SCORE_PORT=80: not a port. Fix:"),
    ({"STAGE": "warm", "WS_SAVE_S": "45s"}, "WS_SAVE_S=45s: not a whole number of seconds. Fix:"),
])
def test_the_gpu_quality_script_refuses_a_bad_knob_before_any_stage_runs(tmp_path, env, says):
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(REPO / "bench/gpu_quality_seeds.sh")], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env={**os.environ, **env, "OUT": str(out)})
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert not out.exists(), "refused before the first stage: no output folder, no stale warm start copied into it"


def test_the_gpu_quality_script_draws_the_task_it_is_given(tmp_path):
    """TASK=dense: the warm start's data (and so the arms') are 1..10 shapes of 12-35 % of the side, under WORK. The
    script is stopped once its data stage has drawn them (the warm start after it runs for minutes on a CPU)."""
    import signal
    import time

    work, out = tmp_path / "work", tmp_path / "out"
    env = {**os.environ, "STAGE": "warm", "TASK": "dense", "SIDES": "112", "N_TRAIN": "6", "VAL_IMAGES": "4",
           "WORK": str(work), "OUT": str(out), "TOTAL_S": "120"}
    proc = subprocess.Popen(["bash", str(REPO / "bench/gpu_quality_seeds.sh")], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    manifest = work / "data" / "dense" / "manifest.json"
    try:
        deadline = time.monotonic() + 150
        while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert manifest.exists(), (out / "log.txt").read_text()[-3000:] if (out / "log.txt").exists() else "no log"
    finally:  # every process of the script's session (its `timeout` stages run in process groups of their own),
        for _ in range(20):  # again until none is left: the script may start the next stage meanwhile
            ps = subprocess.run(["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True).stdout.split()
            left = [int(p) for p, sid in zip(ps[::2], ps[1::2]) if int(sid) == proc.pid]
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        proc.wait(timeout=30)
    time.sleep(0.5)  # the manifest is written last
    params = json.loads(manifest.read_text())["params"]
    assert (params["max_objects"], params["size_range"], params["sides"]) == (10, [0.12, 0.35], [112]), params
    assert params["n_train"] == 6 and not (work / "data" / "crowded").exists()
