"""Strict rollout parsing: properties over random, truncated and mutated token sequences, one case
per drop reason, fused-token cuts, and speed on a long response."""

from __future__ import annotations

import functools
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.detection.answer import IM_END, serialize_objects
from common.data.records import GTObject, check_desc, coord_token
from common.detection.parsing import DROP_REASONS, parse_rollout
from common.detection.token_text import cut_tokens_at_char
from common.detection.coord_tokens import coord_token_ids


def examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def box(*bins: int) -> str:
    return "[" + ", ".join(f'"{coord_token(b)}"' for b in bins) + "]"


# ----------------------------------------------------------------------------------------------
# strategies

DESC_ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789-_'\"\\/{}[]:,.éü猫🙂"


def valid_desc(s: str) -> bool:
    try:
        check_desc(s)
        return True
    except ValueError:
        return False


descs = st.text(DESC_ALPHABET, min_size=1, max_size=12).filter(valid_desc)


@st.composite
def gt_objects(draw, max_size: int = 6) -> list[GTObject]:
    out = []
    for _ in range(draw(st.integers(0, max_size))):
        x1, x2 = sorted(draw(st.lists(st.integers(0, 999), min_size=2, max_size=2)))
        y1, y2 = sorted(draw(st.lists(st.integers(0, 999), min_size=2, max_size=2)))
        out.append(GTObject(draw(descs), (x1, y1, x2, y2)))
    return out


@functools.cache
def coord_bin_of(tok) -> dict[int, int]:
    return {t: k for k, t in enumerate(coord_token_ids(tok))}


@functools.cache
def interesting_ids(tok) -> list[int]:
    """Ids that move the scanner: structure, keys, coord and special tokens."""
    pieces = ["{", "}", "[", "]", '"', ":", ",", " ", "\\", '"object_1"', '"object_12"', '"desc"', '"bbox_2d"',
              '"poly"', "}}", "},", '"]', ": ", ", ", "cat", "0", IM_END]
    ids = {i for p in pieces for i in encode(tok, p)}
    coord = list(coord_bin_of(tok))
    ids |= set(coord[:5]) | set(coord[-5:]) | set(tok.all_special_ids)
    return sorted(ids)


# ----------------------------------------------------------------------------------------------
# invariants every parse must satisfy


def assert_invariants(res, tok) -> None:
    assert set(res.dropped_by_reason) == set(DROP_REASONS)
    assert all(v >= 0 for v in res.dropped_by_reason.values())
    assert res.n_dropped == sum(res.dropped_by_reason.values())
    assert decode(tok, res.prefix_token_ids) == res.prefix_text
    assert res.prefix_text.endswith("}") or res.prefix_text.endswith("{")
    if res.invalid_rollout:
        assert res.valid_objects == []
    coord_bin = coord_bin_of(tok)
    for obj in res.valid_objects:
        assert len(obj.coord_token_indices) == 4
        assert all(i < len(res.prefix_token_ids) for i in obj.coord_token_indices)
        assert tuple(coord_bin[res.prefix_token_ids[i]] for i in obj.coord_token_indices) == obj.bins
        x1, y1, x2, y2 = obj.bins
        assert x1 <= x2 and y1 <= y2
        assert obj.desc and obj.desc == obj.desc.strip()
        assert obj.index <= res.max_object_index
        assert obj.value_span[1] <= len(res.prefix_text)
    if res.prefix_text.endswith("}"):
        # Closing the prefix gives a complete document holding exactly the same valid objects.
        closed = parse_rollout(res.prefix_token_ids + encode(tok, "}") + encode(tok, IM_END), tok)
        assert not closed.truncated
        assert closed.valid_objects == res.valid_objects
        assert closed.max_object_index == res.max_object_index


# ----------------------------------------------------------------------------------------------
# properties


@examples(300)
@given(data=st.data())
def test_parsing_never_raises_on_random_token_sequences(tok, data):
    pool = interesting_ids(tok)
    ids = data.draw(
        st.lists(
            st.one_of(
                st.sampled_from(pool),
                st.integers(0, len(tok) - 1),
                st.integers(-3, len(tok) + 50),  # out of vocabulary too
            ),
            max_size=60,
        )
    )
    res = parse_rollout(ids, tok)
    assert_invariants(res, tok)


@examples(40)
@given(objects=gt_objects())
def test_a_serialised_gt_parses_back_to_exactly_the_same_objects(tok, objects):
    text = serialize_objects(objects)
    res = parse_rollout(encode(tok, text) + encode(tok, IM_END), tok)
    assert [(o.index, o.desc, o.bins) for o in res.valid_objects] == [
        (i, g.desc, g.bins) for i, g in enumerate(objects, 1)
    ]
    assert res.n_dropped == 0 and not res.truncated
    assert res.max_object_index == len(objects)
    assert res.prefix_text == (text[:-1] if objects else "{")
    assert res.invalid_rollout == (not objects)
    assert_invariants(res, tok)


@examples(30)
@given(objects=gt_objects(max_size=4))
def test_every_truncation_of_a_serialisation_keeps_exactly_the_complete_objects(tok, objects):
    ids = encode(tok, serialize_objects(objects))
    full = parse_rollout(ids, tok)
    for k in range(len(ids) + 1):
        res = parse_rollout(ids[:k], tok)
        end = full.token_starts[k]
        complete = [o for o in full.valid_objects if o.value_span[1] <= end]
        started = [o for o in full.valid_objects if o.value_span[0] < end]
        assert res.valid_objects == complete, k
        assert res.dropped_by_reason == {**dict.fromkeys(DROP_REASONS, 0), "key_invalid": len(started) - len(complete)}
        assert res.truncated == (k < len(ids))
        assert res.max_object_index == len(complete)
        assert res.invalid_rollout == (not complete)
        assert_invariants(res, tok)


@examples(250)
@given(objects=gt_objects(max_size=3), data=st.data())
def test_parsing_never_raises_on_mutated_serialisations(tok, objects, data):
    ids = encode(tok, serialize_objects(objects))
    pool = interesting_ids(tok)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["delete", "insert", "replace", "duplicate", "swap"]))
        i = data.draw(st.integers(0, max(len(ids) - 1, 0)))
        j = data.draw(st.integers(i, len(ids)))
        tid = data.draw(st.one_of(st.sampled_from(pool), st.integers(-2, len(tok) + 2)))
        if op == "delete":
            del ids[i:j]
        elif op == "insert":
            ids.insert(i, tid)
        elif op == "replace" and ids:
            ids[i] = tid
        elif op == "duplicate":
            ids[j:j] = ids[i:j]
        elif op == "swap" and j < len(ids):
            ids[i], ids[j] = ids[j], ids[i]
    assert_invariants(parse_rollout(ids, tok), tok)


# ----------------------------------------------------------------------------------------------
# one case per reason bucket

CAT = '"object_1": {"desc": "cat", "bbox_2d": ' + box(1, 2, 30, 40) + "}"
BUCKET_CASES = [
    ("key_invalid", '"obj_2": {"desc": "dog", "bbox_2d": ' + box(1, 2, 3, 4) + "}"),
    ("key_invalid", '"object_2": 5'),
    ("key_invalid", '"object_2": {"desc": "dog" "bbox_2d": ' + box(1, 2, 3, 4) + "}"),  # missing comma
    ("key_invalid", '"object_2": {"desc": "dog", "bbox_2d": ' + box(1, 2, 3, 4) + ', "score": 1}'),
    ("key_invalid", '"object_2": {"desc": "dog", "bbox_2d": ' + box(1, 2, 3, 4) + ', "poly": []}'),
    ("missing_desc", '"object_2": {"bbox_2d": ' + box(1, 2, 3, 4) + "}"),
    ("missing_desc", '"object_2": {"desc": "  ", "bbox_2d": ' + box(1, 2, 3, 4) + "}"),
    ("missing_geom", '"object_2": {"desc": "dog"}'),
    ("unknown_geom", '"object_2": {"desc": "dog", "box": ' + box(1, 2, 3, 4) + "}"),
    ("unknown_geom", '"object_2": {"desc": "dog", "poly": ' + box(1, 2, 3, 4, 5, 6) + "}"),
    ("wrong_arity", '"object_2": {"desc": "dog", "bbox_2d": ' + box(1, 2, 3) + "}"),
    ("wrong_arity", '"object_2": {"desc": "dog", "bbox_2d": "' + coord_token(1) + '"}'),
    ("non_coord_token", '"object_2": {"desc": "dog", "bbox_2d": [1, 2, 3, 4]}'),
    ("non_coord_token", '"object_2": {"desc": "dog", "bbox_2d": ["<|coord_1|>", "x", "<|coord_3|>", "<|coord_4|>"]}'),
    ("bbox_invalid", '"object_2": {"desc": "dog", "bbox_2d": ' + box(9, 2, 3, 4) + "}"),
    ("bbox_invalid", '"object_2": {"desc": "dog", "bbox_2d": ' + box(1, 9, 3, 4) + "}"),
]


@pytest.mark.parametrize("reason,bad", BUCKET_CASES)
def test_each_invalid_object_is_dropped_into_its_reason_bucket(tok, reason, bad):
    text = "{" + CAT + ", " + bad + ', "object_3": {"desc": "owl", "bbox_2d": ' + box(5, 5, 6, 6) + "}}"
    res = parse_rollout(encode(tok, text) + encode(tok, IM_END), tok)
    assert [(o.index, o.desc) for o in res.valid_objects] == [(1, "cat"), (3, "owl")]
    assert res.dropped_by_reason == {**dict.fromkeys(DROP_REASONS, 0), reason: 1}
    assert res.max_object_index == 3 and not res.truncated
    assert_invariants(res, tok)


def test_a_coord_spelled_by_ordinary_tokens_is_a_non_coord_token(tok):
    head = encode(tok, '{"object_1": {"desc": "dog", "bbox_2d": ["')
    spelled = encode(tok, "<|coord") + encode(tok, "_1|>")  # same characters, not the coord token
    rest = encode(tok, '", "' + coord_token(2) + '", "' + coord_token(3) + '", "' + coord_token(4) + '"]}}')
    res = parse_rollout(head + spelled + rest, tok)
    assert res.valid_objects == []
    assert res.dropped_by_reason["non_coord_token"] == 1


def test_the_truncated_tail_object_is_key_invalid_and_its_key_is_outside_the_prefix(tok):
    text = "{" + CAT + ', "object_7": {"desc": "dog", "bbox_2d": ["' + coord_token(1)
    res = parse_rollout(encode(tok, text), tok)
    assert [o.index for o in res.valid_objects] == [1]
    assert res.dropped_by_reason["key_invalid"] == 1
    assert res.truncated and res.max_object_index == 1
    assert res.prefix_text == "{" + CAT


def test_max_object_index_counts_invalid_keys_left_in_the_prefix(tok):
    text = '{"object_9": {"desc": ""}, ' + CAT + "}"
    res = parse_rollout(encode(tok, text), tok)
    assert [o.index for o in res.valid_objects] == [1]
    assert res.dropped_by_reason["missing_desc"] == 1
    assert res.max_object_index == 9


# ----------------------------------------------------------------------------------------------
# stops, garbage and chatter


def test_parsing_stops_at_the_turn_end_token(tok):
    ids = encode(tok, "{" + CAT + "}") + encode(tok, IM_END) + encode(tok, '{"object_5": {"desc": "x"}}')
    res = parse_rollout(ids, tok)
    assert [o.index for o in res.valid_objects] == [1] and res.max_object_index == 1
    assert res.response_token_ids == encode(tok, "{" + CAT + "}")
    assert not res.truncated


def test_no_open_brace_falls_back_to_an_encoded_brace(tok):
    res = parse_rollout(encode(tok, "I see a cat.") + encode(tok, IM_END), tok)
    assert res.prefix_token_ids == encode(tok, "{") and res.prefix_text == "{"
    assert res.truncated and res.invalid_rollout and res.n_dropped == 0


def test_out_of_vocabulary_ids_and_non_integers_end_the_usable_response(tok):
    good = encode(tok, "{" + CAT + ', "object_2": {"desc": "dog", "bbox_2d": ' + box(1, 2, 3, 4) + "}}")
    cut = len(encode(tok, "{" + CAT)) + 2
    for junk in (-1, len(tok) + 7, "x", 3.5, None):
        ids = good[:cut] + [junk] + good[cut:] + [10**12]
        res = parse_rollout(ids, tok)
        assert [o.index for o in res.valid_objects] == [1]
        assert res.n_out_of_vocab == 2 and res.truncated
        assert_invariants(res, tok)
    assert parse_rollout(None, tok).invalid_rollout


def test_chatter_around_the_json_is_kept_in_the_prefix_but_ignored(tok):
    text = "Sure: {" + CAT + '} and then {"object_8": {"desc": "x", "bbox_2d": ' + box(1, 1, 2, 2) + "}}"
    res = parse_rollout(encode(tok, text), tok)
    assert [o.index for o in res.valid_objects] == [1]
    assert res.max_object_index == 1 and not res.truncated
    assert res.prefix_text == "Sure: {" + CAT


def test_non_ascii_descriptions_survive_tokens_that_split_a_character(tok):
    objects = [GTObject("猫 café 🙂", (1, 2, 3, 4)), GTObject("ü", (5, 6, 7, 8))]
    res = parse_rollout(encode(tok, serialize_objects(objects)), tok)
    assert [o.desc for o in res.valid_objects] == ["猫 café 🙂", "ü"]


# ----------------------------------------------------------------------------------------------
# cuts inside fused tokens


class StubTokenizer:
    """A greedy longest-match tokenizer over a fixed vocabulary (no merges learned)."""

    def __init__(self, extra: list[str], *, broken_encode: bool = False):
        base = [chr(c) for c in range(32, 127)] + [coord_token(k) for k in range(1000)] + [IM_END]
        self.vocab = base + extra
        self.ids = {t: i for i, t in enumerate(self.vocab)}
        self.broken_encode = broken_encode
        self.unk_token_id = None

    def __len__(self) -> int:
        return len(self.vocab)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.ids.get(tokens)
        return [self.ids.get(t) for t in tokens]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.broken_encode:
            text = text + " "  # a tokenizer whose encode does not round-trip
        out, i = [], 0
        while i < len(text):
            n = max(n for n in range(1, len(text) - i + 1) if text[i : i + n] in self.ids or n == 1)
            out.append(self.ids[text[i : i + n]])
            i += n
        return out

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) -> str:
        return "".join(self.vocab[i] for i in ids)


# object_1 ends in a plain "}" token (two spaces follow), object_2 in the fused token '}, "'.
STUB_TEXT = "{" + CAT + ',  "object_2": {"desc": "dog", "bbox_2d": ' + box(5, 6, 7, 8) + '}, "object_3": {"desc'


def test_a_cut_inside_a_fused_token_re_encodes_only_that_token():
    stub = StubTokenizer(['}, "'])
    ids = stub.encode(STUB_TEXT)
    fused = stub.ids['}, "']
    assert ids.count(fused) == 1
    res = parse_rollout(ids, stub, coord_ids=coord_token_ids(stub))
    assert res.prefix_reencoded
    assert [o.index for o in res.valid_objects] == [1, 2]
    n_keep = ids.index(fused)
    assert res.prefix_token_ids == ids[:n_keep] + [stub.ids["}"]]
    assert res.prefix_text == STUB_TEXT[: STUB_TEXT.index(', "object_3')]


def test_a_cut_that_does_not_re_encode_falls_back_to_the_previous_safe_cut():
    good = StubTokenizer(['}, "'])
    broken = StubTokenizer(['}, "'], broken_encode=True)
    res = parse_rollout(good.encode(STUB_TEXT), broken, coord_ids=coord_token_ids(good))
    assert not res.prefix_reencoded
    assert [o.index for o in res.valid_objects] == [1]
    assert res.dropped_by_reason["key_invalid"] == 2  # object_2 now lies beyond the cut; object_3 is open
    assert res.prefix_text == "{" + CAT and res.max_object_index == 1


def test_cut_tokens_at_char_keeps_boundaries_and_splits_fused_tokens():
    stub = StubTokenizer(["}}", "},"])
    pieces = ["{", "a", "}},", " "]
    ids = [stub.ids[p] if p in stub.ids else stub.encode(p)[0] for p in pieces]
    assert cut_tokens_at_char(ids, pieces, 2, stub) == (ids[:2], False)
    assert cut_tokens_at_char(ids, pieces, 3, stub) == (ids[:2] + [stub.ids["}"]], True)
    assert cut_tokens_at_char(ids, pieces, 4, stub) == (ids[:2] + [stub.ids["}}"]], True)
    assert cut_tokens_at_char(ids, pieces, 99, stub) is None


def test_a_fused_closing_token_of_the_real_tokenizer_is_cut_correctly(tok):
    pieces = [decode(tok, [i]) for i in range(len(tok))]
    fused = [i for i, p in enumerate(pieces) if p.startswith(("}", '"]}')) and "}" in p[:-1]]
    if not fused:
        pytest.skip("the tiny tokenizer has no token with text after a closing brace (stub tests cover the cut)")
    for tid in fused[:20]:
        head = encode(tok, "{" + CAT[:-1]) if pieces[tid].startswith("}") else encode(tok, "{" + CAT[:-3])
        res = parse_rollout(head + [tid] + encode(tok, ' "object_2'), tok)
        assert [o.index for o in res.valid_objects] == [1], pieces[tid]
        assert res.prefix_text == "{" + CAT and res.prefix_reencoded
        assert_invariants(res, tok)


# ----------------------------------------------------------------------------------------------
# speed


def test_parsing_a_long_response_takes_milliseconds(tok):
    rng = random.Random(0)
    objects = []
    for n in range(300):
        x1, y1 = rng.randint(0, 900), rng.randint(0, 900)
        objects.append(GTObject(rng.choice(["black cat", "traffic light", "person"]), (x1, y1, x1 + 50, y1 + 60)))
    ids = encode(tok, serialize_objects(objects))[:3000]
    parse_rollout(ids, tok)  # warm the decode table
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        res = parse_rollout(ids, tok)
        times.append(time.perf_counter() - t0)
    assert res.n_valid > 10
    # Generous bound for slow CI machines; a typical run is a few ms (see the docstring of parsing).
    assert sorted(times)[2] < 0.1, f"median parse time {sorted(times)[2] * 1e3:.1f} ms for {len(ids)} tokens"
