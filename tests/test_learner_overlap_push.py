"""learner/weight_sync/overlap.py on its own: the snapshot, one push at a time, deadlines, shutdown (one process, no server).

The push function is a test double that blocks on an event, so every state of the thread (in flight,
committed, failed, stuck past its deadline, late) is reached on purpose rather than by timing.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from learner.weight_sync.overlap import BackgroundPush, WeightSnapshot


class GatedPush:
    """A push that waits for ``release`` and then returns ``(ver + 1, ok, timings)``."""

    def __init__(self, ok: bool = True) -> None:
        self.release = threading.Event()
        self.ok = ok
        self.calls: list[tuple[int, int, list[float]]] = []
        self.entered = threading.Event()

    def __call__(self, tensors, step, ver):
        self.calls.append((step, ver, [float(t.sum()) for _, t in tensors]))
        self.entered.set()
        self.release.wait(30)
        return ver + 1, int(self.ok), {"time/sync_wire": 0.01}


def pusher(push, deadline_s: float = 30.0, progress=lambda: 0) -> BackgroundPush:
    return BackgroundPush(push, deadline_s=deadline_s, progress=progress, servers=["http://test"])


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def test_the_snapshot_is_a_copy_that_later_updates_do_not_touch():
    w = torch.nn.Linear(3, 2)
    snap = WeightSnapshot()
    taken = snap.take([(n, p.detach()) for n, p in w.named_parameters()])
    before = {n: t.clone() for n, t in taken}
    with torch.no_grad():
        w.weight.add_(1.0)
    assert all(torch.equal(t, before[n]) for n, t in taken)
    again = snap.take([(n, p.detach()) for n, p in w.named_parameters()])
    assert [t.data_ptr() for _, t in again] == [t.data_ptr() for _, t in taken], "the staging buffer is reused"
    assert torch.equal(dict(again)["weight"], w.weight.detach())


def test_a_push_runs_on_the_thread_and_its_outcome_is_collected_once_with_the_steps_trained_meanwhile():
    push, steps = GatedPush(), [3]
    bp = pusher(push, progress=lambda: steps[0])
    bp.start([("w", torch.ones(2))], step=3, ver=5, reading=_null)
    push.entered.wait(5)
    assert bp.busy and bp.poll() is None
    steps[0] = 6  # the learner finished steps 3, 4 and 5 meanwhile
    push.release.set()
    wait_until(lambda: bp._result is not None)
    out = bp.poll()
    assert out.ok and out.ver == 6 and out.started_step == 3 and out.steps_during == 3
    assert out.metrics["time/sync_wire"] == 0.01 and out.metrics["time/sync_total"] >= 0
    assert not bp.busy and bp.poll() is None
    bp.close(1.0)


def test_a_second_push_is_refused_while_one_is_in_flight():
    push = GatedPush()
    bp = pusher(push)
    bp.start([("w", torch.ones(1))], 0, 0, _null)
    with pytest.raises(RuntimeError, match="already in flight"):
        bp.start([("w", torch.ones(1))], 1, 0, _null)
    push.release.set()
    assert bp.wait(5).ok
    bp.close(1.0)


def test_a_failed_push_keeps_the_ver_and_the_next_one_can_start():
    push = GatedPush(ok=False)
    push.release.set()
    bp = pusher(push)
    bp.start([("w", torch.ones(1))], 0, 4, _null)
    out = bp.wait(5)
    assert not out.ok and out.ver == 4
    push.ok = True
    bp.start([("w", torch.ones(1))], 1, 4, _null)
    assert bp.wait(5).ver == 5
    bp.close(1.0)


def test_an_exception_in_the_push_is_a_failed_sync_not_a_dead_thread():
    def broken(tensors, step, ver):
        raise ValueError("boom")

    bp = pusher(broken)
    bp.start([("w", torch.ones(1))], 0, 2, _null)
    out = bp.wait(5)
    assert not out.ok and out.ver == 2
    bp.close(1.0)


def test_a_push_past_its_deadline_is_reported_failed_once_and_blocks_new_pushes_until_it_returns():
    push = GatedPush()
    bp = pusher(push, deadline_s=0.2)
    bp.start([("w", torch.ones(1))], 7, 3, _null)
    push.entered.wait(5)
    time.sleep(0.3)
    out = bp.poll()
    assert out is not None and not out.ok and out.ver == 3, "reported failed at the deadline"
    assert bp.poll() is None, "reported once"
    assert bp.busy, "the slot stays taken while the thread still runs"
    push.release.set()
    wait_until(lambda: bp._result is not None)
    assert bp.poll() is None, "the late result is discarded (logged)"
    assert not bp.busy
    bp.close(1.0)


def test_close_waits_for_the_push_in_flight():
    push = GatedPush()
    bp = pusher(push)
    bp.start([("w", torch.ones(1))], 0, 0, _null)
    push.entered.wait(5)
    threading.Timer(0.2, push.release.set).start()
    t0 = time.monotonic()
    assert bp.close(10.0) is True
    assert 0.15 < time.monotonic() - t0 < 10.0
    assert bp._result is not None and bp._result.ok


def test_close_gives_up_on_a_stuck_push_after_its_deadline():
    push = GatedPush()
    bp = pusher(push)
    bp.start([("w", torch.ones(1))], 0, 0, _null)
    push.entered.wait(5)
    assert bp.close(0.2) is False
    push.release.set()


def test_the_push_thread_runs_torch_single_threaded_and_leaves_the_process_default():
    seen = []

    def probe(tensors, step, ver):
        seen.append(torch.get_num_threads())
        return ver + 1, 1, {}

    before = torch.get_num_threads()
    bp = pusher(probe)
    bp.start([("w", torch.ones(1))], 0, 0, _null)
    assert bp.wait(5).ok
    assert seen == [1] and torch.get_num_threads() == before
    bp.close(1.0)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
