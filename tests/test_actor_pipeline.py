"""The actor's library parts in-process: the pipeline, the sample stream and ledgers, the credit gate."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from actor.credits import CreditGate, fair_share
from actor.pipeline import COUNT_KEYS, Pipeline, Rollout, rollout_seed
from actor.stream import PackLedger, SampleStream
from common.runs.checkpoints import read_b_ledger, resolve_resume_checkpoint
from common.detection.answer import IM_END, canonical_order, serialize_objects
from common.config.load import load_config
from common.wire.http import InferOutput, InferResponse
from common.wire.codec import Credits

# --------------------------------------------------------------------------------------------- pipeline


@pytest.fixture(scope="module")
def cfg(tiny_model_dir, synth_data_dir, tmp_path_factory):
    return load_config("configs/demo_cpu.yaml", [
        f"model.path={tiny_model_dir}", f"data.train_jsonl={synth_data_dir / 'train.jsonl'}",
        f"training.output_dir={tmp_path_factory.mktemp('run')}", "stage2_ab.channel_b.rollout_decode_batch_size=3",
    ])


@pytest.fixture(scope="module")
def pipeline(cfg):
    from common.packing.encode import encoder_from_config

    return Pipeline(cfg, encoder_from_config(cfg))


@pytest.fixture(scope="module")
def samples(pipeline, synth_data_dir):
    lines = (synth_data_dir / "train.jsonl").read_text().splitlines()[:7]
    return [pipeline.sample(f"{json.loads(x)['id']}@0", json.loads(x)) for x in lines]


def answer_ids(pipeline, objects) -> list[int]:
    return pipeline.tokenizer.encode(serialize_objects(objects) + IM_END, add_special_tokens=False)


def test_perfect_rollouts_give_perfect_precision_recall_and_one_segment_each(pipeline, samples):
    rollouts = [Rollout(answer_ids(pipeline, canonical_order(s.record.objects)), ver=4) for s in samples]
    segments, metrics = pipeline.build_segments(samples, rollouts)
    m = metrics.summary()
    assert len(segments) == len(samples) and m["rollout/segments"] == len(samples)
    assert m["rollout/precision"] == m["rollout/recall"] == m["rollout/f1"] == 1.0
    assert m["rollout/n_gt"] == m["rollout/n_matched"] == sum(len(s.record.objects) for s in samples)
    assert all(s.ver == 4 and s.channel == "B" and s.sample_id == x.key for s, x in zip(segments, samples))
    assert set(COUNT_KEYS) <= set(m) and all(m[f"time/{k}"] > 0 for k in ("parse", "match", "target", "encode"))


def test_malformed_rollouts_never_raise_and_are_counted(pipeline, samples):
    vocab = len(pipeline.tokenizer)
    rng = np.random.default_rng(0)
    garbage = [
        [],
        rng.integers(0, vocab, size=40).tolist(),
        [vocab + 5, -3, 10**12],
        answer_ids(pipeline, canonical_order(samples[3].record.objects))[:9],  # truncated mid-object
        pipeline.tokenizer.encode('{"object_1": {"desc": "x", "bbox_2d": [1, 2]}}', add_special_tokens=False),
    ]
    segs, metrics = pipeline.build_segments(samples[:5], [Rollout(g, ver=1, finish_reason="length") for g in garbage])
    m = metrics.summary()
    assert len(segs) == 5 and m["rollout/errors"] == 0  # zero valid predictions -> the GT target, still trained
    assert m["rollout/invalid_rollout"] >= 4 and m["rollout/finish_length"] == 5
    assert m["rollout/parse_truncated"] >= 1 and m["rollout/n_pred"] == 0
    for seg, sample in zip(segs, samples[:5]):  # with nothing matched the target is the canonical GT
        assert seg.coord_bins.tolist() == [k for o in canonical_order(sample.record.objects) for k in o.bins]


def test_a_sample_that_fails_unexpectedly_is_dropped_counted_and_the_batch_goes_on(pipeline, samples, monkeypatch):
    real = pipeline.encoder.encode
    calls = Counter()

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(*a, **kw)

    monkeypatch.setattr(pipeline.encoder, "encode", flaky)
    rollouts = [Rollout(answer_ids(pipeline, []), ver=0) for _ in samples[:3]]
    segs, metrics = pipeline.build_segments(samples[:3], rollouts)
    assert len(segs) == 2 and metrics.counts["rollout/errors"] == 1


def test_the_rollout_prefix_target_keeps_the_rollout_tokens(cfg, pipeline, samples):
    pre = Pipeline(SimpleNamespace(**{**vars(cfg)}), pipeline.encoder)
    pre.target_kind = "rollout_prefix"
    objs = canonical_order(samples[0].record.objects)
    ids = answer_ids(pipeline, objs[:1])
    (seg,), metrics = pre.build_segments(samples[:1], [Rollout(ids, ver=2)])
    p = seg.meta["prompt_len"]
    assert seg.input_ids[p : p + len(ids) - 2].tolist() == ids[: len(ids) - 2]  # rollout prefix kept verbatim
    assert seg.meta["target/target"] == "rollout_prefix" and metrics.counts["rollout/n_matched"] == 1


class RecordingClient:
    def __init__(self):
        self.calls = []

    def infer(self, items, sampling, *, min_ver=None, client=None):
        self.calls.append((len(items), sampling.seed, min_ver))
        return InferResponse(ver=7, engine="fake", elapsed_s=0.0, outputs=[
            InferOutput(id=i.id, token_ids=[1, 2], text="", finish_reason="stop", prompt_token_ids=[1]) for i in items])


def test_rollouts_go_out_in_decode_batches_with_seeds_that_depend_only_on_the_sample_keys(pipeline, samples, cfg):
    client = RecordingClient()
    rollouts = pipeline.rollout_batch(samples, client, ver_hint=5)
    assert [n for n, _, _ in client.calls] == [3, 3, 1]  # rollout_decode_batch_size = 3, not the learner's batch
    assert all(v == 5 for _, _, v in client.calls) and all(r.ver == 7 for r in rollouts) and len(rollouts) == 7
    again = RecordingClient()
    pipeline.rollout_batch(samples, again, ver_hint=5)
    assert [s for _, s, _ in again.calls] == [s for _, s, _ in client.calls]
    assert client.calls[0][1] == rollout_seed(cfg.training.seed, [s.key for s in samples[:3]])
    assert rollout_seed(1, ["a@0"]) != rollout_seed(0, ["a@0"]) != rollout_seed(0, ["a@1"])
    sampling = pipeline.sampling(["x"])
    d = cfg.rollout_matching.decoding
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (d.temperature, d.top_p, d.max_new_tokens)


# --------------------------------------------------------------------------------------------- stream


def write_jsonl(path, n):
    path.write_text("".join(json.dumps({"id": f"r{i}", "images": ["x.png"], "width": 8, "height": 8, "objects": []}) + "\n"
                            for i in range(n)))
    return path


def take(stream, n):
    it = iter(stream)
    return [next(it) for _ in range(n)]


def test_actor_shards_partition_the_data_and_each_stream_is_deterministic(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", 23)
    seen = []
    for rank in range(2):
        for index in range(3):
            s = SampleStream(path, rank=rank, world_size=2, index=index, num_actors_per_rank=3, seed=1)
            first = [x.sample_id for x in take(s, len(s))]
            seen += first
            again = SampleStream(path, rank=rank, world_size=2, index=index, num_actors_per_rank=3, seed=1)
            assert [x.sample_id for x in take(again, len(s))] == first
    assert sorted(seen) == sorted(f"r{i}" for i in range(23))


def test_every_epoch_reshuffles_and_keys_are_unique_over_the_infinite_stream(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", 40)
    s = SampleStream(path, rank=0, world_size=1, seed=3)
    items = take(s, 120)
    e0, e1 = [x.sample_id for x in items[:40]], [x.sample_id for x in items[40:80]]
    assert sorted(e0) == sorted(e1) and e0 != e1
    assert len({x.key for x in items}) == 120 and items[40].key.endswith("@1")
    other = SampleStream(path, rank=0, world_size=1, seed=4)
    assert [x.sample_id for x in take(other, 40)] != e0  # the seed matters


def test_resume_skips_exactly_the_keys_in_the_learners_b_ledger(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", 10)
    full = [x.key for x in take(SampleStream(path, rank=0, world_size=1, seed=0), 25)]
    trained = set(full[:6]) - {full[2]}  # full[2] was produced but dropped stale: it must come back
    ckpt = tmp_path / "run" / "checkpoints" / "40"
    ckpt.mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "7").mkdir()
    (ckpt / "b_ledger.json").write_text(json.dumps({"rank": 0, "trained_ids": sorted(trained)}))
    assert resolve_resume_checkpoint("auto", tmp_path / "run") == ckpt
    assert resolve_resume_checkpoint(None, tmp_path / "run") is None
    keys = read_b_ledger(ckpt, 0)
    assert keys == trained and read_b_ledger(ckpt, 1) == set()
    resumed = SampleStream(path, rank=0, world_size=1, seed=0, skip_keys=keys)
    got = [x.key for x in take(resumed, 25 - len(trained))]
    assert got == [k for k in full if k not in trained]
    assert resumed.skipped == len(trained)


def test_the_pack_ledger_records_every_sent_pack(tmp_path):
    ledger = PackLedger(tmp_path / "l.jsonl")
    ledger.record(0, 3, ["a@0", "b@0"])
    ledger.record(1, 4, ["c@0"])
    ledger.close()
    assert PackLedger.read(tmp_path / "l.jsonl") == [{"seq": 0, "ver": 3, "keys": ["a@0", "b@0"]},
                                                     {"seq": 1, "ver": 4, "keys": ["c@0"]}]


# --------------------------------------------------------------------------------------------- credits


def credits(target=4, depth=0, received_total=0, actors=None, ver=0, window=1):
    return Credits(schema=1, rank=0, ver_current=ver, depth=depth, target=target, version_window=window,
                   received_total=received_total, ts=0.0, actors=actors or {})


def test_the_target_is_split_fairly_between_the_actors_of_a_rank():
    assert [fair_share(5, 2, i) for i in range(2)] == [3, 2]
    assert [fair_share(8, 3, i) for i in range(3)] == [3, 3, 2]
    assert fair_share(1, 3, 2) == 1  # every actor can make progress


def test_outstanding_packs_never_exceed_the_share_even_with_late_credits():
    gate = CreditGate("a", 0, 1)
    assert gate.room == 0  # no credits yet: nothing may be sent
    gate.on_credits(credits(target=3))
    for _ in range(3):
        assert gate.room > 0
        gate.on_sent()
    assert gate.room == 0 and gate.in_transit == 3
    gate.on_credits(credits(target=3, received_total=2, actors={"a": [1, 2]}))  # 2 arrived, still queued
    assert (gate.in_transit, gate.queued, gate.room) == (1, 2, 0)
    gate.on_credits(credits(target=3, received_total=3, actors={"a": [2, 1]}))  # 2 consumed
    assert gate.room == 2
    assert gate.stale_below() == -1


def test_a_learner_restart_returns_the_credit_of_packs_that_died_with_it():
    gate = CreditGate("a", 0, 1)
    gate.on_credits(credits(target=2))
    gate.on_sent(), gate.on_sent()
    gate.on_credits(credits(target=2, received_total=2, actors={"a": [1, 2]}))
    assert gate.room == 0
    gate.on_credits(credits(target=2, received_total=0, actors={}))  # new learner: never heard of us
    assert gate.restarts == 1 and gate.room == 2


def test_aggregate_credits_work_for_a_learner_that_does_not_report_per_actor():
    gate = CreditGate("a", 0, 1)
    gate.on_credits(credits(target=2))
    gate.on_sent(), gate.on_sent()
    assert gate.room == 0
    gate.on_credits(credits(target=2, depth=1, received_total=2))
    assert (gate.in_transit, gate.queued, gate.room) == (0, 1, 1)


def test_packs_never_acknowledged_are_counted_lost_after_the_timeout():
    now = [0.0]
    gate = CreditGate("a", 0, 1, lost_pack_timeout_s=10, clock=lambda: now[0])
    gate.on_credits(credits(target=1, actors={"b": [0, 0]}))
    gate.on_sent()
    now[0] = 11.0
    gate.on_credits(credits(target=1, actors={"b": [0, 0]}))
    assert gate.lost_packs == 1 and gate.room == 1
