"""The ready queue and the step decision (one process), without a model."""

from __future__ import annotations

import queue
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.packing.segment import Pack
from common.wire.codec import decode_credits, pack_to_frames
from learner.decision import decide_step
from learner.distributed import Dist
from learner.pack_queue import COUNTER_NAMES, ReadyQueue
from tests.factories import make_segment


def frames(ver: int, sample_id: str, seq: int = 0, actor: str = "fake-r0"):
    return pack_to_frames(Pack(ver=ver, channel="B", segments=[make_segment(12, ver, sample_id)]), actor, seq)


def make_queue(**kw) -> ReadyQueue:
    args = dict(rank=0, queue_limit=3, version_window=1, target=2)
    return ReadyQueue(**{**args, **kw})


def test_a_full_queue_drops_the_oldest_pack_and_counts_it():
    q = make_queue()
    for i in range(5):
        assert q.push_frames(frames(0, f"s{i}", seq=i))
    assert q.check_conservation()["oldest_dropped"] == 2
    assert [p.sample_ids[0] for p in q.reserve(3)] == ["s2", "s3", "s4"]


def test_stale_packs_are_dropped_on_arrival_and_on_every_look():
    q = make_queue(ver_current=5)
    assert not q.push_frames(frames(3, "arrives-stale"))  # 3 < 5 - 1
    assert q.push_frames(frames(4, "fresh-then-stale"))
    assert q.push_frames(frames(6, "fresh"))
    assert q.eligible() == 2
    q.set_ver(6)  # 4 < 6 - 1: pruned at the next look, whatever its position
    assert q.eligible() == 1
    c = q.check_conservation()
    assert c["stale_dropped"] == 2 and c["in_queue"] == 1


def test_reserve_takes_the_oldest_eligible_packs_and_training_them_fills_the_ledger():
    q = make_queue(queue_limit=8, ver_current=1)
    for i, ver in enumerate([2, 1, 2, 2]):  # vers need not arrive in order (2 = ver_current + 1: admitted)
        q.push_frames(frames(ver, f"s{i}", seq=i))
    q.set_ver(3)  # ver 1 is stale now
    taken = q.reserve(2)
    assert [p.sample_ids[0] for p in taken] == ["s0", "s2"]
    assert q.snapshot()["reserved"] == 2
    for p in taken:
        q.mark_trained(p)
    assert q.trained_ids == {"s0", "s2"}
    c = q.check_conservation()
    assert (c["trained"], c["reserved"], c["in_queue"], c["stale_dropped"]) == (2, 0, 1, 1)
    with pytest.raises(RuntimeError, match="only 1 eligible"):
        q.reserve(2)


def test_malformed_messages_and_already_trained_samples_are_dropped_and_counted_never_raised():
    q = make_queue(trained_ids={"done@0"})
    assert not q.push_frames([b"\x00garbage"])
    assert not q.push_frames([b"header only"] + [b"x"] * 3)
    assert not q.push_frames(frames(0, "done@0"))
    c = q.check_conservation()
    assert c["malformed"] == 2 and c["received"] == 1 and c["duplicate_dropped"] == 1


def test_the_receiver_thread_drains_its_source_and_publishes_credits_periodically_and_on_a_ver_change():
    inbox: queue.Queue = queue.Queue()
    published: list[bytes] = []

    def recv(timeout_s):
        try:
            return inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    q = make_queue(recv=recv, publish=published.append, credit_interval_s=0.05, poll_s=0.01)
    q.start()
    try:
        inbox.put(frames(0, "a", seq=0, actor="actor-r0-0"))
        inbox.put(frames(0, "b", seq=1, actor="actor-r0-0"))
        deadline = time.monotonic() + 5
        while q.snapshot()["in_queue"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.15)
        credits = decode_credits(published[-1])
        assert (credits.depth, credits.target, credits.received_total) == (2, 2, 2)
        assert credits.actors == {"actor-r0-0": [1, 2]}
        n = len(published)
        q.set_ver(7)
        deadline = time.monotonic() + 5
        while not any(decode_credits(f).ver_current == 7 for f in published[n:]) and time.monotonic() < deadline:
            time.sleep(0.01)
        latest = decode_credits(published[-1])
        assert latest.ver_current == 7 and latest.depth == 0 and latest.actors == {"actor-r0-0": [1, 0]}
    finally:
        q.stop()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "ver", "reserve", "train", "look"]), st.integers(0, 6)), max_size=40))
def test_conservation_holds_after_any_sequence_of_events(events):
    q = make_queue(queue_limit=4, version_window=1)
    held, seq = [], 0
    for op, arg in events:
        if op == "push":
            q.push_frames(frames(arg, f"s{seq}", seq=seq))
            seq += 1
        elif op == "ver":
            q.set_ver(max(q.ver_current, arg))
        elif op == "reserve" and q.eligible() >= 1:
            held += q.reserve(1)
        elif op == "train" and held:
            q.mark_trained(held.pop())
        else:
            q.eligible()
        c = q.check_conservation()
        assert c["reserved"] == len(held)
    assert set(q.snapshot()) == set(COUNTER_NAMES)


# --------------------------------------------------------------------------------------------- decision


class _Counted:
    def __init__(self, n):
        self.n, self.reserved = n, 0

    def eligible(self):
        return self.n

    def reserve(self, k):
        self.reserved += k
        return [object()] * k


def test_the_decision_takes_b_only_when_the_policy_wants_it_and_ga_packs_are_eligible():
    dist = Dist("gloo")  # a world of one: the collectives are the identity
    half = Fraction(1, 2)
    assert decide_step(0, half, 2, _Counted(5), dist).kind == "A"  # policy: A at step 0
    d = decide_step(1, half, 2, (q := _Counted(5)), dist)
    assert (d.kind, d.policy_wants_b, d.skipped_due_to_queue, len(d.packs), q.reserved) == ("B", True, False, 2, 2)
    short = decide_step(1, half, 2, (q := _Counted(1)), dist)
    assert (short.kind, short.skipped_due_to_queue, q.reserved) == ("A", True, 0)


def test_the_decision_waits_up_to_pack_wait_s_for_a_short_queue():
    class Filling(_Counted):
        def eligible(self):
            self.n += 1  # one more pack arrives per look
            return self.n

    t0 = time.monotonic()
    d = decide_step(1, Fraction(1), 4, Filling(0), Dist("gloo"), wait_s=5.0, poll_s=0.001)
    assert d.kind == "B" and time.monotonic() - t0 < 5.0
    t0 = time.monotonic()
    d = decide_step(1, Fraction(1), 4, _Counted(0), Dist("gloo"), wait_s=0.2, poll_s=0.01)
    assert d.kind == "A" and d.skipped_due_to_queue and 0.2 <= time.monotonic() - t0 < 2.0
