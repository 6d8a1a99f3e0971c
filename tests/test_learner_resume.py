"""Resume with 2 real gloo ranks: N steps, stop, resume, M more == one uninterrupted N + M run.

No rollout server runs here on purpose: every weight sync fails fast (connection refused), which
also shows the outage rule — the learner counts ``sync/failures``, keeps its ver and trains on.
Fake actors keep each rank's queue at target; ``pack_wait_s`` makes every wanted B step feasible,
so the A/B sequence is the policy's. After the restart each fake actor starts its sample ids from
0 again, as an actor that ignored the checkpoint's B ledger would: the learner must drop those.
The checkpoint at step N follows a B step, so each rank's Channel-A prefetch thread holds a window
built but not trained at save time: the checkpoint must describe the samples trained, not that one.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from common.config.load import load_config
from common.packing.schedule import wants_b
from tests.test_learner_harness import (
    FakeActor,
    SegmentPool,
    keep_at_target,
    launch_learner,
    private_copy,
    read_metrics,
    read_traces,
    write_config,
)

pytestmark = pytest.mark.slow

N, M = 2, 2


def train(cfg_path, log_path, pool, max_steps: int, resume: bool | str):
    """A 2-rank learner run with fake actors; ``resume``: False (fresh), True (auto) or a checkpoint path."""
    cfg = load_config(cfg_path, world_size=2)
    actors = [FakeActor(cfg.transport, r, pool, keep_at_target) for r in (0, 1)]
    for a in actors:
        a.start()
    overrides = [f"training.max_steps={max_steps}"]
    if resume:
        overrides.append(f"training.resume={'auto' if resume is True else resume}")
    proc = launch_learner(cfg_path, log_path, nproc=2, overrides=overrides)
    try:
        rc = proc.wait(240, f"the 2-rank learner ({'resumed' if resume else 'fresh'}, {max_steps} steps)")
    finally:
        proc.stop()
        for a in actors:
            a.stop()
    assert rc == 0, f"learner exited with {rc}:\n{proc.tail()}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, synth_data_dir):
    tmp = tmp_path_factory.mktemp("resume")
    model, data = private_copy(tiny_model_dir, tmp / "model"), private_copy(synth_data_dir, tmp / "data")
    pool = SegmentPool(model, data)
    common = dict(model_dir=model, data_dir=data,
                  training={"gradient_accumulation_steps": 1, "save_every_steps": N},
                  stage2_ab={"channel_b": {"async": {"version_window": 2, "queue_limit": 4, "prefetch_target_packs": 2}}},
                  learner={"pack_wait_s": 20.0})
    whole = write_config(tmp / "whole.yaml", output_dir=tmp / "whole", **common)
    parts = write_config(tmp / "parts.yaml", output_dir=tmp / "parts", **common)
    train(whole, tmp / "whole.log", pool, N + M, resume=False)
    train(parts, tmp / "part1.log", pool, N, resume=False)
    part1_traces = read_traces(tmp / "parts", 2)
    ckpt = tmp / "parts" / "checkpoints" / str(N)
    part1_rank_states = [json.loads((ckpt / f"rank{r}.json").read_text()) for r in (0, 1)]
    (tmp / "parts" / "trace_rank0.jsonl").rename(tmp / "part1_rank0.jsonl")
    (tmp / "parts" / "trace_rank1.jsonl").rename(tmp / "part1_rank1.jsonl")
    train(parts, tmp / "part2.log", pool, N + M, resume=True)
    return {
        "whole": read_metrics(tmp / "whole"), "parts": read_metrics(tmp / "parts"),
        "whole_traces": read_traces(tmp / "whole", 2), "part1_traces": part1_traces,
        "part1_rank_states": part1_rank_states,
        "part2_traces": read_traces(tmp / "parts", 2),
    }


def kinds(metrics):
    return [(m["step"], m["stage2_ab/async/step_kind_b"]) for m in metrics]


def test_the_resumed_a_b_sequence_equals_the_uninterrupted_run(runs):
    whole, parts = runs["whole"], runs["parts"]
    assert [m["step"] for m in parts] == list(range(N + M)), "part 2 continues at step N; no step twice or missing"
    assert kinds(parts) == kinds(whole) == [(s, int(wants_b(s, 0.5))) for s in range(N + M)]
    assert all(m["stage2_ab/async/b_step_skipped_due_to_queue"] == 0 for m in whole + parts)


def a_samples(traces):
    """{(rank, step): Channel-A sample ids trained in that step, in micro-step order}."""
    out = defaultdict(list)
    for t in traces:
        if t["kind"] == "A":
            out[(t["rank"], t["step"])] += t["sample_ids"]
    return dict(out)


def test_channel_a_samples_continue_where_the_checkpoint_left_them(runs):
    resumed = a_samples(runs["part1_traces"] + runs["part2_traces"])
    assert resumed == a_samples(runs["whole_traces"]), "per rank and step, the same A samples in the same order"
    assert any(step >= N for _, step in resumed), "part 2 trained A steps"


def test_the_checkpoint_holds_the_channel_a_samples_trained_not_the_window_prefetched(runs):
    trained = a_samples(runs["part1_traces"])
    for r, rank_state in enumerate(runs["part1_rank_states"]):
        state = rank_state["data_a"]
        assert state["ahead"] == 1, f"rank {r}: no window was waiting at save time, so this test would prove nothing"
        n_trained = sum(len(ids) for (rank, _), ids in trained.items() if rank == r)
        c = state["counters"]
        assert n_trained > 0 and state["epoch"] == 0
        assert state["position"] == n_trained + len(state["carry"]) + c["too_long_dropped"] + c["record_errors"], (
            f"rank {r}: the saved sampler position counts samples drawn beyond those trained (or carried)"
        )


def test_no_b_sample_is_trained_twice_across_the_restart(runs):
    trained = [sid for t in runs["part1_traces"] + runs["part2_traces"] if t["kind"] == "B" for sid in t["sample_ids"]]
    assert trained and len(trained) == len(set(trained)), sorted(trained)
    part1_b = {sid for t in runs["part1_traces"] if t["kind"] == "B" for sid in t["sample_ids"]}
    assert part1_b, "part 1 trained B samples the restarted actors then re-sent"
    last = runs["parts"][-1]
    assert last["queue/rank0/duplicate_dropped"] + last["queue/rank1/duplicate_dropped"] >= len(part1_b)


def test_counters_continue_after_the_resume(runs):
    parts = {m["step"]: m for m in runs["parts"]}
    before, after = parts[N - 1], parts[N]
    assert after["global_step"] == N + 1
    assert after["learner/optimizer_updates_total"] == before["learner/optimizer_updates_total"] + 1 == N + 1
    assert after["learner/steps_b_total"] + after["learner/steps_a_total"] == N + 1
    for r in (0, 1):
        assert after[f"queue/rank{r}/trained"] >= before[f"queue/rank{r}/trained"]
    whole = {m["step"]: m for m in runs["whole"]}
    assert after["sync/attempts"] == whole[N]["sync/attempts"] == before["sync/attempts"] + 1


def test_a_server_outage_fails_each_sync_fast_and_training_goes_on(runs):
    for m in runs["whole"]:
        assert m["sync/successes"] == 0 and m["sync/failures"] == m["sync/attempts"] >= 1
        assert m["stage2_ab/async/ver_current"] == 0
    assert runs["whole"][-1]["global_step"] == N + M
