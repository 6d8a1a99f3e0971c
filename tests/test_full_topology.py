"""The whole topology, as `make demo` runs it but shorter: launcher → rollout server (hf engine),
two actors, `torchrun --nproc_per_node=2` learner on gloo. Asserts invariants from the run's own
metrics, then that every process exited 0 and none is left behind. Mid-run, a second sync client sends
a malformed commit (issue 29): the run's later syncs commit and its B steps go on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from common.packing.schedule import wants_b
from tests.ports import free_port_block

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 420


def _config(tmp_path: Path, model_dir: Path, data_dir: Path) -> tuple[Path, dict]:
    """The demo config on ``model_dir`` (the warm-started test detector) and ``data_dir``, evaluated at both
    ends, in the specified blocking sync mode behind the demo's abort fence, syncing every 2 steps."""
    cfg = yaml.safe_load((REPO / "configs/demo_cpu.yaml").read_text())
    http = free_port_block(1)
    zmq = free_port_block(4)
    cfg["model"]["path"] = str(model_dir)
    cfg["data"].update(train_jsonl=str(data_dir / "train.jsonl"), val_jsonl=str(data_dir / "val.jsonl"))
    cfg["training"]["eval_every_steps"] = 0
    cfg["weight_sync"].update(mode="blocking", every_steps=2)  # the demo syncs every 24
    cfg["training"].update(output_dir=str(tmp_path / "run"), max_steps=12, save_every_steps=0)
    cfg["rollout_matching"]["vllm"]["servers"] = [{"base_url": f"http://127.0.0.1:{http}"}]
    cfg["rollout_matching"]["decoding"]["max_new_tokens"] = 48
    cfg["rollout_server"]["port"] = http
    cfg["transport"]["base_port"] = zmq
    # B steps must happen in a short run: a wanted B step may wait (bounded) for its packs.
    cfg["learner"]["pack_wait_s"] = 20.0
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


class SecondSyncClient(threading.Thread):
    """Once the run has committed two syncs, a second client opens a session, closes the fence, and sends
    a commit that fails validation (``n_buckets: "x"``); ``result`` holds the answer and the ver then."""

    def __init__(self, url: str, deadline_s: float = DEADLINE_S) -> None:
        super().__init__(daemon=True)
        self.url, self.deadline, self.result = url, time.monotonic() + deadline_s, {}

    def run(self) -> None:
        from learner.weight_sync.session import SyncError
        from learner.weight_sync.http import HttpWeightSender

        while time.monotonic() < self.deadline:
            time.sleep(0.2)
            try:
                if httpx.get(self.url + "/health", timeout=5).json()["ver"] < 2:
                    continue
                session = HttpWeightSender(self.url, client_id="intruder", timeout_s=60).open()
            except (httpx.HTTPError, SyncError, KeyError, ValueError):
                continue  # not up yet, or the learner holds the session: try again
            try:
                session.begin("abort")
            except SyncError:
                session.abort("begin failed")
                continue
            r = httpx.post(self.url + "/sync/commit", json={"session": session.id, "n_buckets": "x"}, timeout=30)
            self.result = {"status": r.status_code, "message": r.json().get("message", r.text),
                           "ver": httpx.get(self.url + "/health", timeout=5).json()["ver"]}
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_full_topology_trains_b_steps_within_the_window_and_exits_cleanly(tmp_path, tiny_detector_dir,
                                                                         detector_data_dir):
    path, cfg = _config(tmp_path, tiny_detector_dir, detector_data_dir)
    run = Path(cfg["training"]["output_dir"])
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "--config", str(path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    intruder = SecondSyncClient(f"http://127.0.0.1:{cfg['rollout_server']['port']}")
    intruder.start()
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"launcher did not finish within {DEADLINE_S} s; output tail:\n{out[-4000:]}")
    assert proc.returncode == 0, f"launcher exited {proc.returncode}:\n{out[-6000:]}"

    # Every process exited 0 and none is left behind (torchrun workers included: the groups are empty).
    record = json.loads((run / "processes.json").read_text())
    assert {p["name"]: p["returncode"] for p in record["processes"]} == {
        "rollout_server": 0, "learner": 0, "actor_r0_0": 0, "actor_r1_0": 0}
    for p in record["processes"]:
        assert not _alive(p["pid"]), f"{p['name']} (pid {p['pid']}) is still running"
        with pytest.raises(ProcessLookupError):
            os.killpg(p["pid"], 0)

    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r.get("record", "step") == "step"]  # evaluation records share the file
    steps = cfg["training"]["max_steps"]
    assert [r["step"] for r in recs] == list(range(steps)), "one metrics record per optimizer step"
    window = cfg["stage2_ab"]["channel_b"]["async"]["version_window"]
    b_ratio = cfg["stage2_ab"]["schedule"]["b_ratio"]
    K = "stage2_ab/async/"

    # B steps happened, and every trained pack's ver was inside the window at its step.
    b_recs = [r for r in recs if r[K + "step_kind_b"]]
    assert b_recs, "no B step ran"
    for r in b_recs:
        for rank_vers in r[K + "trained_pack_vers"]:
            assert rank_vers, "a B step trained no pack on some rank"
            for v in rank_vers:
                assert r[K + "ver_current"] - window <= v <= r[K + "ver_current"], (r["step"], v)

    # The realised B steps are exactly the schedule's wanted steps minus the logged skips.
    for r in recs:
        assert r[K + "policy_wants_b"] == int(wants_b(r["step"], b_ratio))
        assert r[K + "step_kind_b"] == (r[K + "policy_wants_b"] and not r[K + "b_step_skipped_due_to_queue"])
        assert set(r[K + "kinds_by_rank"]) == {"B" if r[K + "step_kind_b"] else "A"}
    wanted = sum(r[K + "policy_wants_b"] for r in recs)
    skipped = sum(r[K + "b_step_skipped_due_to_queue"] for r in recs)
    assert len(b_recs) == wanted - skipped

    # ver advanced exactly once per committed sync, and only rank 0 talked to the server.
    syncs = 0
    for prev, cur in zip(recs, recs[1:]):
        syncs_here = cur.get("sync/successes", 0) - prev.get("sync/successes", 0)
        assert cur[K + "ver_current"] - prev[K + "ver_current"] == syncs_here, cur["step"]
        syncs += syncs_here
    assert syncs >= 1
    assert all(calls == 0 for r in recs for calls in r["sync/client_calls_by_rank"][1:])

    # Conservation on every rank at every step (learner side) and at the end (actor side).
    for r in recs:
        for rank in range(cfg["learner"]["nproc_per_node"]):
            q = {k.rsplit("/", 1)[1]: v for k, v in r.items() if k.startswith(f"queue/rank{rank}/")}
            assert q["received"] == (q["trained"] + q["stale_dropped"] + q["oldest_dropped"] + q["duplicate_dropped"]
                                     + q["reserved"] + q["in_queue"]), (r["step"], rank, q)
    for actor_file in sorted(run.glob("actor_rank*_*.jsonl")):
        if actor_file.name.endswith(".ledger.jsonl"):
            continue
        last = json.loads(actor_file.read_text().splitlines()[-1])
        assert last["actor/conservation_ok"] == 1, actor_file.name

    # A second sync client's commit that failed validation mid-run ended its own session at once (issue 29):
    # the learner's syncs after it committed, and B steps trained on the weights they pushed.
    intruder.join(timeout=30)
    assert intruder.result.get("status") == 422 and "sync session aborted" in intruder.result["message"], \
        (intruder.result, out[-3000:])
    v0 = intruder.result["ver"]
    assert recs[-1][K + "ver_current"] >= v0 + 2, (v0, recs[-1][K + "ver_current"])
    assert any(r[K + "ver_current"] > v0 for r in b_recs), f"no B step after the intrusion at ver {v0}"

    assert "tandem run summary" in out and (run / "run.png").exists()
    # The summary's final ver is the final checkpoint's (the server's), one commit per ver from 0.
    summary = json.loads((run / "summary.json").read_text())
    state = json.loads((run / "checkpoints" / str(steps) / "trainer_state.json").read_text())
    assert summary["ver_final"] == state["ver"] >= recs[-1][K + "ver_current"]
    assert summary["syncs"] == state["sync_counts"]["sync/successes"] == state["ver"]

    # The warm-started detector was evaluated at the start (the first push) and on the final weights
    # (pushed after the last step: the final checkpoint's ver), and the summary prints both.
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert [e["step"] for e in evals] == [0, steps], evals
    assert evals[0]["eval/ver_requested"] == 1 <= evals[0]["eval/ver"] and evals[-1]["eval/ver"] == state["ver"]
    assert all(e["eval/n_images"] == 16 and e["eval/parse_failure_rate"] < 0.5 for e in evals), evals
    assert "val F1@0.5 / mAP" in out and summary["eval"]["last"]["step"] == steps

    # Every key the run emitted is documented in docs/metrics.md (per-rank keys as rank{r}).
    import re

    doc = (REPO / "docs/metrics.md").read_text()
    emitted = {re.sub(r"rank\d+", "rank{r}", k) for r in recs for k in r} - {"step"}
    undocumented = sorted(k for k in emitted if f"`{k}`" not in doc)
    assert not undocumented, f"add these keys to docs/metrics.md: {undocumented}"


def _start_launcher(path: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher", "--config", str(path), "--grace-s", "15"], cwd=REPO,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(predicate, what: str, deadline_s: float, log: Path) -> None:
    import time

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.5)
    pytest.fail(f"waited {deadline_s:.0f} s for {what}; launcher output:\n{log.read_text()[-4000:]}")


def _started_pids(log: Path) -> dict[str, int]:
    import re

    return {m.group(1): int(m.group(2)) for m in re.finditer(r"started (\S+) \(pid (\d+)\)", log.read_text())}


def _assert_no_orphans(pids: dict[str, int]) -> None:
    for name, pid in pids.items():
        assert not _alive(pid), f"{name} (pid {pid}) survived the teardown"
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # its whole group (torchrun workers) is gone


@pytest.mark.slow
def test_a_killed_actor_is_restarted_and_ctrl_c_then_tears_everything_down_without_orphans(tmp_path, tiny_model_dir,
                                                                                          synth_data_dir):
    """One run covers both: a killed actor comes back (launcher.max_actor_restarts) while the run goes on,
    then Ctrl-C ends the whole topology (exit 130) and no process of it (the dead actor, its successor,
    the torchrun workers) is left."""
    path, cfg = _config(tmp_path, tiny_model_dir, synth_data_dir)
    cfg_over = yaml.safe_load(path.read_text())
    cfg_over["training"]["max_steps"] = 10_000  # it must still be running when the events come
    # Not what this test is about, and each costs wall time: the start-up evaluation before the first step, and
    # the actors' 10 s (actor.stop_timeout_s) of trying to hand their last packs to the learner Ctrl-C stopped.
    cfg_over["data"]["val_jsonl"] = None
    cfg_over["actor"] = {**cfg_over.get("actor", {}), "stop_timeout_s": 2.0}
    path.write_text(yaml.safe_dump(cfg_over))
    run, log = Path(cfg["training"]["output_dir"]), tmp_path / "launcher.log"
    proc = _start_launcher(path, log)
    try:
        _wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size > 0,
                  "the first optimizer step", 240, log)
        pids = _started_pids(log)
        assert set(pids) == {"rollout_server", "learner", "actor_r0_0", "actor_r1_0"}
        os.kill(pids["actor_r1_0"], signal.SIGKILL)
        _wait_for(lambda: _started_pids(log)["actor_r1_0"] != pids["actor_r1_0"], "the actor's restart", 60, log)
        assert proc.poll() is None, "the run ended with the actor"
        os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert rc == 130 and "interrupted" in out, out[-3000:]
    assert "actor_r1_0 exited with -9" in out and "actor_r1_0 restarted (restart 1 of 3)" in out
    pids["actor_r1_0 (restarted)"] = _started_pids(log)["actor_r1_0"]
    _assert_no_orphans(pids)
