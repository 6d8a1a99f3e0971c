"""A learner on two "nodes" of one machine: two launchers (``launcher.node_rank=0`` and ``=1``) on loopback, one
learner rank each, joined by torchrun's static rendezvous; node 0 also runs the rollout server (hf engine).
Asserts that rank r ran on node r, that both ranks trained B packs their own node's actor sent, that the
run's files were written once (global rank 0) into the shared output_dir, and that both nodes exited 0.
The config rules of the multi-node keys are in tests/test_config.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.ports import free_port_block

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 300


def _config(tmp_path: Path, model_dir: Path, data_dir: Path) -> tuple[Path, dict]:
    cfg = yaml.safe_load((REPO / "configs/demo_cpu.yaml").read_text())
    base = free_port_block(6)  # one block: the server, the rendezvous and 2 ranks' pack/credit ports never collide
    http, rdzv, zmq = base, base + 1, base + 2
    cfg["model"]["path"] = str(model_dir)
    cfg["data"].update(train_jsonl=str(data_dir / "train.jsonl"), val_jsonl=None)
    cfg["training"].update(output_dir=str(tmp_path / "run"), max_steps=6, save_every_steps=0, eval_every_steps=0)
    cfg["rollout_matching"]["vllm"]["servers"] = [{"base_url": f"http://127.0.0.1:{http}"}]
    cfg["rollout_matching"]["decoding"]["max_new_tokens"] = 48
    cfg["rollout_server"]["port"] = http
    cfg["transport"]["base_port"] = zmq
    # The knobs this test relies on, pinned (the demo's own move with its benchmarks): B every second step,
    # a sync every 2 steps, packs released at half fill.
    cfg["stage2_ab"]["schedule"]["b_ratio"] = 0.5
    cfg["stage2_ab"]["channel_b"]["rollout_decode_batch_size"] = 2
    cfg["stage2_ab"]["channel_b"]["async"].update(version_window=2)
    cfg["weight_sync"].update(mode="blocking", every_steps=2)
    cfg["training"]["packing_min_fill_ratio"] = 0.5
    # Two nodes of one rank each; B steps must happen in a short run: a wanted B step may wait for its packs.
    cfg["learner"].update(nproc_per_node=1, nnodes=2, rdzv_endpoint=f"127.0.0.1:{rdzv}",
                          node_hosts=["127.0.0.1", "127.0.0.1"], pack_wait_s=20.0, collective_timeout_s=120.0)
    cfg["weight_sync"]["timeout_s"] = 60.0
    path = tmp_path / "two_nodes.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def _launch(path: Path, node: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher", "--config", str(path), f"launcher.node_rank={node}",
                             "--grace-s", "15"], cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], deadline_s: float) -> list[int]:
    """Every launcher's exit code; past the deadline, SIGTERM then SIGKILL the groups we started and fail."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    if any(p.poll() is None for p in procs):
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
        pytest.fail(f"the launchers did not finish within {deadline_s:.0f} s:\n{tails}")
    return [p.returncode for p in procs]


def _codes(record: Path) -> dict[str, int]:
    return {p["name"]: p["returncode"] for p in json.loads(record.read_text())["processes"]}


@pytest.mark.slow
def test_two_learner_nodes_train_b_packs_on_both_ranks_and_exit_cleanly(tmp_path, tiny_detector_dir,
                                                                        detector_data_dir):
    path, cfg = _config(tmp_path, tiny_detector_dir, detector_data_dir)
    run, logs = Path(cfg["training"]["output_dir"]), [tmp_path / "node0.out", tmp_path / "node1.out"]
    procs = [_launch(path, node, logs[node]) for node in (1, 0)][::-1]  # node 1 first: it waits for the rendezvous
    codes = _wait_all(procs, logs, DEADLINE_S)
    out = [log.read_text() for log in logs]
    assert codes == [0, 0], f"launcher exit codes {codes}:\n{out[0][-4000:]}\n{out[1][-4000:]}"

    # Each node started only its share, and everything it started exited 0.
    assert _codes(run / "processes_node0.json") == {"rollout_server": 0, "learner": 0, "actor_r0_0": 0}
    assert _codes(run / "processes_node1.json") == {"learner": 0, "actor_r1_0": 0}
    assert "tandem run summary" in out[0] and "tandem run summary" not in out[1]
    assert "tandem learner node 1" in out[1] and "learner=0, actor_r1_0=0" in out[1]

    # Global rank r ran on node r (static rendezvous keeps --node_rank): the node's log names the rank.
    assert "[learner r0 " in (run / "logs/node0/learner.log").read_text()
    node1_log = (run / "logs/node1/learner.log").read_text()
    assert "[learner r1 " in node1_log and "[learner r0 " not in node1_log

    # Metrics were written once, by global rank 0: one record per optimizer step, each covering both ranks.
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = cfg["training"]["max_steps"]
    assert [r["step"] for r in recs if r.get("record", "step") == "step"] == list(range(steps))
    K = "stage2_ab/async/"
    assert all(len(r[K + "kinds_by_rank"]) == 2 for r in recs)

    # B packs reached both ranks from their own node's actor, and a B step trained packs on both.
    last = recs[-1]
    assert last["queue/rank0/received"] > 0 and last["queue/rank1/received"] > 0, last
    b_steps = [r for r in recs if r[K + "step_kind_b"]]
    assert b_steps and all(all(vers for vers in r[K + "trained_pack_vers"]) for r in b_steps), b_steps

    # Global rank 0 (node 0) alone pushed weights to the server, at every due sync.
    assert last["sync/successes"] >= 2 and last["sync/client_calls_by_rank"][1] == 0, last

    # Both nodes wrote their rank's files into the one shared output_dir; the run record is node 0's.
    final = run / "checkpoints" / str(steps)
    assert (final / "rank0.json").exists() and (final / "rank1.json").exists()
    assert json.loads((final / "trainer_state.json").read_text())["world_size"] == 2


def _started_pids(log: Path) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"started (\S+) \(pid (\d+)\)", log.read_text())}


@pytest.mark.slow
def test_a_learner_node_that_dies_ends_the_run_on_the_other_node_with_a_named_error(tmp_path, tiny_detector_dir,
                                                                                   detector_data_dir):
    path, cfg = _config(tmp_path, tiny_detector_dir, detector_data_dir)
    cfg["training"]["max_steps"] = 10_000  # still training when node 1 dies
    # Each node's actor then tries for actor.stop_timeout_s (10 s) to hand its last packs to a learner that is
    # gone: no part of this test, only its wall time.
    cfg["actor"] = {**cfg.get("actor", {}), "stop_timeout_s": 2.0}
    path.write_text(yaml.safe_dump(cfg))
    run, logs = Path(cfg["training"]["output_dir"]), [tmp_path / "node0.out", tmp_path / "node1.out"]
    procs = [_launch(path, node, logs[node]) for node in (0, 1)]
    try:
        end = time.monotonic() + 180
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size > 0):
            assert time.monotonic() < end and all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
            time.sleep(0.5)
        # "Node 1 died": its rank (torchrun starts it in a session of its own) and its torchrun, all at once.
        worker = int(re.search(r"\[learner r1 (\d+)\]", (run / "logs/node1/learner.log").read_text()).group(1))
        os.kill(worker, signal.SIGKILL)
        os.killpg(_started_pids(logs[1])["learner"], signal.SIGKILL)
        killed_at = time.monotonic()
        codes = _wait_all(procs, logs, 150)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert codes[0] != 0 and codes[1] != 0, codes
    assert time.monotonic() - killed_at < cfg["learner"]["collective_timeout_s"] + 30  # within the deadline, not a hang
    out0 = logs[0].read_text()
    assert "run failed: learner exited with" in out0, out0[-3000:]
    rank0 = (run / "logs/node0/learner.log").read_text()
    assert "CollectiveTimeout: rank 0/2 on " in rank0 and "This is learner node 0 of 2" in rank0, rank0[-3000:]
    assert "launcher.node_rank=<k>" in rank0  # the restart command
    assert _codes(run / "processes_node0.json")["learner"] != 0


def _shared_dir_rank(rank: int, port: int, dirs: list[str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0",
                      GROUP_RANK=str(rank), LOCAL_WORLD_SIZE="1")  # one rank per "node", as torchrun sets it
    from learner.distributed import Dist, SharedDirError

    dist, results = Dist("gloo", timeout_s=30.0), []
    try:
        for output_dir in (dirs[0], dirs[rank]):  # first both ranks see node 0's directory, then rank 1 its own
            try:
                dist.check_shared_dir(output_dir)
                results.append("ok")
            except SharedDirError as exc:
                results.append(str(exc))
    finally:
        dist.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def test_learner_nodes_that_do_not_share_output_dir_are_refused_on_every_rank(tmp_path):
    import multiprocessing as mp

    shared, local = tmp_path / "shared", tmp_path / "node1-local"
    shared.mkdir(), local.mkdir()
    (shared / "run_info.json").write_text(json.dumps({"run_id": "0123456789abcdef0123456789abcdef"}))
    ctx, port = mp.get_context("spawn"), free_port_block(1)
    ranks = [ctx.Process(target=_shared_dir_rank, args=(r, port, [str(shared), str(local)], str(tmp_path)))
             for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(90)
    alive = [p.pid for p in ranks if p.is_alive()]
    for p in ranks:
        if p.is_alive():
            p.kill()
    assert not alive and all(p.exitcode == 0 for p in ranks), f"ranks did not finish within 90 s: {alive}"
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0[0] == rank1[0] == "ok"
    assert "here: the same run" in rank0[1] and "here: no run_info.json" in rank1[1]
    assert all("learner node" in msg and "Fix: put training.output_dir on a filesystem" in msg
               for msg in (rank0[1], rank1[1]))


def test_a_peer_failure_inside_a_step_is_reraised_naming_this_rank_and_its_node(monkeypatch):
    """DDP's own all-reduce fails with gloo's words when a peer dies; the learner says which node it is on."""
    from common.distributed.ranks import RankGroup
    from learner.distributed import CollectiveTimeout, Dist

    for key, value in {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}.items():
        monkeypatch.setenv(key, value)  # rank 2 of 2 nodes × 2 ranks, as torchrun sets it
    dist = Dist.__new__(Dist)  # the rank facts without joining a process group
    RankGroup.__init__(dist, 30.0, knob="learner.collective_timeout_s")
    with pytest.raises(CollectiveTimeout, match=r"rank 2/4 .*This is learner node 1 of 2.*launcher.node_rank=<k>"):
        with dist.peer_failures_named():
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.1]:5123")
    with pytest.raises(RuntimeError, match="^a bug$"):  # not a peer failure: passed through untouched
        with dist.peer_failures_named():
            raise RuntimeError("a bug")
