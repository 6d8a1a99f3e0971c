"""The async learner with 2 real gloo ranks (torchrun), a real rollout server and one fake actor per rank.

One run, five optimizer steps, GA = 2, b_ratio 0.5 (B wanted at steps 1 and 3), sync every step
(ver = step + 1 after each boundary's sync), version_window 1, pack_wait_s 4::

    rank 0's actor: keeps its queue at target with packs of the current ver; once ver >= 3 it also
                    sends one pack of ver 0 (stale on arrival) and, first of all, one malformed message
    rank 1's actor: silent until ver >= 3, then keeps its queue at target

    step 0 A | step 1 wants B, rank 1 empty -> A, skip = 1 | step 2 A | step 3 wants B, both ranks
    hold GA packs -> B | step 4 A

Every assertion reads what the processes wrote: rank 0's metrics.jsonl, each rank's trace file,
the server's /metrics, /health and log.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import pytest

from common.config.load import load_config
from learner.pack_queue import COUNTER_NAMES
from tests.test_learner_harness import (
    FakeActor,
    SegmentPool,
    http_json,
    http_text,
    keep_at_target,
    launch_learner,
    private_copy,
    read_metrics,
    read_traces,
    start_server,
    write_config,
)

pytestmark = pytest.mark.slow

GA, STEPS = 2, 5


@dataclass
class Run:
    rc: int
    metrics: list[dict[str, Any]]
    traces: list[dict[str, Any]]
    server_metrics: str
    server_ver: int
    server_log: str
    actors: list[FakeActor]
    log: str


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir, synth_data_dir) -> Run:
    tmp = tmp_path_factory.mktemp("async")
    tiny_model_dir, synth_data_dir = private_copy(tiny_model_dir, tmp / "model"), private_copy(synth_data_dir, tmp / "data")
    out = tmp / "run"
    cfg_path = write_config(tmp / "cfg.yaml", model_dir=tiny_model_dir, data_dir=synth_data_dir, output_dir=out,
                            training={"max_steps": STEPS, "gradient_accumulation_steps": GA},
                            learner={"pack_wait_s": 4.0})
    cfg = load_config(cfg_path, world_size=2)
    pool = SegmentPool(tiny_model_dir, synth_data_dir)
    server, url = start_server(cfg_path, tmp / "server.log")
    stale_sent = []

    def rank0(credits, sent):
        vers = keep_at_target(credits, sent)
        if credits.ver_current >= 3 and not stale_sent:
            stale_sent.append(True)
            vers.append(0)
        return vers

    def rank1(credits, sent):
        return keep_at_target(credits, sent) if credits.ver_current >= 3 else []

    actors = [FakeActor(cfg.transport, 0, pool, rank0, first_frames=[b"not a pack message"]),
              FakeActor(cfg.transport, 1, pool, rank1)]
    for a in actors:
        a.start()
    learner = launch_learner(cfg_path, tmp / "learner.log", nproc=2)
    try:
        rc = learner.wait(300, "the 2-rank async learner")
        server_metrics, server_ver = http_text(f"{url}/metrics"), http_json(f"{url}/health")["ver"]
    finally:
        learner.stop()
        for a in actors:
            a.stop()
        server.stop()
    assert rc == 0, f"learner exited with {rc}:\n{learner.tail()}"
    assert not any(a.error for a in actors), [a.error for a in actors]
    return Run(rc, read_metrics(out), read_traces(out, 2), server_metrics, server_ver,
               (tmp / "server.log").read_text(), actors, learner.tail(200))


def by_step(run: Run) -> dict[int, dict[str, Any]]:
    assert [m["step"] for m in run.metrics] == list(range(STEPS)), f"one record per optimizer step:\n{run.log}"
    return {m["step"]: m for m in run.metrics}


def test_a_rank_with_a_short_queue_makes_both_ranks_run_a_and_logs_the_skip(run):
    m = by_step(run)
    assert m[1]["stage2_ab/async/policy_wants_b"] == 1
    assert m[1]["stage2_ab/async/step_kind_b"] == 0
    assert m[1]["stage2_ab/async/b_step_skipped_due_to_queue"] == 1
    assert m[1]["stage2_ab/async/kinds_by_rank"] == ["A", "A"]
    assert m[1]["time/wait_for_packs"] >= 3.5, "pack_wait_s = 4 was spent waiting for rank 1 before falling back"
    for s in (0, 2, 4):
        assert m[s]["stage2_ab/async/policy_wants_b"] == 0 and m[s]["stage2_ab/async/b_step_skipped_due_to_queue"] == 0


def test_b_runs_once_every_rank_holds_ga_eligible_packs(run):
    m = by_step(run)
    assert m[3]["stage2_ab/async/step_kind_b"] == 1 and m[3]["stage2_ab/async/b_step_skipped_due_to_queue"] == 0
    assert m[3]["stage2_ab/async/kinds_by_rank"] == ["B", "B"]
    assert [len(v) for v in m[3]["stage2_ab/async/trained_pack_vers"]] == [GA, GA]
    assert m[4]["stage2_ab/async/b_ratio_realized"] == pytest.approx(1 / 5)


def test_a_stale_pack_is_dropped_counted_and_never_trained(run):
    trained = {sid for t in run.traces for sid in t["sample_ids"]}
    stale = [sid for sid, ver in run.actors[0].sent_log if ver == 0]
    assert stale, "rank 0's actor sent its ver-0 pack"
    assert not set(stale) & trained
    last = run.metrics[-1]
    assert last["queue/rank0/stale_dropped"] >= 1
    assert last["stage2_ab/async/drop_stale_total"] >= 1
    for t in run.traces:  # version_window 1: every trained B pack is at most one ver behind
        if t["kind"] == "B":
            assert t["pack_ver"] >= t["ver_current"] - 1, t


def test_both_ranks_execute_the_same_kind_for_every_micro_step(run):
    kinds: dict[tuple[int, int], dict[int, str]] = defaultdict(dict)
    for t in run.traces:
        kinds[(t["step"], t["micro"])][t["rank"]] = t["kind"]
    assert sorted(kinds) == [(s, i) for s in range(STEPS) for i in range(GA)]
    for key, per_rank in kinds.items():
        assert set(per_rank) == {0, 1} and len(set(per_rank.values())) == 1, f"micro-step {key}: {per_rank}"


def test_exactly_one_forward_backward_per_micro_step_per_rank(run):
    assert all(t["forwards"] == t["backwards"] == 1 for t in run.traces), "counted by hooks on the model and logits"
    for m in run.metrics:
        assert m["learner/forwards"] == m["learner/backwards"] == m["learner/micro_steps"] == [GA, GA]
        assert m["learner/max_forwards_per_micro_step"] == 1


def test_only_rank_0_talks_to_the_server_and_every_rank_has_the_new_ver_before_the_next_decision(run):
    m = by_step(run)
    opened = re.findall(r"sync session \S+ opened by (\S+)", run.server_log)
    assert len(opened) == STEPS and all(c.startswith("learner-rank0@") for c in opened), opened
    committed = re.search(r'rollout_syncs_total\{outcome="committed"\} (\S+)', run.server_metrics)
    assert committed and float(committed.group(1)) == STEPS
    assert m[STEPS - 1]["sync/client_calls_by_rank"] == [STEPS, 0], "rank 1 never constructs a client or calls the server"
    for s in range(STEPS):  # the sync at the boundary before step s made ver s + 1, on every rank, before deciding
        assert m[s]["stage2_ab/async/ver_current_by_rank"] == [s + 1, s + 1]
    for t in run.traces:
        assert t["ver_current"] == t["step"] + 1, t
    assert run.server_ver == STEPS


def test_the_conservation_identity_holds_on_every_rank_at_every_step(run):
    rhs_names = [n for n in COUNTER_NAMES if n not in ("received", "malformed")]
    for m in run.metrics:
        for r in (0, 1):
            c = {n: m[f"queue/rank{r}/{n}"] for n in COUNTER_NAMES}
            assert c["received"] == sum(c[n] for n in rhs_names), f"step {m['step']} rank {r}: {c}"
    last = run.metrics[-1]
    assert last["queue/rank0/malformed"] == 1, "the malformed message was counted, not fatal"
    assert last["queue/rank1/received"] >= GA and last["queue/rank0/trained"] == GA
