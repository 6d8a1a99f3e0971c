"""A rollout server killed mid-run and started again on its port rejoins; the actor exits on the learner's done.

Real processes on loopback: the rollout server (hf engine, tiny model), the learner (one rank, plain
``python learner/main.py``) and one actor (``python -m actor``)::

    server ◄── /infer ── actor ── packs ──► learner ── /sync/* (every step) ──► server
      │ SIGKILL once B steps ran                        (A steps, failed syncs meanwhile)
      └ started again on the same port ─► the learner's next sync pushes its weights with the floor
                                          min_ver = ver + 1, so ver moves on; the actor's client rode
                                          out the outage with back-off; B steps resume
    learner reaches max_steps ─► its last credits say done ─► the actor exits 0 within seconds

One scenario (module fixture), several assertions; deadlines on every wait; processes stopped by
the group ids this test created.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from tests.test_learner_harness import Proc, http_json, launch_learner, read_metrics, start_server, write_config

pytestmark = pytest.mark.slow

K = "stage2_ab/async/"
MAX_STEPS = 20
DEADLINE_S = 240.0


def _wait(what: str, predicate, deadline_s: float, *procs: Proc) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        for p in procs:
            if p.popen.poll() is not None:
                raise AssertionError(f"{what}: {p.argv[:4]} exited with {p.popen.returncode}:\n{p.tail()}")
        if time.monotonic() > end:
            raise AssertionError(f"waited {deadline_s:.0f} s for {what}; learner log:\n{procs[0].tail() if procs else ''}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir, synth_data_dir):
    tmp = tmp_path_factory.mktemp("rejoin")
    out = tmp / "run"
    cfg_path = write_config(
        tmp / "rejoin.yaml", model_dir=tiny_model_dir, data_dir=synth_data_dir, output_dir=out, nproc=1,
        training={"max_steps": MAX_STEPS, "trace_micro_steps": False, "pack_max_wait_s": 0.5},
        stage2_ab={"channel_b": {"async": {"version_window": 1}}},
        weight_sync={"every_steps": 1, "mode": "blocking", "timeout_s": 10},
        rollout_matching={"vllm": {"timeout_s": 60}},
        actor={"server_backoff_max_s": 1.0, "metrics_every_s": 1.0},
        learner={"pack_wait_s": 4.0},
    )
    server, url = start_server(cfg_path, tmp / "server1.log")
    learner = launch_learner(cfg_path, tmp / "learner.log", nproc=1)
    actor = Proc([sys.executable, "-m", "actor", "--rank", "0", "--config", str(cfg_path)], tmp / "actor.log",
                 env={"OMP_NUM_THREADS": "1"})
    procs = [learner, actor]
    facts: dict = {}
    try:
        def b_steps() -> list[dict]:
            return [r for r in read_metrics(out) if r[K + "step_kind_b"]]

        _wait("a first B step", lambda: len(b_steps()) >= 1, DEADLINE_S, *procs)
        os.killpg(server.popen.pid, signal.SIGKILL)  # the group this test created
        server.popen.wait(10)
        killed = read_metrics(out)[-1]
        facts.update(killed_step=killed["step"], ver_at_kill=killed[K + "ver_current"], t_kill=time.monotonic())
        _wait("a failed sync while the server is down",
              lambda: read_metrics(out)[-1]["sync/failures"] > killed["sync/failures"], 60, *procs)
        server, _ = start_server(cfg_path, tmp / "server2.log")
        facts["restart_step"] = read_metrics(out)[-1]["step"]
        facts["t_restart"] = time.monotonic()
        _wait("a B step after the restart",
              lambda: any(r["step"] > facts["restart_step"] for r in b_steps()), DEADLINE_S, *procs)
        facts["t_b_again"] = time.monotonic()
        rc_learner = learner.wait(DEADLINE_S, "the learner (to max_steps)")
        t_learner_done = time.monotonic()
        rc_actor = actor.wait(30, "the actor after the learner's done")
        facts.update(rc_learner=rc_learner, rc_actor=rc_actor, actor_exit_after_s=time.monotonic() - t_learner_done,
                     server_ver=http_json(f"{url}/health")["ver"])
    finally:
        for p in (actor, learner, server):
            p.stop()
    facts["metrics"] = read_metrics(out)
    facts["actor_final"] = [json.loads(x) for x in (out / "actor_rank0_0.jsonl").read_text().splitlines()][-1]
    facts["logs"] = {"learner": learner.tail(80), "actor": actor.tail(80)}
    by_step = {r["step"]: r for r in facts["metrics"]}
    first_ok = next((s for s, r in sorted(by_step.items()) if s > facts["restart_step"]
                     and r["sync/successes"] > by_step[facts["restart_step"]]["sync/successes"]), None)
    print("server-rejoin facts:", json.dumps({  # docs/reliability.md quotes these
        "killed_at_step": facts["killed_step"], "server_back_at_step": facts["restart_step"],
        "first_sync_after_restart_step": first_ok, "ver_at_kill": facts["ver_at_kill"],
        "ver_after_rejoin": by_step[first_ok][K + "ver_current"] if first_ok is not None else None,
        "s_from_restart_to_b_step": round(facts["t_b_again"] - facts["t_restart"], 1),
        "s_from_kill_to_b_step": round(facts["t_b_again"] - facts["t_kill"], 1),
        "a_steps_during_outage": sum(1 for s, r in by_step.items() if facts["killed_step"] < s <= facts["restart_step"]
                                     and not r[K + "step_kind_b"]),
        "actor_exit_after_learner_s": round(facts["actor_exit_after_s"], 1),
        "actor_server_errors": facts["actor_final"]["actor/server_errors"]}))
    return facts


def test_the_learner_and_the_actor_finish_cleanly_across_the_outage(run):
    assert run["rc_learner"] == 0, run["logs"]["learner"]
    assert run["rc_actor"] == 0, run["logs"]["actor"]
    assert [r["step"] for r in run["metrics"]] == list(range(MAX_STEPS))


def test_the_first_sync_after_the_restart_moves_ver_forward_from_the_learners_own(run):
    recs = {r["step"]: r for r in run["metrics"]}
    after = [r for s, r in recs.items() if s > run["restart_step"]]
    assert any(r["sync/successes"] > recs[run["restart_step"]]["sync/successes"] for r in after)
    vers = [r[K + "ver_current"] for r in run["metrics"]]
    assert vers == sorted(vers), "ver went backwards"
    assert after[-1][K + "ver_current"] > run["ver_at_kill"]
    assert run["server_ver"] >= after[-1][K + "ver_current"]  # the restarted server took the learner's ver on


def test_b_steps_resume_on_packs_the_restarted_server_generated(run):
    later_b = [r for r in run["metrics"] if r["step"] > run["restart_step"] and r[K + "step_kind_b"]]
    assert later_b
    assert any(v > run["ver_at_kill"] for r in later_b for rank_vers in r[K + "trained_pack_vers"] for v in rank_vers)


def test_the_actor_rode_out_the_outage_and_exited_within_seconds_of_the_learners_done(run):
    final = run["actor_final"]
    assert final["actor/server_errors"] >= 1 and final["actor/conservation_ok"] == 1
    assert run["actor_exit_after_s"] < 10, run["logs"]["actor"]
