"""``data.encode_workers`` (learner/encode_pool.py): Channel-A windows encoded by spawned worker processes are
the synchronous path's, sample for sample: the same windows, counters, checkpoint state, resume and bad-record
errors.

One pool of two workers serves the module (a spawned worker loads torch, transformers and the processor: seconds);
the streams under test borrow it (``ChannelAData(pool=...)``). One test starts a stream's own pool from the config
key, to cover start and close.
"""

from __future__ import annotations

import multiprocessing
import pickle
from pathlib import Path

import numpy as np
import pytest

from common.config.load import ConfigError, load_config
from common.data.check import BadRecordError, error_kind
from common.data.records import RecordError
from common.packing.encode import encoder_from_config
from common.packing.segment import Pack
from learner.data import ChannelAData
from learner.encode_pool import EncodePool, portable, running

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo_cpu.yaml"
GA = 2


def cfg_of(train: Path, model: Path, images: Path, *overrides: str):
    """One image_root for every config here: the workers' Encoder, built from ``good_cfg``, names it in errors."""
    return load_config(CONFIG, [f"data.train_jsonl={train}", "data.val_jsonl=null", f"model.path={model}",
                                f"data.image_root={images}", "training.global_max_length=768", *overrides],
                       world_size=1)


@pytest.fixture(scope="module")
def good_cfg(synth_data_dir, tiny_model_dir):
    return cfg_of(synth_data_dir / "train.jsonl", tiny_model_dir, synth_data_dir)


@pytest.fixture(scope="module")
def pool(good_cfg):
    pool = EncodePool(good_cfg, 2)
    yield pool
    pool.close()


def stream(cfg, pool=None, **kw) -> ChannelAData:
    return ChannelAData(cfg, encoder_from_config(cfg), rank=0, world_size=1, ga=kw.pop("ga", GA), pool=pool, **kw)


def layout(window: list[Pack]) -> list[list[tuple[str, int, int]]]:
    return [[(s.sample_id, s.length, s.ver) for s in p.segments] for p in window]


def assert_same_window(got: list[Pack], want: list[Pack], what: str) -> None:
    assert layout(got) == layout(want), what
    for g, w in zip(got, want):
        gt, wt = g.tensors(), w.tensors()
        assert gt.keys() == wt.keys()
        for k in wt:
            assert gt[k].dtype == wt[k].dtype and np.array_equal(gt[k], wt[k]), f"{what}: {k}"


def test_pooled_windows_state_and_resume_equal_the_synchronous_ones(good_cfg, pool):
    sync, pooled = stream(good_cfg), stream(good_cfg, pool)
    try:
        states, windows = [], []
        while sync.epoch < 1 or len(windows) < 3:  # past an epoch's end: the lookahead crosses into the next order
            ver = len(windows)
            want = sync.next_window(ver)
            assert_same_window(pooled.next_window(ver), want, f"window {ver}")
            assert pooled.state_dict() == sync.state_dict(), f"after window {ver}: the state is what was consumed"
            assert pooled.counters == sync.counters
            windows.append(want)
            states.append(sync.state_dict())
            assert ver < 20, "the stream never reached epoch 1"
        assert len(pooled._ahead) > 0, "nothing was encoded ahead: the test would not cover the lookahead"
        assert any(s["carry"] for s in states[:-1]), "no window carried a sample: resume would not cover the carry"

        # Exact resume from every saved state but the last: the lookahead (past the last window) is dropped and the
        # carry re-encoded, so the next window is the uninterrupted run's.
        for at in range(len(states) - 1):
            pooled.load_state_dict(states[at], ver=at + 1)
            assert len(pooled._ahead) == 0, "load_state_dict drops the lookahead"
            assert_same_window(pooled.next_window(at + 1), windows[at + 1], f"resumed after window {at}")
    finally:
        pooled.close()
    assert pool._pool is not None, "a borrowed pool is its owner's to close"


def test_fixed_sample_windows_of_the_warm_start_are_the_same(good_cfg, pool):
    sync, pooled = stream(good_cfg, samples=5), stream(good_cfg, pool, samples=5)
    try:
        for ver in range(3):
            window = pooled.next_window(ver)
            assert all(p.segments for p in window)
            assert_same_window(window, sync.next_window(ver), f"window {ver}")
        assert pooled.state_dict() == sync.state_dict()
    finally:
        pooled.close()


def test_fail_raises_the_synchronous_error_naming_the_record(two_of_three_bad, tiny_model_dir, synth_data_dir, pool):
    cfg = cfg_of(two_of_three_bad, tiny_model_dir, synth_data_dir)
    errors = []
    for data in (stream(cfg, ga=1, samples=4), stream(cfg, pool, ga=1, samples=4)):
        with pytest.raises(BadRecordError, match=r"train\.jsonl:[23].*data\.on_bad_record = fail") as exc:
            data.next_window(ver=0)
        errors.append((str(exc.value), type(exc.value.__cause__), error_kind(exc.value.__cause__),
                       data.state_dict()))
        data.close()
    assert errors[1] == errors[0]


def test_skip_counts_the_bad_records_as_the_synchronous_path_does(two_of_three_bad, tiny_model_dir, synth_data_dir,
                                                                  pool):
    cfg = cfg_of(two_of_three_bad, tiny_model_dir, synth_data_dir, "data.on_bad_record=skip")
    sync, pooled = stream(cfg, ga=1, samples=4), stream(cfg, pool, ga=1, samples=4)
    try:
        for ver in range(3):
            assert_same_window(pooled.next_window(ver), sync.next_window(ver), f"window {ver}")
        assert pooled.counters == sync.counters and pooled.counters["record_errors"] >= 4
        assert pooled.bad_records.by_kind == sync.bad_records.by_kind
        assert set(pooled.bad_records.by_kind) == {"objects[].bbox_2d", "images[]"}
    finally:
        pooled.close()


def test_a_record_error_survives_the_trip_from_a_worker():
    err = RecordError("train.jsonl:2", "objects[0].bbox_2d", "x2 past the image", "clip the box")
    back = pickle.loads(pickle.dumps(portable(err)))
    assert type(back) is RecordError and str(back) == str(err) and back.field == err.field
    plain = ValueError("bad json")
    assert portable(plain) is plain


def test_a_sample_no_worker_returns_is_a_timeout_naming_it_and_the_key(pool):
    from concurrent.futures import Future

    with pytest.raises(TimeoutError, match=r"train\.jsonl:7 within 0s \(data\.encode_workers = 2\)"):
        pool.result(Future(), "train.jsonl:7", timeout_s=0.2)


def test_a_worker_reaped_by_another_thread_counts_as_exited():
    """EncodePool.close() judges its workers by their sentinels: after a foreign waitpid (the executor's manager
    thread joins them too) Process.is_alive() says True forever, and close() logged a false "did not exit" error."""
    import os
    import time
    from multiprocessing.connection import wait

    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0.1,))
    proc.start()
    assert running(proc)
    assert wait([proc.sentinel], 60), "the child did not exit"
    os.waitpid(proc.pid, 0)  # reaped behind the Process object's back
    assert proc.is_alive() and proc.exitcode is None, "the race this guards against (is_alive is fooled)"
    assert not running(proc)


def test_the_config_key_starts_workers_and_close_ends_them(good_cfg, synth_data_dir, tiny_model_dir):
    cfg = cfg_of(synth_data_dir / "train.jsonl", tiny_model_dir, synth_data_dir, "data.encode_workers=1")
    before = set(multiprocessing.active_children())
    data, sync = stream(cfg), stream(good_cfg)
    assert data.pool is not None and data.pool.workers == 1 and sync.pool is None
    assert_same_window(data.next_window(0), sync.next_window(0), "window 0")
    started = set(multiprocessing.active_children()) - before
    assert len(started) == 1, started
    data.close()
    data.close()  # twice is fine
    # by the sentinel, not Process.is_alive(): when another thread of this process reaped the child first (the
    # executor's own manager thread joins its workers too), is_alive() keeps saying True with exitcode None
    alive = [(p.pid, p.name) for p in started if running(p)]
    assert not alive, f"close() waits for the workers to exit: alive {alive}"
    with pytest.raises(RuntimeError, match="after close"):
        data.next_window(1)


def test_a_negative_worker_count_is_refused_naming_the_key(tmp_path):
    base = [f"data.train_jsonl={tmp_path / 'd.jsonl'}", "data.val_jsonl=null"]
    with pytest.raises(ConfigError) as exc:
        load_config(CONFIG, [*base, "data.encode_workers=-1"], world_size=1)
    (problem,) = exc.value.problems
    assert problem.startswith("data.encode_workers = -1: must be ≥ 0. Fix: use 0"), problem
    assert load_config(CONFIG, base, world_size=1).data.encode_workers == 0
