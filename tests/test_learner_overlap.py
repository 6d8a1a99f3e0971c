"""``weight_sync.mode: overlap`` with 2 real gloo ranks (torchrun), a real rollout server (hf engine), a fake actor per rank.

The learner reaches the server through :class:`SyncProxy`, a slow link that holds each push's first
bucket until the learner has written another metrics record (or 3 s passed): a push can only commit
quickly if the learner trains while it is in flight. One run, 14 optimizer steps, GA = 2, b_ratio 0.5,
a sync due at every step, version_window 1, a checkpoint every 5 steps::

    step 0            start-up sync (blocking): ver 1 on both ranks
    steps 1 ..        overlap: a push starts whenever one is due and none is in flight (deferred otherwise),
                      commits while the ranks train, and its ver is adopted at the next boundary
    checkpoint 5      waits for the push in flight, so the saved ver is the server's
    after record 8    the test SIGKILLs the server: every later push fails (502 from the proxy), training
                      goes on to step 13 on the last ver; the final checkpoint saves that ver

Every assertion reads what the processes wrote: rank 0's metrics.jsonl, each rank's trace file,
the checkpoints, the proxy's record of the sync sessions, and the learner's log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from common.config.load import load_config
from learner.pack_queue import COUNTER_NAMES
from tests.test_learner_harness import (
    FakeActor,
    ProxiedSession,
    SegmentPool,
    SyncProxy,
    keep_at_target,
    launch_learner,
    private_copy,
    read_metrics,
    read_traces,
    start_server,
    write_config,
)

pytestmark = pytest.mark.slow

GA, STEPS, SAVE_EVERY, KILL_AFTER, WINDOW = 2, 14, 5, 8, 1
K = "stage2_ab/async/"


@dataclass
class Run:
    metrics: list[dict[str, Any]]
    traces: list[dict[str, Any]]
    sessions: list[ProxiedSession]
    paths: dict[str, int]
    killed_after: int  # metrics records written when the server was killed
    proxy_url: str
    out: Path
    log: str


def _records(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir, synth_data_dir) -> Run:
    tmp = tmp_path_factory.mktemp("overlap")
    tiny_model_dir = private_copy(tiny_model_dir, tmp / "model")
    synth_data_dir = private_copy(synth_data_dir, tmp / "data")
    out = tmp / "run"
    metrics_path = out / "metrics.jsonl"
    server_cfg = write_config(tmp / "server.yaml", model_dir=tiny_model_dir, data_dir=synth_data_dir, output_dir=out)
    server, url = start_server(server_cfg, tmp / "server.log")
    proxy = SyncProxy(url, progress=lambda: _records(metrics_path), hold_first_bucket=True, hold_max_s=3.0)
    proxy.start()
    cfg_path = write_config(
        tmp / "cfg.yaml", model_dir=tiny_model_dir, data_dir=synth_data_dir, output_dir=out,
        training={"max_steps": STEPS, "gradient_accumulation_steps": GA, "save_every_steps": SAVE_EVERY},
        stage2_ab={"channel_b": {"async": {"version_window": WINDOW}}},
        weight_sync={"mode": "overlap", "every_steps": 1},
        rollout_matching={"vllm": {"servers": [{"base_url": proxy.url}]}},
        learner={"pack_wait_s": 1.0},
    )
    cfg = load_config(cfg_path, world_size=2)
    pool = SegmentPool(tiny_model_dir, synth_data_dir)
    actors = [FakeActor(cfg.transport, r, pool, keep_at_target) for r in (0, 1)]
    for a in actors:
        a.start()
    killed_after = []

    def kill_server_mid_run() -> None:
        end = time.monotonic() + 300
        while _records(metrics_path) < KILL_AFTER and time.monotonic() < end:
            time.sleep(0.05)
        killed_after.append(_records(metrics_path))
        os.killpg(server.popen.pid, signal.SIGKILL)  # the server's own process group (the test started it)

    killer = threading.Thread(target=kill_server_mid_run, daemon=True)
    killer.start()
    learner = launch_learner(cfg_path, tmp / "learner.log", nproc=2)
    try:
        rc = learner.wait(360, "the 2-rank overlap learner")
        killer.join(timeout=5)
    finally:
        learner.stop()
        for a in actors:
            a.stop()
        server.stop()
        proxy.stop()
    assert rc == 0, f"learner exited with {rc}:\n{learner.tail()}"
    assert not any(a.error for a in actors), [a.error for a in actors]
    assert killed_after and killed_after[0] < STEPS, "the server was killed mid-run"
    return Run(read_metrics(out), read_traces(out, 2), proxy.sessions, dict(proxy.paths), killed_after[0], proxy.url,
               out, learner.tail(400))


def by_step(run: Run) -> dict[int, dict[str, Any]]:
    assert [m["step"] for m in run.metrics] == list(range(STEPS)), f"one record per optimizer step:\n{run.log}"
    return {m["step"]: m for m in run.metrics}


def overlap_pushes(run: Run) -> list[ProxiedSession]:
    """Sessions opened by the overlap pushes while the server was alive (not the start-up sync)."""
    return [s for s in run.sessions[1:] if s.outcome == "committed"]


def test_overlap_mode_trains_while_a_push_is_in_flight(run):
    pushes = overlap_pushes(run)
    assert len(pushes) >= 2, [s.outcome for s in run.sessions]
    trained_on = [s for s in pushes if s.progress_at_commit > s.progress_at_begin]
    assert len(trained_on) >= 2, ("optimizer steps completed between /sync/begin and /sync/commit",
                                  [(s.progress_at_begin, s.progress_at_commit) for s in pushes])
    during = [m["sync/steps_during_push"] for m in run.metrics if m.get("sync/ok") == 1 and m["step"] > 0]
    assert during and max(during) >= 1, during
    m = by_step(run)
    started = [s for s in range(1, STEPS) if m[s].get("sync/started")]
    assert started and all(m[s]["time/sync_snapshot"] >= 0 for s in started)
    assert all(m[s]["time/sync_stall"] >= 0 for s in range(STEPS))


def test_at_most_one_push_is_in_flight_and_a_sync_due_meanwhile_is_deferred_and_counted(run):
    closed = [s for s in run.sessions if s.closed_at is not None]
    for a, b in zip(closed, closed[1:]):
        assert a.closed_at <= b.opened_at, "a push began before the previous one ended"
    m = by_step(run)
    assert m[STEPS - 1]["sync/deferred"] >= 1, "a sync is due every step and pushes span steps"
    for s in range(STEPS):
        c = m[s]
        assert c["sync/attempts"] - c["sync/successes"] - c["sync/failures"] == c.get("sync/in_flight", 0), c
        assert c.get("sync/in_flight", 0) in (0, 1)


def test_the_new_ver_takes_effect_on_every_rank_at_the_same_step_the_first_boundary_after_the_commit(run):
    m = by_step(run)
    for s in range(STEPS):
        assert len(set(m[s][K + "ver_current_by_rank"])) == 1, (s, m[s][K + "ver_current_by_rank"])
    per_step: dict[int, set[int]] = {}
    for t in run.traces:
        per_step.setdefault(t["step"], set()).add(t["ver_current"])
    assert all(len(v) == 1 for v in per_step.values()), per_step
    for s in range(1, STEPS):  # ver moves only with an adopted push (successes are counted at adoption)
        moved = m[s][K + "ver_current"] - m[s - 1][K + "ver_current"]
        assert moved == m[s]["sync/successes"] - m[s - 1]["sync/successes"], s
    for push in overlap_pushes(run):  # never before the server serves it (records written when /sync/commit answered)
        first = next(s for s in range(STEPS) if m[s][K + "ver_current"] >= push.ver)
        assert first >= push.progress_at_commit, ("adopted before the server committed", push, first)
    for a in (s for s in range(1, STEPS) if "sync/steps_during_push" in m[s]):
        # the first boundary after the push thread had its outcome: the start + the steps completed until
        # then (+ 1 when the outcome came during the step after them)
        start = max(s for s in range(a) if m[s].get("sync/started"))
        assert a - start in (m[a]["sync/steps_during_push"], m[a]["sync/steps_during_push"] + 1), (a, start, m[a])


def test_only_rank_0_talks_to_the_server(run):
    assert run.sessions and all(s.client.startswith("learner-rank0@") for s in run.sessions)
    m = by_step(run)
    assert m[STEPS - 1]["sync/client_calls_by_rank"][1] == 0
    assert m[STEPS - 1]["sync/client_calls_by_rank"][0] == m[STEPS - 1]["sync/attempts"]
    assert set(run.paths) <= {"/health", "/sync/init", "/sync/begin", "/sync/bucket", "/sync/commit", "/sync/abort"}


def test_a_push_that_fails_because_the_server_was_killed_does_not_stop_training_and_keeps_the_ver(run):
    m = by_step(run)
    after = [m[s] for s in range(run.killed_after + 1, STEPS)]
    assert after[-1]["sync/failures"] > m[run.killed_after - 1]["sync/failures"]
    assert len({r[K + "ver_current"] for r in after}) == 1, [r[K + "ver_current"] for r in after]
    assert re.search(rf"weight sync to {re.escape(run.proxy_url)} failed", run.log), "the error names the server URL"
    final = json.loads((run.out / "checkpoints" / str(STEPS) / "trainer_state.json").read_text())
    assert final["ver"] == after[-1][K + "ver_current"] and final["global_step"] == STEPS


def test_a_checkpoint_waits_for_the_push_in_flight_so_its_ver_is_the_servers(run):
    state = json.loads((run.out / "checkpoints" / str(SAVE_EVERY) / "trainer_state.json").read_text())
    m = by_step(run)
    assert state["ver"] == m[SAVE_EVERY][K + "ver_current"]
    assert "checkpoint at step 5: waiting" in run.log or m[SAVE_EVERY - 1].get("sync/in_flight") == 0
    nxt = next(s for s in run.sessions if s.progress_at_begin >= SAVE_EVERY)
    assert nxt.ver_before == state["ver"], "the server held the saved ver when the next push began"


def test_trained_packs_stay_inside_the_window_and_the_queues_conserve(run):
    for t in run.traces:
        if t["kind"] == "B":  # a pack of the ver committed but not yet adopted may arrive: ver_current + 1
            assert t["ver_current"] - WINDOW <= t["pack_ver"] <= t["ver_current"] + 1, t
    rhs = [n for n in COUNTER_NAMES if n not in ("received", "malformed")]
    for rec in run.metrics:
        for r in (0, 1):
            c = {n: rec[f"queue/rank{r}/{n}"] for n in COUNTER_NAMES}
            assert c["received"] == sum(c[n] for n in rhs), (rec["step"], r, c)


def test_every_metric_key_of_an_overlap_run_is_documented(run):
    doc = (Path(__file__).resolve().parents[1] / "docs/metrics.md").read_text()
    emitted = {re.sub(r"rank\d+", "rank{r}", k) for r in run.metrics for k in r} - {"step"}
    undocumented = sorted(k for k in emitted if f"`{k}`" not in doc)
    assert not undocumented, f"add these keys to docs/metrics.md: {undocumented}"
