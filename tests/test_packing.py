"""The actor-side packer: bounded, version-pure packs of whole segments, and every segment accounted for."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.packing.packer import Packer
from common.packing.segment import Pack, Segment
from tests.factories import make_segment


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def conserved(packer: Packer) -> bool:
    """Both identities of the module docstring: every segment, and every pack's capacity, accounted for."""
    c = packer.counters
    lost = c["fill_lost_ready_tokens"] + c["fill_lost_wait_tokens"] + c["fill_lost_flush_tokens"]
    return (c["segments_built"] == c["segments_packed"] + c["too_long_dropped"] + c["flushed_dropped"] + packer.buffered
            and c["packs_emitted"] * packer.packing_length == c["tokens_packed"] + lost)


def check_pack(pack: Pack, packing_length: int) -> None:
    """Bounded, version- and channel-pure, and every segment whole inside the concatenated arrays."""
    assert 0 < pack.n_tokens <= packing_length
    assert {s.ver for s in pack.segments} == {pack.ver}
    assert {s.channel for s in pack.segments} == {pack.channel}
    t = pack.tensors()
    assert np.diff(t["cu_seqlens"]).tolist() == [s.length for s in pack.segments]
    for s, a, b in zip(pack.segments, t["cu_seqlens"][:-1], t["cu_seqlens"][1:]):
        assert np.array_equal(t["input_ids"][a:b], s.input_ids)
        assert np.array_equal(t["labels"][a:b], s.labels)
        assert np.array_equal(t["position_ids"][:, a:b], s.position_ids)
        assert np.array_equal(t["coord_pos"][(t["coord_pos"] >= a) & (t["coord_pos"] < b)] - a, s.coord_pos)


def lengths_of(packs: list[Pack]) -> list[list[int]]:
    return [[s.length for s in p.segments] for p in packs]


def test_the_docstring_example_packs_the_oldest_with_the_subset_that_fills_the_pack_exactly():
    packer = Packer(4096, min_fill_ratio=0.8, max_wait_s=60, clock=FakeClock())
    for length in (1500, 1400, 1000, 1200, 1396):  # FIFO-greedy and first-fit-decreasing both stop at 3900
        packer.add(make_segment(length, ver=3))
    packs = packer.pop_ready()
    assert lengths_of(packs) == [[1500, 1200, 1396]]
    assert packer.buffered == 2 and packer.mean_fill == 1.0


def test_a_buffer_the_old_greedy_left_waiting_for_max_wait_leaves_full_at_once():
    # Room 600 after the oldest: greedy (FIFO or largest first) takes 350 and stops at 750 < 950; 300 + 300 fits.
    clock = FakeClock()
    packer = Packer(1000, min_fill_ratio=0.95, max_wait_s=5.0, clock=clock)
    for length in (400, 350, 300, 300):
        packer.add(make_segment(length, ver=0, sample_id=f"s{length}-{packer.buffered}"))
    assert lengths_of(packer.pop_ready()) == [[400, 300, 300]]
    clock.now = 5.0
    assert lengths_of(packer.pop_ready()) == [[350]]  # the leftover leaves at max_wait, counted
    c = packer.counters
    assert (c["underfilled_packs"], c["fill_lost_ready_tokens"], c["fill_lost_wait_tokens"]) == (1, 0, 650)


def test_among_equally_full_selections_the_older_segments_win():
    packer = Packer(100, min_fill_ratio=0.0, max_wait_s=60, clock=FakeClock())
    for i, length in enumerate((10, 30, 60, 30, 60)):  # 30 + 60 fills the room of 90 two ways
        packer.add(make_segment(length, ver=0, sample_id=f"s{i}"))
    assert [[s.sample_id for s in p.segments] for p in packer.pop_ready()][0] == ["s0", "s1", "s2"]


def test_a_fifo_prefix_is_taken_when_it_is_the_fullest_selection():
    packer = Packer(100, min_fill_ratio=0.0, max_wait_s=60, clock=FakeClock())
    for length in (10, 50, 40, 60):  # room 90: 50 + 40 = 90, where largest-first would take 60 alone
        packer.add(make_segment(length, ver=0))
    assert lengths_of(packer.pop_ready())[0] == [10, 50, 40]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 60), max_size=10), st.integers(0, 150))
def test_the_selection_finds_the_fullest_subset_that_fits(lengths, room):
    from itertools import combinations

    from common.packing.packer import _best_subset

    picked = _best_subset(lengths, room)
    best = max(sum(c) for k in range(len(lengths) + 1) for c in combinations(lengths, k) if sum(c) <= room)
    assert picked == sorted(set(picked)) and sum(lengths[i] for i in picked) == best


def test_fill_lost_is_split_by_why_each_pack_left_and_adds_up_with_the_mean_fill():
    clock = FakeClock()
    packer = Packer(1000, min_fill_ratio=0.9, max_wait_s=5.0, clock=clock)
    packer.add(make_segment(500, ver=1, sample_id="a"))
    packer.add(make_segment(420, ver=1, sample_id="b"))
    assert lengths_of(packer.pop_ready()) == [[500, 420]]  # ready: 80 empty
    packer.add(make_segment(300, ver=1, sample_id="c"))
    clock.now = 5.0
    assert lengths_of(packer.pop_ready()) == [[300]]  # waited: 700 empty
    packer.add(make_segment(600, ver=1, sample_id="d"))
    packer.add(make_segment(100, ver=2, sample_id="e"))
    assert lengths_of(packer.advance_ver(2)) == [[600]]  # ver flush: 400 empty
    assert lengths_of(packer.flush_all()) == [[100]]  # final flush: 900 empty, counted with the flushes
    c = packer.counters
    assert (c["fill_lost_ready_tokens"], c["fill_lost_wait_tokens"], c["fill_lost_flush_tokens"]) == (80, 700, 1300)
    assert (c["underfilled_packs"], c["flushed_packs"]) == (1, 2) and conserved(packer)
    lost = packer.fill_lost()
    assert lost == pytest.approx({"ready": 0.02, "wait": 0.175, "flush": 0.325})
    assert packer.mean_fill + sum(lost.values()) == pytest.approx(1.0)


def test_selection_over_a_few_hundred_buffered_segments_stays_cheap():
    """A release fill no subset reaches, on a 400-segment group: one pop_ready selects in milliseconds, not seconds."""
    import time

    rng = np.random.default_rng(1)
    packer = Packer(4096, min_fill_ratio=1.0, max_wait_s=1e9, clock=FakeClock())
    for i, length in enumerate(rng.integers(1100, 1301, size=400)):  # 3 fit (<= 3900), 4 never: none leaves
        packer.add(make_segment(int(length), ver=0, sample_id=f"s{i}"))
    start = time.perf_counter()
    assert packer.pop_ready() == []
    assert time.perf_counter() - start < 0.5


def test_underfilled_pack_waits_for_min_fill_then_leaves_after_max_wait_and_is_counted():
    clock = FakeClock()
    packer = Packer(1000, min_fill_ratio=0.8, max_wait_s=5.0, clock=clock)
    packer.add(make_segment(300, ver=1))
    clock.now = 3.0
    packer.add(make_segment(200, ver=1))
    assert packer.pop_ready() == [] and packer.buffered == 2
    clock.now = 4.99
    assert packer.pop_ready() == []
    clock.now = 5.0  # the oldest segment has now waited max_wait_s
    packs = packer.pop_ready()
    assert lengths_of(packs) == [[300, 200]]
    assert packer.counters["underfilled_packs"] == 1 and packer.buffered == 0


def test_pack_leaves_as_soon_as_min_fill_is_reached_and_is_not_counted_underfilled():
    packer = Packer(1000, min_fill_ratio=0.8, max_wait_s=5.0, clock=FakeClock())
    packer.add(make_segment(500, ver=1))
    assert packer.pop_ready() == []
    packer.add(make_segment(300, ver=1))
    assert lengths_of(packer.pop_ready()) == [[500, 300]]
    assert packer.counters["underfilled_packs"] == 0


def test_too_long_segment_is_refused_and_counted_never_truncated():
    packer = Packer(128, min_fill_ratio=0.0, max_wait_s=0.0, clock=FakeClock())
    assert packer.add(make_segment(129, ver=0)) is False
    assert packer.add(make_segment(128, ver=0)) is True  # exactly packing_length fits
    assert packer.counters["too_long_dropped"] == 1
    assert lengths_of(packer.pop_ready()) == [[128]]
    assert conserved(packer)


def test_versions_are_never_mixed_even_when_mixing_would_fill_a_pack():
    packer = Packer(1000, min_fill_ratio=0.9, max_wait_s=10.0, clock=FakeClock())
    packer.add(make_segment(500, ver=1))
    packer.add(make_segment(450, ver=2))
    assert packer.pop_ready() == []
    packer.add(make_segment(440, ver=1))
    assert [(p.ver, [s.length for s in p.segments]) for p in packer.pop_ready()] == [(1, [500, 440])]


def test_channels_are_never_mixed():
    packer = Packer(1000, min_fill_ratio=0.0, max_wait_s=0.0, clock=FakeClock())
    packer.add(make_segment(100, ver=0, channel="A"))
    packer.add(make_segment(100, ver=0, channel="B"))
    assert sorted(p.channel for p in packer.pop_ready()) == ["A", "B"]


def test_advance_ver_with_flush_emits_old_leftovers_as_their_own_packs_whatever_their_fill():
    packer = Packer(1000, min_fill_ratio=0.9, max_wait_s=10.0, clock=FakeClock())
    for length, ver in ((100, 1), (200, 2), (300, 3), (50, 1)):
        packer.add(make_segment(length, ver=ver))
    packs = packer.advance_ver(3, policy="flush")
    assert [(p.ver, [s.length for s in p.segments]) for p in packs] == [(1, [100, 50]), (2, [200])]
    assert packer.counters["flushed_packs"] == 2 and packer.buffered == 1 and conserved(packer)
    late = make_segment(70, ver=2)
    assert packer.add(late) is True  # a late old-ver segment is packed by the usual rules
    assert packer.pop_ready() == []


def test_advance_ver_with_drop_counts_old_leftovers_and_late_arrivals_as_dropped():
    packer = Packer(1000, min_fill_ratio=0.9, max_wait_s=10.0, clock=FakeClock())
    for length, ver in ((100, 1), (200, 2), (300, 3)):
        packer.add(make_segment(length, ver=ver))
    assert packer.advance_ver(3, policy="drop") == []
    assert packer.counters["flushed_dropped"] == 2 and packer.buffered == 1
    assert packer.add(make_segment(70, ver=2)) is False
    assert packer.counters["flushed_dropped"] == 3 and conserved(packer)


def test_flush_all_empties_the_buffer_into_version_pure_packs():
    packer = Packer(250, min_fill_ratio=1.0, max_wait_s=10.0, clock=FakeClock())
    for i in range(10):
        packer.add(make_segment(40 + 10 * i, ver=i % 2))
    packs = packer.flush_all()
    for pack in packs:
        check_pack(pack, 250)
    assert packer.buffered == 0 and sum(len(p.segments) for p in packs) == 10 and conserved(packer)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 160), st.integers(0, 2), st.sampled_from("AB")),
        st.tuples(st.just("tick"), st.floats(0.0, 2.0)),
        st.tuples(st.just("advance"), st.integers(0, 2), st.sampled_from(["flush", "drop"])),
        st.tuples(st.just("flush_all")),
    ),
    max_size=40,
)


def run_ops(packing_length: int, min_fill: float, max_wait: float, script) -> tuple[Packer, list[Segment], list[Pack]]:
    """Drive a packer through ``script``, checking conservation after every step."""
    clock = FakeClock()
    packer = Packer(packing_length, min_fill_ratio=min_fill, max_wait_s=max_wait, clock=clock)
    ver, added, packs = 0, [], []
    for i, op in enumerate(script):
        if op[0] == "add":
            segment = make_segment(op[1], ver=max(0, ver - op[2]), sample_id=f"s{i}", channel=op[3])
            added.append(segment)
            packer.add(segment)
        elif op[0] == "tick":
            clock.now += op[1]
            packs += packer.pop_ready()
        elif op[0] == "advance":
            ver += op[1]
            packs += packer.advance_ver(ver, policy=op[2])
        else:
            packs += packer.flush_all()
        assert conserved(packer), (op, packer.counters, packer.buffered)
    return packer, added, packs


@settings(max_examples=100, deadline=None)
@given(st.integers(32, 256), st.floats(0.0, 1.0), st.floats(0.0, 3.0), ops)
def test_random_add_pop_advance_sequences_conserve_every_segment(packing_length, min_fill, max_wait, script):
    packer, added, packs = run_ops(packing_length, min_fill, max_wait, script)
    packed = [id(s) for p in packs for s in p.segments]
    assert len(packed) == len(set(packed)) == packer.counters["segments_packed"]
    assert packer.counters["segments_built"] == len(added)
    assert packer.counters["packs_emitted"] == len(packs)
    assert all(s.length <= packing_length for p in packs for s in p.segments)


@settings(max_examples=100, deadline=None)
@given(st.integers(32, 256), st.floats(0.0, 1.0), st.floats(0.0, 3.0), ops)
def test_random_sequences_give_bounded_version_pure_packs_of_whole_segments(packing_length, min_fill, max_wait, script):
    _, _, packs = run_ops(packing_length, min_fill, max_wait, script)
    for pack in packs:
        check_pack(pack, packing_length)


def test_mean_fill_on_a_realistic_length_mix_is_at_least_85_percent():
    """Lengths ~ lognormal around 600 tokens (long tail to ~2k), packing_length 4096, min fill 0.8."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(600), 0.5, size=2000), 64, 4096).astype(int)
    clock = FakeClock()
    packer = Packer(4096, min_fill_ratio=0.8, max_wait_s=1e9, clock=clock)
    ready = []
    for i, length in enumerate(lengths):
        clock.now = float(i)
        packer.add(make_segment(int(length), ver=0, sample_id=f"s{i}"))
        ready += packer.pop_ready()
    fills = [p.n_tokens / 4096 for p in ready]
    print(f"packing/fill mean {np.mean(fills):.3f} min {min(fills):.3f} over {len(ready)} ready packs, "
          f"mean segment {lengths.mean():.0f} tokens, {np.mean([len(p.segments) for p in ready]):.1f} segments/pack")
    assert min(fills) >= 0.8
    assert np.mean(fills) >= 0.85
    assert packer.mean_fill == pytest.approx(np.mean(fills))


def test_a_pack_mixing_pixel_widths_raises_a_segment_error_naming_the_widths():
    import numpy as np

    from common.packing.segment import Pack, SegmentError

    a = make_segment(20, ver=1, sample_id="a", n_images=1)
    b = make_segment(20, ver=1, sample_id="b", n_images=1)
    b.pixel_values = np.zeros((b.pixel_values.shape[0], b.pixel_values.shape[1] + 1), np.uint8)
    with pytest.raises(SegmentError, match="widths"):
        Pack(ver=1, channel="B", segments=[a, b]).tensors()
