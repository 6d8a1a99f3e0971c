"""The actor loop in-process: real encoder, real ZMQ to a fake learner rank, a scripted rollout client.

The scripted client stands in for the rollout server only so that its failures and versions can be
chosen (server down, stale vers, ver advances, refused samples); the real server is exercised by
``test_actor_process.py``.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from actor.client import RolloutRequestError, RolloutUnavailable
from actor.loop import EXIT_NO_LEARNER, EXIT_OK, ActorLoop
from common.detection.answer import IM_END, serialize_objects
from common.data.records import GTObject
from common.config.load import load_config
from tests.fake_learner import FakeLearnerRank
from tests.ports import free_port_block

DEADLINE_S = 60.0


class ScriptedClient:
    """``infer`` like ``RolloutClient``: fails the first ``fail_first`` calls, then answers one object under ``ver``."""

    def __init__(self, tokenizer, *, fail_first: int = 0, vers=(0,), refuse_key: str | None = None):
        self.tokenizer, self.fail_first, self.vers, self.refuse_key = tokenizer, fail_first, list(vers), refuse_key
        self.calls: list[tuple[list[str], int | None]] = []
        self._lock = threading.Lock()

    def infer(self, items, sampling, *, min_ver=None, client=None):
        with self._lock:
            self.calls.append(([i.id for i in items], min_ver))
            n = len(self.calls)
        time.sleep(0.02)
        if n <= self.fail_first:
            raise RolloutUnavailable("no rollout server accepts connections (scripted)")
        if self.refuse_key is not None and any(i.id == self.refuse_key for i in items):
            raise RolloutRequestError(f"item {self.refuse_key}: image not found (scripted)", 400, "items.0.images.0")
        ver = self.vers[min(n - 1 - self.fail_first, len(self.vers) - 1)]
        answer = serialize_objects([GTObject("red circle", (10, 20, 300, 400))]) + IM_END
        ids = self.tokenizer.encode(answer, add_special_tokens=False)
        outputs = [type("Out", (), {"token_ids": ids, "ver": ver, "finish_reason": "stop", "prompt_token_ids": None})()
                   for _ in items]
        return type("Result", (), {"outputs": outputs})()


@pytest.fixture(scope="module")
def encoder(tiny_model_dir, synth_data_dir):
    from common.packing.encode import Encoder

    return Encoder(tiny_model_dir, 1024, image_root=str(synth_data_dir))


@pytest.fixture
def make(tiny_model_dir, synth_data_dir, tmp_path, encoder):
    def build(client, *overrides):
        cfg = load_config("configs/demo_cpu.yaml", [
            f"model.path={tiny_model_dir}", f"data.train_jsonl={synth_data_dir / 'train.jsonl'}",
            f"training.output_dir={tmp_path}", f"transport.base_port={free_port_block(2)}",
            "actor.metrics_every_s=0.5", "actor.learner_wait_timeout_s=10", "actor.stop_timeout_s=20",
            "training.pack_max_wait_s=0.3", "actor.server_backoff_max_s=0.5", "learner.nproc_per_node=1",
            # the scenarios script server answers per call of 2 (the demo decodes 16 per call)
            "stage2_ab.channel_b.rollout_decode_batch_size=2", "training.packing_min_fill_ratio=0.5", *overrides,
        ])
        return ActorLoop(cfg, 0, 0, encoder=encoder, client=client, config_path="configs/demo_cpu.yaml")

    return build


def run_with_deadline(loop: ActorLoop) -> int:
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(loop.run()), daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    if thread.is_alive():
        loop.request_stop()
        thread.join(10)
        raise AssertionError(f"actor loop did not finish within {DEADLINE_S}s")
    return result[0]


def test_the_actor_backs_off_while_the_server_is_down_and_carries_on_when_it_returns(make, encoder):
    client = ScriptedClient(encoder.tokenizer, fail_first=3)
    loop = make(client, "actor.max_samples=6")
    with FakeLearnerRank(loop.cfg.transport, consume_every_s=0.05) as learner:
        assert run_with_deadline(loop) == EXIT_OK
    c = loop.counters()
    assert c["actor/server_errors"] == 3 and c["actor/conservation_ok"] == 1
    keys = [k for r in learner.received for k in r.keys]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 6  # the failed batches were retried, nothing lost


def test_rollouts_that_would_arrive_stale_are_dropped_before_packing_and_rolled_out_again(make, encoder):
    client = ScriptedClient(encoder.tokenizer, vers=(2, 2, 5))  # the learner is at ver 5, window 1
    loop = make(client, "actor.max_samples=6")
    with FakeLearnerRank(loop.cfg.transport, ver_current=5, version_window=1, consume_every_s=0.05) as learner:
        assert run_with_deadline(loop) == EXIT_OK
    c = loop.counters()
    assert c["actor/stale_dropped"] >= 2 and c["actor/conservation_ok"] == 1
    assert {r.ver for r in learner.received} == {5}
    assert sorted(k for r in learner.received for k in r.keys) == sorted({k for r in learner.received for k in r.keys})
    assert len([k for r in learner.received for k in r.keys]) == 6
    assert all(min_ver == 4 for _, min_ver in client.calls)  # never asked for what would arrive stale


@pytest.mark.parametrize("policy", ["flush", "drop"])
def test_a_server_ver_advance_flushes_or_drops_old_leftovers_and_never_mixes_vers(make, encoder, policy):
    client = ScriptedClient(encoder.tokenizer, vers=(0, 1, 1, 1))
    loop = make(client, "actor.max_samples=8", "training.packing_min_fill_ratio=1.0", "training.pack_max_wait_s=60",
                f"actor.flush_policy={policy}", "actor.max_inflight_batches=1")
    with FakeLearnerRank(loop.cfg.transport, target=8, version_window=5, consume_every_s=0.05) as learner:
        assert run_with_deadline(loop) == EXIT_OK
    c = loop.counters()
    assert all(set(r.segment_vers) == {r.ver} for r in learner.received)
    assert c["actor/conservation_ok"] == 1
    vers = [r.ver for r in learner.received]
    if policy == "flush":
        assert vers[0] == 0 and set(vers[1:]) == {1} and c["actor/flushed_dropped"] == 0
    else:
        assert set(vers) == {1} and c["actor/flushed_dropped"] == 2


def test_a_stop_request_finishes_rollouts_flushes_and_sends_everything_before_exiting(make, encoder):
    loop = make(ScriptedClient(encoder.tokenizer), "training.pack_max_wait_s=60", "training.packing_min_fill_ratio=1.0")
    with FakeLearnerRank(loop.cfg.transport, target=4, consume_every_s=0.05) as learner:
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(loop.run()), daemon=True)
        thread.start()
        deadline = time.monotonic() + DEADLINE_S
        while loop.counters()["actor/segments_built"] < 3:
            assert time.monotonic() < deadline and thread.is_alive(), "no segments built in time"
            time.sleep(0.05)
        loop.request_stop()
        thread.join(DEADLINE_S)
        assert not thread.is_alive() and result == [EXIT_OK]
    c = loop.counters()
    assert c["actor/dropped_at_stop"] == 0 and c["actor/segments_sent"] == c["actor/segments_built"] >= 3
    assert len([k for r in learner.received for k in r.keys]) == c["actor/segments_sent"]


def test_an_absent_learner_is_waited_for_then_named_with_the_command_that_starts_it(make, encoder, caplog):
    loop = make(ScriptedClient(encoder.tokenizer), "actor.learner_wait_timeout_s=1")
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="actor.learner_link"):
        assert run_with_deadline(loop) == EXIT_NO_LEARNER
    assert time.monotonic() - t0 < 10
    assert loop.link.subscriber.endpoint in caplog.text and "torchrun --nproc_per_node=1 learner/main.py" in caplog.text
    assert "actor.learner_wait_timeout_s" in caplog.text


def test_a_sample_the_server_refuses_is_dropped_and_the_rest_of_its_batch_goes_through(make, encoder):
    loop = make(ScriptedClient(encoder.tokenizer), "actor.max_samples=4")
    first_keys = [next(iter(loop.stream)).key]
    loop.client.refuse_key = first_keys[0]
    with FakeLearnerRank(loop.cfg.transport, target=4, consume_every_s=0.05) as learner:
        assert run_with_deadline(loop) == EXIT_OK
    c = loop.counters()
    keys = sorted(k for r in learner.received for k in r.keys)
    assert c["actor/rejected_samples"] == 1 and first_keys[0] not in keys and len(keys) == 3


def test_with_a_share_of_one_pack_the_actor_fills_its_pack_instead_of_waiting_for_the_timeout(make, encoder):
    # One pack of credit (target 1), decode batches of 2, a release fill most pairs of segments miss
    # (segments here are ~270-610 of 1024 tokens) and a timeout the run must never need: the actor has to
    # start the batch that fills the open pack while it holds its only credit's worth of work.
    loop = make(ScriptedClient(encoder.tokenizer), "actor.max_samples=8", "training.packing_min_fill_ratio=0.75",
                "training.pack_max_wait_s=20", "stage2_ab.channel_b.rollout_decode_batch_size=2")
    with FakeLearnerRank(loop.cfg.transport, target=1, consume_every_s=0.05) as learner:
        assert run_with_deadline(loop) == EXIT_OK
    c = loop.counters()
    assert loop.gate.share == 1 and learner.max_unconsumed <= 1
    assert c["actor/underfilled_packs"] == 0, "a pack waited for pack_max_wait_s although the actor could fill it"
    pc, capacity = loop.packer.counters, loop.packer.counters["packs_emitted"] * loop.packer.packing_length
    assert c["actor/fill_lost_wait_tokens"] == 0 and c["actor/flushed_packs"] == pc["flushed_packs"]
    assert sum(c[f"actor/fill_lost_{r}_tokens"] for r in ("ready", "wait", "flush")) == capacity - pc["tokens_packed"]
    release = loop.packer.release_tokens
    sent = [sum(s["length"] for s in r.meta["segments"]) for r in learner.received]
    assert sum(n >= release for n in sent) >= 2, sent  # filled packs (the stop flushes the rest at any fill)
    assert len([k for r in learner.received for k in r.keys]) == 8 and c["actor/conservation_ok"] == 1


# ------------------------------------------------------------------------ the learner's done, actor restarts


def test_credits_say_done_only_in_a_ranks_last_message_and_messages_without_it_still_decode():
    from common.wire.codec import ProtocolError, decode_credits, encode_credits

    fields = dict(rank=0, ver_current=3, depth=1, target=2, version_window=1, received_total=5)
    plain = encode_credits(**fields, ts=1.0)
    assert b"done" not in plain  # an ordinary message is byte-identical to what older actors decode
    assert not decode_credits(plain).done
    assert decode_credits(encode_credits(**fields, done=True)).done
    import msgpack

    with pytest.raises(ProtocolError, match="'done' must be true or false"):
        decode_credits(msgpack.packb({**msgpack.unpackb(plain), "done": 1}))


def test_the_actor_exits_0_within_seconds_when_its_learner_rank_closes_its_ready_queue(make, encoder):
    from common.wire.transport import CreditPublisher, PackReceiver, credit_endpoint, pack_endpoint
    from learner.pack_queue import ReadyQueue

    loop = make(ScriptedClient(encoder.tokenizer))  # no max_samples: it runs until something stops it
    t = loop.cfg.transport
    receiver, publisher = PackReceiver(pack_endpoint(t, 0), hwm=16), CreditPublisher(credit_endpoint(t, 0))
    queue = ReadyQueue(rank=0, queue_limit=4, version_window=1, target=2, recv=receiver.recv,
                       publish=publisher.publish, credit_interval_s=0.1)
    queue.start()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(loop.run()), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + DEADLINE_S
        while queue.snapshot()["received"] < 2:  # the actor is at work (and soon waits for credits)
            assert time.monotonic() < deadline and thread.is_alive(), "the actor sent no packs in time"
            time.sleep(0.05)
        t0 = time.monotonic()
        queue.stop()  # what the learner does last (learner/rank.py close): the final credits say done
    finally:
        receiver.close()
        publisher.close()
    thread.join(DEADLINE_S)
    waited = time.monotonic() - t0
    if thread.is_alive():
        loop.request_stop()
        thread.join(10)
    assert result == [EXIT_OK] and waited < 3.0, (result, waited)
    c = loop.counters()
    assert c["actor/conservation_ok"] == 1 and c["actor/segments_sent"] >= 2


def _stream_keys(loop: ActorLoop, n: int) -> list[str]:
    from actor.stream import SampleStream

    s = loop.stream
    it = iter(SampleStream(s.path, rank=0, world_size=1, index=0, num_actors_per_rank=1, seed=s.seed))
    return [next(it).key for _ in range(n)]


def test_a_restarted_actor_skips_what_the_live_rank_holds_and_produces_again_what_died_with_its_predecessor(
        make, encoder):
    first = make(ScriptedClient(encoder.tokenizer), "training.pack_max_wait_s=60")
    port = first.cfg.transport.base_port
    with FakeLearnerRank(first.cfg.transport, target=2, consume_every_s=0.4) as learner:
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(first.run()), daemon=True)
        thread.start()
        deadline = time.monotonic() + DEADLINE_S
        while len(learner.received) < 3 or first.counters()["actor/samples_taken"] <= len(
                [k for r in learner.received for k in r.keys]):
            assert time.monotonic() < deadline and thread.is_alive(), "the first actor made no progress in time"
            time.sleep(0.02)
        # die like `kill -9`: from this instant nothing more is sent, nothing flushed; ZMQ's queue goes with the socket
        first.link.send, first._drain = (lambda requeue: None), (lambda: None)
        first.request_stop()
        thread.join(DEADLINE_S)
        held = [k for r in learner.received for k in r.keys]
        taken = first.counters()["actor/samples_taken"]
        assert taken > len(held), "nothing died with the first actor: the test would prove nothing"
        last_seq, n_first = max(r.seq for r in learner.received), len(learner.received)

        learner.consume_every_s = 0.05
        second = make(ScriptedClient(encoder.tokenizer), f"transport.base_port={port}",
                      f"actor.max_samples={taken - len(held) + 4}")
        assert run_with_deadline(second) == EXIT_OK
        time.sleep(0.3)  # the last packs reach the fake rank
    keys = [k for r in learner.received for k in r.keys]
    assert len(keys) == len(set(keys)), "a sample the rank already held was produced again"
    assert set(keys) == set(_stream_keys(second, len(keys))), "a sample that died with the first actor is missing"
    assert second.counters()["actor/rejoins"] == 1 and second.counters()["actor/resume_skipped"] == len(held)
    later = [r.seq for r in learner.received[n_first:]]
    assert later and min(later) > last_seq, "the restarted actor's seqs must continue its id's, not restart at 0"
    assert learner.max_unconsumed <= 2 and second.counters()["actor/conservation_ok"] == 1
