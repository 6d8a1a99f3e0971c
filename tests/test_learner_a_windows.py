"""Channel-A windows (learner/data.py): packs filled to the packing length, exact resume, disjoint ranks.

The sampler, carry and packing are the real ``ChannelAData``; only the Encoder is replaced by a
table of sample lengths (one per JSONL line), so a realistic length mix — mostly short samples, a
long tail, a few longer than the packing length — runs in milliseconds. The real Encoder's windows
are covered by tests/test_learner_prefetch.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from learner.data import ChannelAData
from learner.metrics import metrics_line
from learner.step_record import RankStats, StepFacts
from tests.factories import make_segment

PACKING_LENGTH = 1024
LINES = 1500


def length_mix(n: int, seed: int = 0) -> list[int]:
    """75 % 60-250 tokens (the demo's samples are 77-140), 24 % 250-700, 1 % longer than the packing length."""
    rng = np.random.default_rng(seed)
    kind = rng.random(n)
    short, long_ = rng.integers(60, 250, n), rng.integers(250, 700, n)
    return [int(PACKING_LENGTH + 50 if k < 0.01 else (s if k < 0.76 else lg)) for k, s, lg in zip(kind, short, long_)]


class LengthData(ChannelAData):
    """ChannelAData whose line i encodes to a segment of ``lengths[i]`` tokens (None, counted, if too long)."""

    lengths: list[int] = []

    def _encode(self, ref, ver):
        n = self.lengths[ref.line]
        if n > self.packing_length:  # what the Encoder does: refused, counted, never truncated
            self.counters["too_long_dropped"] += 1
            return None
        return make_segment(n, ver, f"A:{ref.line}@{ref.epoch}", channel="A")


@pytest.fixture(scope="module")
def make_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("a_windows") / "train.jsonl"
    path.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(LINES)))
    LengthData.lengths = length_mix(LINES)

    def make(*, rank: int = 0, world: int = 1, ga: int = 2, seed: int = 0, samples: int | None = None) -> LengthData:
        cfg = SimpleNamespace(training=SimpleNamespace(per_device_train_batch_size=2, seed=seed),
                              derived=SimpleNamespace(packing_length=PACKING_LENGTH),
                              data=SimpleNamespace(train_jsonl=str(path), on_bad_record="fail"))
        return LengthData(cfg, None, rank=rank, world_size=world, ga=ga, samples=samples)

    return make


def ids(packs) -> list[list[str]]:
    return [[s.sample_id for s in p.segments] for p in packs]


@pytest.mark.parametrize("ga", [1, 2, 4])
def test_a_windows_hold_as_many_whole_samples_as_fit_the_packing_length(make_data, ga):
    data = make_data(ga=ga)
    fills, packed, carried_since = [], [], {}
    for ver in range(160 // ga):  # about 500 samples
        packs = data.next_window(ver)
        assert len(packs) == ga and all(p.segments for p in packs), "exactly GA non-empty packs"
        assert all(p.n_tokens <= PACKING_LENGTH for p in packs)
        assert all(p.ver == ver and p.channel == "A" for p in packs)
        assert len(data.carry) <= 2 * ga
        for _, seg in data.carry:
            carried_since.setdefault(seg.sample_id, ver)
            assert ver - carried_since[seg.sample_id] < 2, f"{seg.sample_id} carried for more than two windows"
        for _, seg in data.carry:  # a sample is carried only if no pack had room for it
            assert all(p.n_tokens + seg.length > PACKING_LENGTH for p in packs), "a carried sample fitted a pack"
        fills += [p.n_tokens / PACKING_LENGTH for p in packs]
        packed += [sid for p in ids(packs) for sid in p]
    assert np.mean(fills) >= 0.9, f"mean A pack fill {np.mean(fills):.3f} (GA {ga})"
    assert len(packed) == len(set(packed)), "a sample was packed twice"
    assert data.epoch == 0
    too_long = [i for i in data._order[:data.position] if LengthData.lengths[i] > PACKING_LENGTH]
    assert too_long and data.counters["too_long_dropped"] == len(too_long), "too-long samples are skipped and counted"
    assert not {f"A:{i}@0" for i in too_long} & set(packed)
    assert data.position == len(packed) + len(data.carry) + data.counters["too_long_dropped"], (
        "every drawn sample is packed, carried or counted as dropped")


def test_a_resumed_stream_builds_the_windows_the_uninterrupted_one_built(make_data):
    whole = make_data(ga=2)
    windows = [ids(whole.next_window(v)) for v in range(14)]
    for k in (1, 5, 9):
        first = make_data(ga=2)
        for v in range(k):
            assert ids(first.next_window(v)) == windows[v]
        state = json.loads(json.dumps(first.state_dict()))  # as rank<r>.json holds it
        assert state["carry"], "the state carries samples: the test covers the carry"
        resumed = make_data(ga=2)
        resumed.load_state_dict(state, ver=k)
        assert resumed.state_dict() == state
        assert [ids(resumed.next_window(v)) for v in range(k, 14)] == windows[k:], f"resumed after {k} windows"
        assert resumed.state_dict() == whole.state_dict()


def test_ranks_draw_disjoint_deterministic_shares(make_data):
    world = 3
    per_rank = []
    for rank in range(world):
        data = make_data(rank=rank, world=world)
        samples = [sid for v in range(15) for p in ids(data.next_window(v)) for sid in p]
        samples += [seg.sample_id for _, seg in data.carry]
        assert data.epoch == 0, "the test stays within one epoch"
        again = make_data(rank=rank, world=world)
        assert [sid for v in range(15) for p in ids(again.next_window(v)) for sid in p] == samples[:len(samples) - len(
            data.carry)], "the same seed draws the same windows"
        other = make_data(rank=rank, world=world, seed=1)
        assert ids(other.next_window(0)) != ids(make_data(rank=rank, world=world).next_window(0)), "the seed matters"
        per_rank.append(set(samples))
    for a in range(world):
        for b in range(a + 1, world):
            assert not per_rank[a] & per_rank[b], f"ranks {a} and {b} drew the same sample"


def test_the_step_record_reports_samples_per_step_by_channel():
    def stats(kind_b: float, segments: int) -> RankStats:
        return RankStats(kind_b=kind_b, segments=segments, packs=2, tokens=1900, fill_sum=1.86, time_step=1.0)

    a = metrics_line(0, [stats(0, 19), stats(0, 18)], StepFacts())
    assert (a["train/samples_a"], a["train/samples_b"]) == (37, 0)
    b = metrics_line(1, [stats(1, 6), stats(1, 5)], StepFacts())
    assert (b["train/samples_a"], b["train/samples_b"]) == (0, 11)


def test_a_fixed_sample_count_keeps_the_warm_starts_batch_instead_of_full_packs(make_data):
    """The Stage-1 warm start asks for per_device x GA samples a window (learner/warm_start.py): its recipe, cost and
    the cached detector stay what they were; every pack is still non-empty."""
    data = make_data(ga=2, samples=6)
    for ver in range(40):
        packs = data.next_window(ver)
        assert len(packs) == 2 and all(p.segments for p in packs)
        assert sum(len(p.segments) for p in packs) + len(data.carry) == 6
    full = make_data(ga=2)
    assert sum(len(p.segments) for p in full.next_window(0)) > 6  # the learner's windows take more
