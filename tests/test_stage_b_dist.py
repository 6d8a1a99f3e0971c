"""Stage-B with real ranks: 2 gloo processes on loopback, a deadline on every run, per-rank result files.

Each rank is this file run as a script (``python tests/test_stage_b_dist.py --rank-worker ...``)
with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT), so a test can instrument one
rank (count reflection engines, audit every file it opens for writing, make it fail) and still run
the product's ``run_all``. Each rank writes its observations to its own JSON file; the test merges
them. Processes are ours: a run past its deadline is killed by PID and the test fails with the
ranks' log tails. The last test runs the demo config under the real ``torchrun``.

The isolation/trigger/artifact tests use ``sampler.backend: scripted`` because they need
well-formed answers (a random tiny model answers garbage, so nothing would ever be learnable);
the fail-fast test and the torchrun demo use the tiny model through the hf engine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # when run as a rank worker script
    sys.path.insert(0, str(REPO))

from tests.ports import free_port_block  # noqa: E402

pytestmark = pytest.mark.slow

RUN_DEADLINE_S = 90.0  # a whole 2-rank run; a hang fails the test instead of the suite
FAIL_DEADLINE_S = 60.0  # from launch to every rank gone, when one rank raises


# --------------------------------------------------------------------------------------------- harness


def launch_ranks(tmp: Path, overrides: list[str], world: int = 2, worker_args: dict[int, list[str]] | None = None,
                 deadline_s: float = RUN_DEADLINE_S, audit_root: Path | None = None) -> tuple[list[int], list[dict], float]:
    """Start ``world`` rank workers; returns (exit codes, per-rank result dicts, seconds until all exited)."""
    port = free_port_block(1)
    procs, logs = [], []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, __file__, "--rank-worker", "--result", str(tmp / f"rank{r}.json")]
        if audit_root is not None:
            cmd += ["--audit-root", str(audit_root)]
        cmd += [*(worker_args or {}).get(r, []), "--", *overrides]
        log = open(tmp / f"rank{r}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    t0 = time.monotonic()
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        pytest.fail(f"stage-b ranks still running after {deadline_s:.0f}s (a collective hang?):\n" + tails(tmp, world))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # only the processes this test started, by PID
                p.wait()
        for log in logs:
            log.close()
    elapsed = time.monotonic() - t0
    results = []
    for r in range(world):
        path = tmp / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return [p.returncode for p in procs], results, elapsed


def tails(tmp: Path, world: int, n: int = 3000) -> str:
    return "\n".join(f"--- rank {r} ---\n{(tmp / f'rank{r}.log').read_text()[-n:]}" for r in range(world)
                     if (tmp / f"rank{r}.log").exists())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def files_under(root: Path) -> set[str]:
    return {str(p) for p in root.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------------------------- scripted run

P, W, REFLECT_BS, N_TICKETS = 2, 2, 3, 12  # global batch 4 > reflection batch 3 > per-rank shard 2


@pytest.fixture(scope="module")
def scripted_run(tmp_path_factory):
    """One 2-rank run where every ticket is learnable, so reflection fires mid-batch in every batch.

    All labels are fail and the scripted judge always answers pass: the 3rd, 6th, 9th and 12th
    ticket in global order trigger reflection (batch 0 position 2 — rank 1's first ticket —, batch 1
    position 1, batch 2 positions 0 and 3).
    """
    tmp = tmp_path_factory.mktemp("stage_b_scripted")
    tickets = tmp / "tickets.jsonl"
    tickets.write_text("".join(json.dumps({"group_id": f"g{i:02d}", "label": "fail", "mission": "m",
                                           "summaries": [f"box {i}", "label"]}) + "\n" for i in range(N_TICKETS)))
    out = tmp / "out"
    overrides = ["model.path=unused-by-scripted", "sampler.backend=scripted", "sampler.scripted.verdict=pass",
                 f"tickets.path={tickets}", f"runner.per_rank_rollout_batch_size={P}",
                 f"reflection.batch_size={REFLECT_BS}", f"output.root={out}", "runner.collective_timeout_s=30",
                 "sampler.samples_per_decode=2"]
    rcs, results, elapsed = launch_ranks(tmp, overrides, world=W, audit_root=out)
    assert rcs == [0, 0], tails(tmp, W)
    run_dir = Path(results[0]["summary"]["run_dir"])
    return {"results": results, "out": out, "run_dir": run_dir, "tmp": tmp,
            "trajectories": read_jsonl(run_dir / "trajectories.jsonl"),
            "reflection": read_jsonl(run_dir / "reflection.jsonl")}


def test_reflection_mid_batch_changes_guidance_only_from_the_next_batch_on_every_rank(scripted_run):
    refl = scripted_run["reflection"]
    assert [(r["batch"], r["position"]) for r in refl] == [(0, 2), (1, 1), (2, 0), (2, 3)]
    assert [(r["step_before"], r["step_after"]) for r in refl] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # the step each batch must have used: all reflections of earlier batches, none of its own
    expected = {b: sum(1 for r in refl if r["batch"] < b) for b in range(3)}
    assert expected == {0: 0, 1: 1, 2: 2}
    traj = scripted_run["trajectories"]
    assert {t["rank"] for t in traj} == {0, 1}
    for t in traj:  # recorded by the rank that generated it, per ticket
        assert t["guidance_step"] == expected[t["batch"]], t
    # in particular, tickets after a mid-batch reflection still used the batch's snapshot
    after = [t for t in traj if (t["batch"], t["position"]) in {(0, 3), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)}]
    assert after and all(t["guidance_step"] == expected[t["batch"]] for t in after)
    # and every rank reports the same step per batch (from its own result file)
    per_rank = [{b["batch"]: b["guidance_step"] for b in res["summary"]["batches"]} for res in scripted_run["results"]]
    assert per_rank[0] == per_rank[1] == expected


def test_reflection_triggers_on_the_global_count_and_never_on_a_non_zero_rank(scripted_run):
    rank0, rank1 = scripted_run["results"]
    assert rank1["reflection_engines"] == 0 and rank1["cycles"] == [] and rank1["summary"]["reflection_cycles"] is None
    assert rank0["reflection_engines"] == 1
    assert [c["pending"] for c in rank0["cycles"]] == [REFLECT_BS] * 4  # each at exactly the global threshold
    # the first trigger needed rank 1's ticket: rank 0's shard alone (P=2) never reaches the threshold
    first = scripted_run["reflection"][0]
    shard1 = rank1["summary"]["batches"][0]["keys"]
    assert first["records"][-1] in shard1 and len(shard1) == P < REFLECT_BS


def test_non_zero_ranks_write_nothing(scripted_run):
    rank0, rank1 = scripted_run["results"]
    assert rank1["writes"] == []
    assert rank1["summary"]["files_written"] == [] and rank1["summary"]["run_dir"] is None
    on_disk = files_under(scripted_run["out"])
    assert on_disk == set(rank0["summary"]["files_written"])
    run_dir = scripted_run["run_dir"]
    for name in ("trajectories.jsonl", "selections.jsonl", "reflection.jsonl", "metrics.jsonl", "guidance.json",
                 "need_review_queue.jsonl", "failure_malformed.jsonl", "run_summary.json"):
        assert (run_dir / name).is_file(), name
    assert json.loads((run_dir / "guidance.json").read_text())["step"] == 4
    assert rank0["writes"] and all(w.startswith(str(run_dir)) or Path(w) in run_dir.parents for w in rank0["writes"])


# --------------------------------------------------------------------------------------------- fail fast


def test_a_rank_that_raises_during_rollout_fails_the_whole_run_promptly(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    overrides = [f"model.path={tiny_model_dir}", f"output.root={out}", "runner.collective_timeout_s=45",
                 "tickets.demo.num_groups=12", "runner.per_rank_rollout_batch_size=2",
                 "sampler.grid=[{temperature: 0.7, max_new_tokens: 4, seed: 1}]"]
    rcs, results, elapsed = launch_ranks(tmp_path, overrides, worker_args={1: ["--fail-at-batch", "1"]},
                                         deadline_s=FAIL_DEADLINE_S)
    assert rcs[0] != 0 and rcs[1] != 0, tails(tmp_path, 2)
    assert elapsed < FAIL_DEADLINE_S
    assert "rank 1" in results[0]["error"] and "injected rollout failure" in results[0]["error"]
    assert "injected rollout failure" in results[1]["error"]
    run_dir = next(out.glob("stage_b/*"))
    status = json.loads((run_dir / "run_summary.json").read_text())
    assert status["status"] == "failed" and "rank 1" in status["error"]
    assert status["global_batches"] == 1  # batch 0 completed, batch 1 failed


@pytest.mark.parametrize("dying_rank", [1])
def test_a_rank_that_dies_without_a_word_fails_the_run_promptly(tmp_path, dying_rank):
    """os._exit in rollout (like a segfault or an OOM kill): the survivor's collective errors at once."""
    overrides = ["model.path=unused-by-scripted", "sampler.backend=scripted", f"output.root={tmp_path / 'out'}",
                 "runner.collective_timeout_s=45", "runner.per_rank_rollout_batch_size=2"]
    rcs, results, elapsed = launch_ranks(tmp_path, overrides, deadline_s=FAIL_DEADLINE_S,
                                         worker_args={dying_rank: ["--fail-at-batch", "1", "--fail-mode", "die"]})
    survivor = 1 - dying_rank
    assert rcs[dying_rank] == 17 and rcs[survivor] == 1, tails(tmp_path, 2)
    assert elapsed < 45  # well before the collective deadline: the closed connection is noticed
    assert "RankFailure" in results[survivor]["error"] and "rollout" in results[survivor]["error"]


# --------------------------------------------------------------------------------------------- torchrun


def test_torchrun_runs_the_cpu_demo_config_on_two_ranks_with_the_tiny_model(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "stage_b/main.py",
           "--config", "configs/stage_b/demo_cpu.yaml", f"model.path={tiny_model_dir}", f"output.root={out}",
           "runner.collective_timeout_s=60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=RUN_DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()  # torchrun tears its workers down when it dies
        text, _ = proc.communicate()
        pytest.fail(f"torchrun demo still running after {RUN_DEADLINE_S:.0f}s:\n{text[-4000:]}")
    assert proc.returncode == 0, text[-4000:]
    (run_dir,) = (out / "demo").iterdir()
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["global_batches"] == 3
    traj = read_jsonl(run_dir / "trajectories.jsonl")
    assert {t["rank"] for t in traj} == {0, 1}
    assert len(traj) == 12 * 2  # 12 demo tickets × 2 grid entries × 1 sample
    handled = read_jsonl(run_dir / "selections.jsonl") + read_jsonl(run_dir / "failure_malformed.jsonl")
    assert sorted(r["ticket_key"] for r in handled) == sorted({t["ticket_key"] for t in traj})
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["kind"] for m in metrics] == ["batch"] * 3 + ["epoch"]
    assert (run_dir / "guidance.json").is_file() and (run_dir / "guidance_snapshots").is_dir()


# --------------------------------------------------------------------------------------------- rank worker


def _rank_worker(argv: list[str]) -> int:
    """One rank: instrument, run ``run_all``, write observations to ``--result``, exit like main.py."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank-worker", action="store_true")
    ap.add_argument("--result", required=True)
    ap.add_argument("--audit-root", default=None)
    ap.add_argument("--fail-at-batch", type=int, default=None)
    ap.add_argument("--fail-mode", choices=["raise", "die"], default="raise")
    args, rest = ap.parse_known_args(argv)
    overrides = [a for a in rest if a != "--"]
    rank = int(os.environ["RANK"])
    obs: dict = {"rank": rank, "writes": [], "reflection_engines": 0, "cycles": [], "error": None, "summary": None}

    if args.audit_root:  # every open-for-write / mkdir / rename / remove under the output root
        root = os.path.abspath(args.audit_root)

        def audit(event, a):
            if event == "open":
                path, mode, flags = a
                writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            elif event in ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree"):
                path, writing = a[0], True
            else:
                return
            if writing and isinstance(path, (str, os.PathLike)) and os.path.abspath(path).startswith(root):
                obs["writes"].append(os.path.abspath(path))

        sys.addaudithook(audit)

    import logging

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    from stage_b import reflection, rollout
    from stage_b.config import load_stage_b_config
    from stage_b.runner import run_all

    init, cycle = reflection.ReflectionEngine.__init__, reflection.ReflectionEngine._cycle

    def counting_init(self, *a, **k):
        obs["reflection_engines"] += 1
        init(self, *a, **k)

    def recording_cycle(self, trigger, where):
        obs["cycles"].append({"pending": len(self.pending), "trigger": trigger, **where})
        cycle(self, trigger, where)

    reflection.ReflectionEngine.__init__ = counting_init
    reflection.ReflectionEngine._cycle = recording_cycle
    if args.fail_at_batch is not None:
        generate, calls = rollout.RolloutSampler.generate_for_batch, []

        def failing(self, tickets, snapshot):
            calls.append(1)
            if len(calls) > args.fail_at_batch:
                if args.fail_mode == "die":  # no Python cleanup, no status exchange: like a segfault or OOM kill
                    os._exit(17)
                raise RuntimeError(f"injected rollout failure on rank {rank}")
            return generate(self, tickets, snapshot)

        rollout.RolloutSampler.generate_for_batch = failing

    rc = 0
    try:
        summary = run_all(load_stage_b_config(None, overrides))
        obs["summary"] = {k: v for k, v in vars(summary).items()}
    except Exception as exc:
        obs["error"] = f"{type(exc).__name__}: {exc}"
        logging.getLogger("rank-worker").exception("rank %d failed", rank)
        rc = 1
    Path(args.result).write_text(json.dumps(obs, default=str))
    return rc


if __name__ == "__main__" and "--rank-worker" in sys.argv:
    sys.exit(_rank_worker(sys.argv[1:]))
