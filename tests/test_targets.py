"""Channel-A / Channel-B targets: key numbering, equivalences, masks, desc weights and geometry."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.detection.answer import IM_END, canonical_order, serialize_objects
from common.data.records import GTObject, coord_token
from common.detection.matching import hungarian_match
from common.detection.parsing import parse_rollout
from common.detection.targets import _entry_text, channel_a_target, reordered_gt_target, rollout_prefix_target
from common.detection.coord_tokens import coord_token_ids

MATCH = {"candidate_top_k": 5, "gate": 0.3, "fp_cost": 0.5, "fn_cost": 2.0}


def examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@functools.cache
def coord_bin_of(tok) -> dict[int, int]:
    return {t: k for k, t in enumerate(coord_token_ids(tok))}


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def decode(tok, ids) -> str:
    return tok.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def parse_and_match(tok, text: str, gt: list[GTObject], truncate: int | None = None):
    ids = encode(tok, text)
    parse = parse_rollout(ids[:truncate] if truncate is not None else ids + encode(tok, IM_END), tok)
    match = hungarian_match([o.bins for o in parse.valid_objects], [g.bins for g in gt], **MATCH)
    return parse, match


def entry(n: int, desc: str, bins, *, kind: str = "valid") -> str:
    """One rollout entry; ``kind`` picks an invalid variant that is still well-formed JSON."""
    coords = [coord_token(b) for b in bins]
    value = {
        "valid": {"desc": desc, "bbox_2d": coords},
        "missing_desc": {"bbox_2d": coords},
        "wrong_arity": {"desc": desc, "bbox_2d": coords[:3]},
        "plain_ints": {"desc": desc, "bbox_2d": list(bins)},
    }[kind]
    return f'"object_{n}": ' + json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def assert_supervision_contract(spec, tok) -> None:
    """Coords never in CE, weights only where supervised, turn end supervised, groups of four."""
    coord_bin = coord_bin_of(tok)
    ids = spec.token_ids.tolist()
    is_coord = np.array([t in coord_bin for t in ids])
    assert not spec.labels_mask[is_coord].any()
    assert (spec.ce_weights[~spec.labels_mask] == 0).all()
    assert ids[-1] == tok.convert_tokens_to_ids(IM_END) and spec.labels_mask[-1]
    assert spec.coord_positions.shape == spec.coord_bins.shape and spec.coord_positions.size % 4 == 0
    assert all(ids[p] in coord_bin for p in spec.coord_positions.tolist())
    assert len(set(spec.coord_positions.tolist())) == spec.coord_positions.size


# ----------------------------------------------------------------------------------------------
# strategies

descs = st.sampled_from(["cat", "black cat", "traffic light", "猫", "café", "a \"quoted\" thing"])


@st.composite
def boxes(draw):
    x1, x2 = sorted(draw(st.lists(st.integers(0, 999), min_size=2, max_size=2)))
    y1, y2 = sorted(draw(st.lists(st.integers(0, 999), min_size=2, max_size=2)))
    return (x1, y1, x2, y2)


gt_lists = st.lists(st.builds(GTObject, descs, boxes()), max_size=5).map(canonical_order)


@st.composite
def rollouts(draw, gt: list[GTObject]):
    """A rollout text with arbitrary object_N keys, some invalid, some boxes copied from GT."""
    parts = []
    for _ in range(draw(st.integers(0, 5))):
        n = draw(st.integers(0, 30))
        bins = draw(st.sampled_from([g.bins for g in gt]) if gt and draw(st.booleans()) else boxes())
        kind = draw(st.sampled_from(["valid", "valid", "missing_desc", "wrong_arity", "plain_ints"]))
        parts.append(entry(n, draw(descs), bins, kind=kind))
    return "{" + ", ".join(parts) + "}"


# ----------------------------------------------------------------------------------------------
# rollout_prefix: FN numbering


@examples(150)
@given(data=st.data())
def test_fn_numbering_never_collides_with_an_existing_key(tok, data):
    gt = data.draw(gt_lists)
    text = data.draw(rollouts(gt))
    n_tokens = len(encode(tok, text))
    truncate = data.draw(st.one_of(st.none(), st.integers(0, n_tokens)))
    parse, match = parse_and_match(tok, text, gt, truncate)
    spec = rollout_prefix_target(parse, match, gt, tok)

    target_text = decode(tok, spec.token_ids[:-1])
    keys = [k for k, _ in json.loads(target_text, object_pairs_hook=lambda pairs: pairs)]
    n_prefix = len(json.loads(parse.prefix_text + "}", object_pairs_hook=lambda pairs: pairs))
    prefix_keys, fn_keys = keys[:n_prefix], keys[n_prefix:]
    assert len(fn_keys) == spec.n_fn == len(match.fn_gt_indices)
    assert not set(fn_keys) & set(prefix_keys)
    assert len(set(fn_keys)) == len(fn_keys)
    first = parse.max_object_index + 1
    assert fn_keys == [f"object_{first + i}" for i in range(len(fn_keys))]
    assert_supervision_contract(spec, tok)


def test_fn_keys_skip_invalid_object_keys_left_in_the_prefix(tok):
    gt = [GTObject("cat", (10, 10, 50, 50)), GTObject("dog", (600, 600, 700, 700))]
    text = "{" + entry(1, "cat", (10, 10, 50, 50)) + ", " + entry(12, "x", (1, 2, 3, 4), kind="missing_desc") + "}"
    parse, match = parse_and_match(tok, text, gt)
    assert parse.max_object_index == 12 and [o.index for o in parse.valid_objects] == [1]
    spec = rollout_prefix_target(parse, match, gt, tok)
    assert decode(tok, spec.token_ids).endswith(", " + entry(13, "dog", (600, 600, 700, 700)) + "}" + IM_END)


# ----------------------------------------------------------------------------------------------
# reordered_gt


@examples(60)
@given(
    gt=gt_lists,
    garbage=st.sampled_from(
        [
            "I cannot see anything.",
            "{}",
            '{"object_1": {"desc": "cat", "bbox_2d": ["<|coord_1|>"',
            '{"object_1": {"desc": "cat"}, "object_2": {"bbox_2d": []}}',
            '{"object_1": {"desc": "cat", "bbox_2d": [1, 2, 3, 4]}}',
        ]
    ),
    desc_weight=st.sampled_from([1.0, 0.5, 2.0]),
)
def test_reordered_gt_with_zero_valid_predictions_equals_the_canonical_gt_target(tok, gt, garbage, desc_weight):
    parse, match = parse_and_match(tok, garbage, gt)
    assert parse.n_valid == 0
    got = reordered_gt_target(parse, match, gt, tok, desc_ce_weight=desc_weight, desc_ce_weight_matched=0.1)
    want = channel_a_target(gt, tok, desc_ce_weight=desc_weight)
    for name in ("token_ids", "labels_mask", "ce_weights", "coord_positions", "coord_bins"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert (got.n_matched, got.n_fn) == (want.n_matched, want.n_fn) == (0, len(gt))
    assert got.meta["bbox_groups_fn"] == want.meta["bbox_groups_fn"]


def test_reordered_gt_puts_matched_gt_in_predicted_order_then_fn_in_gt_order(tok):
    gt = canonical_order(
        [
            GTObject("cat", (100, 100, 200, 200)),
            GTObject("dog", (300, 300, 400, 400)),
            GTObject("owl", (500, 500, 600, 600)),
            GTObject("elk", (700, 700, 800, 800)),
        ]
    )
    # Predicted order: owl, a false positive, cat (slightly off); dog and elk are missed.
    text = "{" + ", ".join([entry(1, "bird", (500, 500, 600, 600)), entry(2, "x", (0, 900, 10, 999)),
                            entry(3, "kitty", (105, 100, 200, 205))]) + "}"
    parse, match = parse_and_match(tok, text, gt)
    assert sorted(match.matched_pairs) == [(0, 2), (2, 0)] and match.fn_gt_indices == [1, 3]
    spec = reordered_gt_target(parse, match, gt, tok, desc_ce_weight=1.0, desc_ce_weight_matched=0.2)
    order = [gt[2], gt[0], gt[1], gt[3]]
    assert decode(tok, spec.token_ids) == serialize_objects(order) + IM_END
    assert (spec.n_matched, spec.n_fn) == (2, 2)
    assert spec.meta["bbox_groups_prefix"] == [0, 1] and spec.meta["bbox_groups_fn"] == [2, 3]
    assert spec.coord_bins.reshape(-1, 4).tolist() == [list(o.bins) for o in order]
    ids = spec.token_ids.tolist()
    # Matched descs get the matched weight; FN descs keep desc_ce_weight.
    assert decode(tok, [t for t, w in zip(ids, spec.ce_weights) if w == pytest.approx(0.2)]) == "owlcat"
    assert_supervision_contract(spec, tok)


# ----------------------------------------------------------------------------------------------
# Channel-A and geometry positions


@examples(60)
@given(gt=gt_lists)
def test_coord_positions_point_at_coord_tokens_whose_bins_equal_the_gt_bins(tok, gt):
    spec = channel_a_target(gt, tok, desc_ce_weight=0.5)
    coord_bin = coord_bin_of(tok)
    ids = spec.token_ids.tolist()
    assert [coord_bin[ids[p]] for p in spec.coord_positions.tolist()] == spec.coord_bins.tolist()
    assert spec.coord_bins.reshape(-1, 4).tolist() == [list(g.bins) for g in gt]
    assert decode(tok, ids) == serialize_objects(gt) + IM_END
    assert_supervision_contract(spec, tok)
    # Every non-coord token is supervised in Channel-A; desc tokens carry the desc weight.
    is_coord = np.array([t in coord_bin for t in ids])
    assert (spec.labels_mask == ~is_coord).all()
    desc_text = decode(tok, [t for t, w in zip(ids, spec.ce_weights) if w == 0.5])
    for g in gt:
        assert json.dumps(g.desc, ensure_ascii=False)[1:-1] in desc_text


def test_the_appended_entry_format_is_the_serializer_format():
    obj = GTObject('a "quoted" café', (1, 2, 3, 4))
    assert "{" + _entry_text(1, obj) + "}" == serialize_objects([obj])


# ----------------------------------------------------------------------------------------------
# rollout_prefix: masks and geometry


def test_rollout_prefix_keeps_rollout_tokens_and_supervises_only_the_appended_tail(tok):
    gt = [GTObject("cat", (100, 100, 200, 200)), GTObject("dog", (300, 300, 400, 400))]
    text = "{" + entry(1, "kitty", (102, 100, 200, 198)) + ", " + entry(2, "fp", (800, 800, 900, 900)) + "}"
    parse, match = parse_and_match(tok, text, gt)
    assert match.matched_pairs == [(0, 0)] and match.fn_gt_indices == [1]
    spec = rollout_prefix_target(parse, match, gt, tok, desc_ce_weight=0.5)
    n = spec.meta["prefix_len"]
    ids = spec.token_ids.tolist()
    assert ids[:n] == parse.prefix_token_ids and n == len(parse.prefix_token_ids)
    assert decode(tok, ids) == parse.prefix_text + ", " + entry(3, "dog", (300, 300, 400, 400)) + "}" + IM_END
    assert not spec.labels_mask[:n].any()
    coord_bin = coord_bin_of(tok)
    assert (spec.labels_mask[n:] == np.array([t not in coord_bin for t in ids[n:]])).all()
    # Matched geometry sits on the rollout's own coord tokens with the GT bins as targets.
    groups = spec.coord_groups.tolist()
    assert groups[0] == list(parse.valid_objects[0].coord_token_indices)
    assert spec.coord_bins.reshape(-1, 4).tolist() == [[100, 100, 200, 200], [300, 300, 400, 400]]
    assert [coord_bin[ids[p]] for p in groups[1]] == [300, 300, 400, 400]
    assert spec.meta["bbox_groups_prefix"] == [0] and spec.meta["bbox_groups_fn"] == [1]
    assert decode(tok, [t for t, w in zip(ids, spec.ce_weights) if w == 0.5]) == "dog"
    assert_supervision_contract(spec, tok)

    no_fn_geom = rollout_prefix_target(parse, match, gt, tok, fn_geometry=False)
    assert no_fn_geom.coord_groups.tolist() == groups[:1] and no_fn_geom.meta["bbox_groups_fn"] == []
    np.testing.assert_array_equal(no_fn_geom.token_ids, spec.token_ids)


def test_rollout_prefix_structure_supervision_covers_matched_entries_only(tok):
    gt = [GTObject("cat", (100, 100, 200, 200))]
    text = "{" + entry(1, "fp", (800, 800, 900, 900)) + ", " + entry(2, "kitty", (100, 100, 200, 200)) + "}"
    parse, match = parse_and_match(tok, text, gt)
    assert match.matched_pairs == [(1, 0)]
    spec = rollout_prefix_target(parse, match, gt, tok, supervise_prefix_structure=True)
    ids = spec.token_ids.tolist()
    n = spec.meta["prefix_len"]
    supervised = decode(tok, [t for t, m in zip(ids[:n], spec.labels_mask[:n]) if m])
    assert "object_2" in supervised and "bbox" in supervised
    assert "fp" not in supervised and "object_1" not in supervised and "kitty" not in supervised
    assert_supervision_contract(spec, tok)


def test_rollout_prefix_of_a_garbage_rollout_appends_every_gt_after_an_open_brace(tok):
    gt = canonical_order([GTObject("cat", (1, 2, 3, 4)), GTObject("dog", (5, 6, 7, 8))])
    parse, match = parse_and_match(tok, "no json here", gt)
    assert parse.invalid_rollout and parse.prefix_text == "{"
    spec = rollout_prefix_target(parse, match, gt, tok)
    assert decode(tok, spec.token_ids) == serialize_objects(gt) + IM_END
    assert spec.n_fn == 2 and spec.n_matched == 0
    assert spec.coord_bins.reshape(-1, 4).tolist() == [list(g.bins) for g in gt]
    assert_supervision_contract(spec, tok)


def test_an_empty_gt_gives_an_empty_object_target(tok):
    spec = channel_a_target([], tok)
    assert decode(tok, spec.token_ids) == "{}" + IM_END and spec.coord_positions.size == 0
    parse, match = parse_and_match(tok, "{" + entry(1, "fp", (1, 1, 5, 5)) + "}", [])
    for build in (reordered_gt_target, rollout_prefix_target):
        assert build(parse, match, [], tok).coord_positions.size == 0
