"""The Channel-A prefetcher (learner/prefetch.py): the synchronous path's windows, one ahead.

Real Channel-A data (tiny model's processor, synthetic records) for ordering and exact resume;
a fake window source for the thread's failure modes (an exception, a hang, close).
"""

from __future__ import annotations

import threading
import time
import traceback

import numpy as np
import pytest

from common.config.load import load_config
from common.packing.segment import Pack
from learner.data import ChannelAData
from learner.prefetch import ChannelAPrefetcher, ChannelAPrefetchError
from tests.factories import make_segment
from tests.test_learner_harness import write_config

GA = 2


def wait_until(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
        time.sleep(0.005)


def sample_ids(packs: list[Pack]) -> list[list[str]]:
    return [[s.sample_id for s in p.segments] for p in packs]


def consumed(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "ahead"}


@pytest.fixture(scope="module")
def make_data(tiny_model_dir, synth_data_dir, tmp_path_factory):
    """A fresh ChannelAData with its own Encoder (one per thread); every window carries (learner/data.py)."""
    from common.packing.encode import encoder_from_config

    tmp = tmp_path_factory.mktemp("prefetch")
    path = write_config(tmp / "cfg.yaml", model_dir=tiny_model_dir, data_dir=synth_data_dir, output_dir=tmp / "out",
                        nproc=1, training={"per_device_train_batch_size": 2, "gradient_accumulation_steps": GA,
                                           "global_max_length": 768})
    cfg = load_config(path, world_size=1)
    return lambda: ChannelAData(cfg, encoder_from_config(cfg), rank=0, world_size=1, ga=GA)


def test_prefetched_windows_equal_the_synchronous_ones_and_the_saved_state_is_what_was_taken(make_data):
    sync, prefetcher = make_data(), ChannelAPrefetcher(make_data(), rank=0, deadline_s=60)
    prefetcher.start()
    states, windows = [], 8
    try:
        for ver in range(windows):
            expected = sync.next_window(ver)
            wait_until(lambda: prefetcher.state_dict()["ahead"] == 1, f"window {ver} built ahead")
            window = prefetcher.take(ver)
            assert window.index == ver
            assert sample_ids(window.packs) == sample_ids(expected), f"window {ver}"
            assert all(p.ver == ver and {s.ver for s in p.segments} == {ver} for p in window.packs), "retagged at take"
            for got, want in zip(window.arrays, [p.tensors() for p in expected]):
                assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
            wait_until(lambda: prefetcher.state_dict()["ahead"] == 1, f"window {ver + 1} built ahead")
            saved = prefetcher.state_dict()
            assert consumed(saved) == sync.state_dict(), "the checkpoint holds what was taken, not what was prefetched"
            assert prefetcher.counters == sync.counters
            states.append(consumed(saved))
    finally:
        assert prefetcher.close(timeout_s=30)
    assert any(s["carry"] for s in states), "no window carried a sample: the test would not cover the carry"

    # Exact resume: a new stream loaded from a mid-run state continues with the windows the first one built.
    at = next(i for i, s in enumerate(states) if s["carry"])
    reference = make_data()
    reference.load_state_dict(states[at], ver=0)
    resumed_data = make_data()
    resumed_data.load_state_dict(states[at], ver=0)
    resumed = ChannelAPrefetcher(resumed_data, rank=0, deadline_s=60)
    resumed.start()
    try:
        for ver in range(3):
            assert sample_ids(resumed.take(ver).packs) == sample_ids(reference.next_window(ver))
    finally:
        assert resumed.close(timeout_s=30)


class FakeSource:
    """Windows of two one-segment packs; can fail at a given window or block until released."""

    def __init__(self, fail_at: int | None = None, gate: threading.Event | None = None) -> None:
        self.built, self.fail_at, self.gate = 0, fail_at, gate

    def next_window(self, ver: int) -> list[Pack]:
        if self.gate is not None:
            self.gate.wait()
        if self.built == self.fail_at:
            _explode_in_the_encoder(self.built)
        self.built += 1
        return [Pack(ver=ver, channel="A", segments=[make_segment(8, ver, f"A:{self.built}.{i}@0", channel="A")])
                for i in range(GA)]

    def state_dict(self) -> dict:
        return {"epoch": 0, "position": self.built, "carry": [], "counters": {"windows": self.built}}


def _explode_in_the_encoder(window: int) -> None:
    raise ValueError(f"corrupt image in window {window}")


def test_at_most_one_window_is_built_ahead_however_many_steps_skip_channel_a():
    source = FakeSource()
    prefetcher = ChannelAPrefetcher(source, rank=0, deadline_s=10)
    prefetcher.start()
    try:
        wait_until(lambda: source.built == 1, "the first window")
        time.sleep(0.2)  # B steps: nothing is taken
        assert source.built == 1
        assert prefetcher.state_dict() == {"epoch": 0, "position": 0, "carry": [], "counters": {"windows": 0}, "ahead": 1}
        prefetcher.take(0)
        wait_until(lambda: source.built == 2, "the second window, once the first was taken")
        time.sleep(0.2)
        assert source.built == 2 and prefetcher.state_dict()["position"] == 1
    finally:
        assert prefetcher.close(timeout_s=5)


def test_a_failure_in_the_prefetch_thread_surfaces_in_the_training_thread_with_its_traceback():
    prefetcher = ChannelAPrefetcher(FakeSource(fail_at=1), rank=2, deadline_s=10)
    prefetcher.start()
    try:
        assert sample_ids(prefetcher.take(7).packs) == [["A:1.0@0"], ["A:1.1@0"]]
        with pytest.raises(ChannelAPrefetchError, match=r"rank 2: channel-a-prefetch-r2 failed building Channel-A "
                                                         r"window 1 \(ValueError: corrupt image in window 1\)") as info:
            prefetcher.take(8)
        cause = info.value.__cause__
        assert isinstance(cause, ValueError)
        assert "_explode_in_the_encoder" in "".join(traceback.format_exception(cause)), "the thread's frames are kept"
        with pytest.raises(ChannelAPrefetchError):  # every later A step fails the same way: never a hang
            prefetcher.take(9)
        assert prefetcher.state_dict()["position"] == 1, "the failed window was never consumed"
    finally:
        assert prefetcher.close(timeout_s=5)


def test_a_stuck_prefetch_thread_fails_the_a_step_at_its_deadline_naming_what_was_awaited():
    gate = threading.Event()
    prefetcher = ChannelAPrefetcher(FakeSource(gate=gate), rank=3, deadline_s=0.3, poll_s=0.05,
                                    what="4 samples of train.jsonl", deadline_from="half of a test timeout")
    prefetcher.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rank 3: waited 0\.\ds \(the deadline, half of a test timeout\) for "
                                               r"Channel-A window 0 from thread channel-a-prefetch-r3 \(alive, building "
                                               r"window 0 for 0s\); a window encodes 4 samples of train.jsonl .*"
                                               r"py-spy dump --pid \d+"):
            prefetcher.take(0)
        assert 0.3 <= time.monotonic() - t0 < 3.0
        assert not prefetcher.close(timeout_s=0.2), "a thread stuck mid-window cannot be joined: close says so"
    finally:
        gate.set()
    assert prefetcher.close(timeout_s=5), "released, it finishes its window, sees the stop flag and exits"


def test_close_joins_the_thread_and_a_closed_prefetcher_refuses_to_serve():
    source = FakeSource()
    prefetcher = ChannelAPrefetcher(source, rank=0, deadline_s=10)
    prefetcher.start()
    wait_until(lambda: prefetcher.state_dict()["ahead"] == 1, "a window waiting in the slot")
    t0 = time.monotonic()
    assert prefetcher.close(timeout_s=5) and time.monotonic() - t0 < 1.0
    assert not any(t.name == "channel-a-prefetch-r0" for t in threading.enumerate())
    with pytest.raises(RuntimeError, match=r"not running \(closed\)"):
        prefetcher.take(0)  # even with a window left in the slot
    with pytest.raises(RuntimeError, match=r"not running \(start\(\) was not called\)"):
        ChannelAPrefetcher(FakeSource(), rank=0, deadline_s=1).take(0)


def test_the_prefetch_thread_runs_torch_single_threaded_and_leaves_the_training_threads_count_alone():
    import torch

    before = torch.get_num_threads()
    prefetcher = ChannelAPrefetcher(FakeSource(), rank=0, deadline_s=10)
    prefetcher.start()
    try:
        assert prefetcher.torch_threads == 1
        assert torch.get_num_threads() == before
        later: list[int] = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join(5)
        assert later == [before], "threads torch initialises later get the process default back"
    finally:
        assert prefetcher.close(timeout_s=5)
