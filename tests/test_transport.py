"""ZMQ links between actors and learner ranks, over real loopback sockets (fresh ports per test)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from common.config.learner import LearnerConfig
from common.config.schema import TransportConfig
from common.packing.segment import Pack
from common.wire.transport import (ActorTally, CreditPublisher, CreditSubscriber, PackReceiver, PackSender,
                                   TransportTimeout, credit_endpoint, learner_host, pack_endpoint)
from common.wire.codec import encode_credits, frames_to_pack, pack_to_frames
from tests.factories import make_segment
from tests.ports import free_port_block


@pytest.fixture
def cfg():
    return TransportConfig(host="127.0.0.1", base_port=free_port_block(4), hwm=16)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def a_pack(ver: int = 3, n: int = 3) -> Pack:
    return Pack(ver=ver, channel="B", segments=[make_segment(20 + 7 * k, ver, f"s{k}", n_images=k % 2) for k in range(n)])


def recv_within(receiver: PackReceiver, deadline_s: float):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        frames = receiver.recv(0.1)
        if frames is not None:
            return frames
    raise AssertionError(f"no pack arrived at {receiver.endpoint} within {deadline_s}s")


def test_endpoints_of_every_rank_come_from_one_function_and_never_collide():
    cfg = TransportConfig(host="10.0.0.5", base_port=5600)
    assert pack_endpoint(cfg, 0) == "tcp://10.0.0.5:5600"
    assert credit_endpoint(cfg, 0) == "tcp://10.0.0.5:5601"
    assert pack_endpoint(cfg, 3) == "tcp://10.0.0.5:5606"
    assert credit_endpoint(cfg, 3) == "tcp://10.0.0.5:5607"
    all_endpoints = [f(cfg, r) for r in range(8) for f in (pack_endpoint, credit_endpoint)]
    assert len(set(all_endpoints)) == len(all_endpoints)
    with pytest.raises(ValueError, match="rank"):
        pack_endpoint(cfg, -1)


def test_each_rank_is_addressed_on_its_learner_nodes_host_with_ports_by_global_rank():
    cfg = TransportConfig(host="127.0.0.1", base_port=5600)
    two_nodes = LearnerConfig(nproc_per_node=2, nnodes=2, node_hosts=["10.0.0.1", "10.0.0.2"])
    assert [learner_host(cfg, r, two_nodes) for r in range(4)] == ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
    assert pack_endpoint(cfg, 1, two_nodes) == "tcp://10.0.0.1:5602"
    assert pack_endpoint(cfg, 2, two_nodes) == "tcp://10.0.0.2:5604"  # global rank: node 1's first rank
    assert credit_endpoint(cfg, 3, two_nodes) == "tcp://10.0.0.2:5607"
    assert pack_endpoint(cfg, 3, LearnerConfig(nproc_per_node=4)) == "tcp://127.0.0.1:5606"  # one node: transport.host
    assert pack_endpoint(cfg, 0, LearnerConfig(node_hosts=["fd00::1"])) == "tcp://[fd00::1]:5600"
    with pytest.raises(ValueError, match="learner.node_hosts lists 2 nodes"):
        pack_endpoint(cfg, 4, two_nodes)


def test_a_rank_binds_only_its_nodes_address_so_a_pack_aimed_at_another_node_is_not_accepted(cfg, ctx):
    """Two "nodes" on one machine (127.0.0.1 and 127.0.0.2 are both loopback on Linux): rank 1 of node 1
    binds 127.0.0.2 only; its actor, addressed by the same function, reaches it; a sender aimed at node 0's
    address for rank 1's port finds nobody."""
    nodes = LearnerConfig(nproc_per_node=1, nnodes=2, node_hosts=["127.0.0.1", "127.0.0.2"])
    receiver = PackReceiver(pack_endpoint(cfg, 1, nodes), hwm=cfg.hwm, ctx=ctx)
    sender = PackSender(pack_endpoint(cfg, 1, nodes), hwm=cfg.hwm, ctx=ctx)
    stray = PackSender(pack_endpoint(cfg, 1), hwm=cfg.hwm, ctx=ctx)  # transport.host = 127.0.0.1
    try:
        assert receiver.endpoint.startswith("tcp://127.0.0.2:")
        assert sender.send(pack_to_frames(a_pack(), "actor-r1-0", 0), timeout_s=5.0)
        assert frames_to_pack(recv_within(receiver, 5.0))[0].actor == "actor-r1-0"
        assert not stray.send(pack_to_frames(a_pack(), "stray", 0), timeout_s=0.5)
    finally:
        for sock in (stray, sender, receiver):
            sock.close()


def test_a_pack_round_trips_bit_identical_through_push_and_pull(cfg, ctx):
    receiver = PackReceiver(pack_endpoint(cfg, 1), hwm=cfg.hwm, ctx=ctx)
    sender = PackSender(pack_endpoint(cfg, 1), hwm=cfg.hwm, ctx=ctx)
    try:
        pack = a_pack()
        sent = pack.tensors()
        assert sender.send(pack_to_frames(pack, "actor-r1-0", 0), timeout_s=5.0)
        frames = recv_within(receiver, 5.0)
        assert all(isinstance(f, zmq.Frame) for f in frames)  # zero-copy receive
        message, back = frames_to_pack(frames)
        assert (message.actor, message.seq, message.ver) == ("actor-r1-0", 0, 3)
        got = back.tensors()
        for name, array in sent.items():
            assert got[name].dtype == array.dtype and got[name].tobytes() == array.tobytes(), name
        assert [s.sample_id for s in back.segments] == ["s0", "s1", "s2"]
    finally:
        sender.close()
        receiver.close()


def test_the_sender_survives_a_receiver_restart_on_the_same_port(cfg, ctx):
    endpoint = pack_endpoint(cfg, 0)
    sender = PackSender(endpoint, hwm=cfg.hwm, ctx=ctx)
    receiver = PackReceiver(endpoint, hwm=cfg.hwm, ctx=ctx)
    try:
        assert sender.send(pack_to_frames(a_pack(ver=1), "a", 0), timeout_s=5.0)
        assert frames_to_pack(recv_within(receiver, 5.0))[0].seq == 0
        receiver.close()

        # While nobody listens, IMMEDIATE makes the send wait and report failure instead of queueing.
        # ZMQ notices the dropped connection asynchronously: sends in that short gap go into the dying
        # pipe and are lost (the actor's lost-pack timeout releases their credit), so wait for it.
        seq, deadline = 1, time.monotonic() + 10.0
        while True:
            t0 = time.monotonic()
            accepted = sender.send(pack_to_frames(a_pack(ver=1), "a", seq), timeout_s=0.3)
            seq += 1
            if not accepted:
                assert time.monotonic() - t0 < 2.0
                break
            assert time.monotonic() < deadline, "the sender never noticed the receiver was gone"
            time.sleep(0.05)

        receiver = PackReceiver(endpoint, hwm=cfg.hwm, ctx=ctx)  # the learner comes back
        assert sender.send(pack_to_frames(a_pack(ver=2), "a", 100), timeout_s=10.0), "no reconnect within 10 s"
        message, pack = frames_to_pack(recv_within(receiver, 5.0))
        assert (message.seq, pack.ver) == (100, 2)
        for s in range(101, 104):  # and keeps flowing
            assert sender.send(pack_to_frames(a_pack(ver=2), "a", s), timeout_s=5.0)
        assert [frames_to_pack(recv_within(receiver, 5.0))[0].seq for _ in range(3)] == [101, 102, 103]
    finally:
        sender.close()
        receiver.close()


def test_a_send_with_no_learner_times_out_with_a_message_naming_the_endpoint_and_the_command(cfg, ctx):
    endpoint = pack_endpoint(cfg, 2)
    sender = PackSender(endpoint, ctx=ctx)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout) as info:
            sender.send_or_raise(pack_to_frames(a_pack(), "a", 0), timeout_s=0.5)
        assert 0.4 < time.monotonic() - t0 < 3.0
        text = str(info.value)
        assert endpoint in text and "learner/main.py" in text and "--config" in text
    finally:
        sender.close()


def test_several_actors_fan_in_to_one_rank(cfg, ctx):
    receiver = PackReceiver(pack_endpoint(cfg, 0), ctx=ctx)
    senders = [PackSender(pack_endpoint(cfg, 0), ctx=ctx) for _ in range(3)]
    try:
        for i, s in enumerate(senders):
            for seq in range(2):
                assert s.send(pack_to_frames(a_pack(n=1), f"actor-r0-{i}", seq), timeout_s=5.0)
        got = sorted((frames_to_pack(recv_within(receiver, 5.0))[0].actor, seq) for seq in range(6))
        assert sorted(a for a, _ in got) == sorted([f"actor-r0-{i}" for i in range(3)] * 2)
    finally:
        for s in senders:
            s.close()
        receiver.close()


def credits_frame(ver: int, depth: int, **kw) -> bytes:
    return encode_credits(rank=0, ver_current=ver, depth=depth, target=4, version_window=1, received_total=0, **kw)


def test_a_subscriber_keeps_only_the_newest_credits_and_counts_garbage(cfg, ctx):
    publisher = CreditPublisher(credit_endpoint(cfg, 0), ctx=ctx)
    subscriber = CreditSubscriber(credit_endpoint(cfg, 0), ctx=ctx)
    garbage = ctx.socket(zmq.PUB)
    try:
        # Slow joiner: publish periodically until the first one is heard (what the learner does).
        deadline = time.monotonic() + 5.0
        while subscriber.poll(0.05) is None:
            assert time.monotonic() < deadline, "subscriber never joined"
            publisher.publish(credits_frame(ver=0, depth=0))
        for depth in range(1, 6):
            publisher.publish(credits_frame(ver=7, depth=depth))
        time.sleep(0.2)
        latest = subscriber.poll(0.5)
        assert (latest.ver_current, latest.depth) == (7, 5)

        port = cfg.base_port + 3
        garbage.bind(f"tcp://127.0.0.1:{port}")
        bad = CreditSubscriber(f"tcp://127.0.0.1:{port}", ctx=ctx)
        deadline = time.monotonic() + 5.0
        while bad.invalid == 0:
            assert time.monotonic() < deadline, "garbage never counted"
            garbage.send(b"\x00not msgpack")
            bad.poll(0.05)
        assert bad.latest is None
        bad.close()
    finally:
        garbage.close(linger=0)
        subscriber.close()
        publisher.close()


def test_waiting_for_credits_from_an_absent_learner_times_out_naming_the_endpoint(cfg, ctx):
    subscriber = CreditSubscriber(credit_endpoint(cfg, 1), ctx=ctx)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout, match=credit_endpoint(cfg, 1)) as info:
            subscriber.wait_first(0.5)
        assert "learner/main.py" in str(info.value)
        assert time.monotonic() - t0 < 3.0
    finally:
        subscriber.close()


def test_actor_tally_reports_last_seq_and_queued_per_actor():
    tally = ActorTally()
    for seq in range(3):
        tally.received("a0", seq)
    tally.received("a1", 0)
    tally.left_queue("a0", 2)
    assert tally.as_map() == {"a0": [2, 1], "a1": [0, 1]}
    tally.left_queue("a1", 5)
    assert tally.as_map()["a1"] == [0, 0]
    assert np.all(np.array(list(tally.queued.values())) >= 0)
