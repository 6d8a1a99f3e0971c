"""``data.answer_format: objects_array`` (``{"objects": [...]}``) beside the default ``object_keys``: targets,
the strict parser and the evaluator, on the tiny model's tokenizer.

The object_keys format has its own, larger suite (tests/test_parsing.py); here: the array round-trips through
targets -> parser -> evaluator, truncations and invalid elements are counted as for object_keys, the two
formats refuse each other, a Channel-B rollout prefix is completed inside the array, and the config key.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.detection.answer import IM_END, SYSTEM_PROMPT, SYSTEM_PROMPT_OBJECTS_ARRAY, Prompts, serialize_objects
from common.data.records import GTObject, Record, coord_token
from common.evaluation.loop import evaluate_records
from common.detection.matching import hungarian_match
from common.detection.parsing import DROP_REASONS, parse_rollout
from common.detection.targets import channel_a_target, rollout_prefix_target
from tests.test_targets import MATCH
from tests.test_parsing import BUCKET_CASES, box, decode, encode, examples, gt_objects, interesting_ids

ARRAY = "objects_array"
CAT = '{"desc": "cat", "bbox_2d": ' + box(1, 2, 30, 40) + "}"
OWL = '{"desc": "owl", "bbox_2d": ' + box(5, 5, 6, 6) + "}"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def parse(tok, text: str, fmt: str = ARRAY, end: bool = True):
    return parse_rollout(encode(tok, text) + (encode(tok, IM_END) if end else []), tok, answer_format=fmt)


def test_the_array_serialisation_is_the_objects_key_holding_one_element_per_object():
    objs = [GTObject("cat", (1, 2, 30, 40)), GTObject("owl", (5, 5, 6, 6))]
    assert serialize_objects(objs, ARRAY) == '{"objects": [' + CAT + ", " + OWL + "]}"
    assert serialize_objects([], ARRAY) == '{"objects": []}'
    assert serialize_objects(objs).startswith('{"object_1": {"desc": "cat"')  # the default is unchanged
    with pytest.raises(ValueError, match="data.answer_format"):
        serialize_objects(objs, "objects")


@examples(30)
@given(objects=gt_objects())
def test_an_array_target_parses_back_to_its_objects_with_every_box_supervised(tok, objects):
    target = channel_a_target(objects, tok, answer_format=ARRAY)
    res = parse_rollout(list(target.token_ids), tok, answer_format=ARRAY)
    assert [(o.index, o.desc, o.bins) for o in res.valid_objects] == [
        (i, g.desc.strip(), g.bins) for i, g in enumerate(objects, 1)]
    assert res.n_dropped == 0 and not res.truncated and res.invalid_rollout == (not objects)
    assert target.coord_bins.tolist() == [b for g in objects for b in g.bins]
    assert res.prefix_text == (serialize_objects(objects, ARRAY)[:-2] if objects else '{"objects": [')
    assert decode(tok, res.prefix_token_ids) == res.prefix_text


@examples(20)
@given(objects=gt_objects(max_size=4))
def test_every_truncation_of_an_array_keeps_exactly_the_complete_objects_and_counts_the_started_one(tok, objects):
    ids = encode(tok, serialize_objects(objects, ARRAY))
    full = parse_rollout(ids, tok, answer_format=ARRAY)
    for k in range(len(ids) + 1):
        res = parse_rollout(ids[:k], tok, answer_format=ARRAY)
        end = full.token_starts[k]
        complete = [o for o in full.valid_objects if o.value_span[1] <= end]
        started = [o for o in full.valid_objects if o.value_span[0] < end]
        assert res.valid_objects == complete, k
        assert res.dropped_by_reason == {**dict.fromkeys(DROP_REASONS, 0), "key_invalid": len(started) - len(complete)}
        assert res.truncated == (k < len(ids))
        assert res.invalid_rollout == (not complete)
        assert decode(tok, res.prefix_token_ids) == res.prefix_text
        assert res.prefix_text.endswith("}") or res.prefix_text == '{"objects": ['


@examples(150)
@given(data=st.data())
def test_array_parsing_never_raises_on_random_token_sequences(tok, data):
    pool = interesting_ids(tok) + encode(tok, '{"objects": [')
    ids = data.draw(st.lists(st.one_of(st.sampled_from(pool), st.integers(-3, len(tok) + 50)), max_size=60))
    res = parse_rollout(ids, tok, answer_format=ARRAY)
    assert decode(tok, res.prefix_token_ids) == res.prefix_text
    assert res.n_dropped == sum(res.dropped_by_reason.values()) >= 0
    assert not (res.invalid_rollout and res.valid_objects)


ELEMENT_CASES = [(reason, bad[len('"object_2": '):]) for reason, bad in BUCKET_CASES if bad.startswith('"object_2": ')]


@pytest.mark.parametrize("reason,bad", ELEMENT_CASES)
def test_each_invalid_element_is_dropped_into_the_bucket_its_object_keys_twin_is(tok, reason, bad):
    res = parse(tok, '{"objects": [' + CAT + ", " + bad + ", " + OWL + "]}")
    # an element that is no object takes no place: the owl is then the 2nd object element
    assert [(o.index, o.desc) for o in res.valid_objects] == [(1, "cat"), (2 if bad == "5" else 3, "owl")]
    assert res.dropped_by_reason == {**dict.fromkeys(DROP_REASONS, 0), reason: 1}
    assert not res.truncated


@pytest.mark.parametrize("text", [
    '{"objects": [' + CAT + "], \"extra\": 1}",  # a second top-level key
    '{"objects": [' + CAT + "], \"objects\": [" + OWL + "]}",  # a second objects array
    '{"objects": [' + CAT + ', "owl"]}',  # an element that is not an object
])
def test_anything_but_objects_in_the_one_objects_array_is_key_invalid(tok, text):
    res = parse(tok, text)
    assert [o.desc for o in res.valid_objects] == ["cat"]
    assert res.dropped_by_reason == {**dict.fromkeys(DROP_REASONS, 0), "key_invalid": 1}


def test_each_format_reads_the_other_as_an_invalid_rollout(tok):
    objs = [GTObject("cat", (1, 2, 30, 40))]
    as_array = parse(tok, serialize_objects(objs), ARRAY)
    as_keys = parse(tok, serialize_objects(objs, ARRAY), "object_keys")
    for res in (as_array, as_keys):
        assert res.valid_objects == [] and res.invalid_rollout and res.n_dropped == 1, res.dropped_by_reason
    assert as_array.prefix_text == '{"objects": [' and as_keys.prefix_text == "{"


@pytest.mark.parametrize("rollout,n_kept", [
    ('{"objects": [' + CAT + ', {"desc": "dog", "bbox_2d": ["' + coord_token(3), 1),  # truncated inside object 2
    ('{"objects": [' + CAT + "]}", 1),
    ("no json at all", 0),
])
def test_a_rollout_prefix_is_completed_inside_the_array_with_the_missed_objects(tok, rollout, n_kept):
    gt = [GTObject("cat", (1, 2, 30, 40)), GTObject("dog", (100, 100, 300, 300))]
    res = parse(tok, rollout, end=False)
    assert res.n_valid == n_kept
    match = hungarian_match(*[np.array([o.bins for o in x], dtype=float).reshape(-1, 4)
                              for x in (res.valid_objects, gt)], **MATCH)
    target = rollout_prefix_target(res, match, gt, tok)
    text = decode(tok, target.token_ids[:-1])
    assert text.startswith(res.prefix_text) and text.endswith("]}")
    back = parse_rollout(list(target.token_ids), tok, answer_format=ARRAY)
    assert [o.desc for o in back.valid_objects] == ["cat", "dog"]  # kept cat (or FN-appended) first, then dog
    assert back.n_dropped == 0 and not back.truncated
    assert target.n_fn == len(gt) - n_kept
    assert target.coord_bins.tolist()[-4:] == list(gt[1].bins)  # the missed dog's box is supervised


def test_the_evaluator_scores_array_answers_and_counts_invalid_and_truncated_ones(tok, tmp_path):
    from PIL import Image

    Image.new("RGB", (100, 100)).save(tmp_path / "a.png")
    gt = (GTObject("cat", (1, 2, 30, 40)), GTObject("owl", (500, 500, 600, 600)))
    records = [Record(id=f"r{i}", images=("a.png",), width=100, height=100, objects=gt) for i in range(3)]
    answers = [(serialize_objects(gt, ARRAY), "stop"),  # both right
               ('{"objects": [' + CAT + ', {"desc": "owl", "bbox_2d": [', "length"),  # cut: cat right, owl lost
               (serialize_objects(gt), "stop")]  # the other format: nothing

    def infer(items, sampling):
        outs = [SimpleNamespace(token_ids=encode(tok, answers[int(it.id[1:])][0]) + encode(tok, IM_END),
                                finish_reason=answers[int(it.id[1:])][1], logprobs=None) for it in items]
        return [0] * len(items), outs

    result = evaluate_records(records, infer, tokenizer=tok, coord_ids=None, image_root=tmp_path, max_new_tokens=64,
                              batch_size=3, prompts=Prompts.of(None, None, ARRAY))
    r = result.report
    assert (r.n_images, r.n_gt, r.n_pred, r.n_matched) == (3, 6, 3, 3)
    assert r.dropped_objects["key_invalid"] == 3  # the cut owl, and the object_1 and object_2 keys of the third
    assert [im.parse_failed for im in result.images] == [False, False, True]
    assert r.truncated_rate == pytest.approx(1 / 3)
    assert r.parse_failure_rate == pytest.approx(1 / 3)


def test_the_config_key_picks_the_format_and_its_default_instructions(tmp_path):
    from common.config.load import ConfigError, load_config

    from tests.conftest import REPO_ROOT

    cfg = load_config(REPO_ROOT / "configs" / "demo_cpu.yaml", ["data.answer_format=objects_array"], world_size=1)
    assert cfg.data.answer_format == ARRAY
    assert Prompts.of(cfg.data.system_prompt, None, ARRAY).system == (cfg.data.system_prompt or SYSTEM_PROMPT_OBJECTS_ARRAY)
    assert Prompts.of(None, None).system == SYSTEM_PROMPT and Prompts.of(None, None).answer_format == "object_keys"
    with pytest.raises(ConfigError, match="data.answer_format"):
        load_config(REPO_ROOT / "configs" / "demo_cpu.yaml", ["data.answer_format=array"], world_size=1)


def test_the_actor_pipeline_of_an_objects_array_run_matches_array_rollouts_and_completes_them_in_the_array(
        tiny_model_dir, synth_data_dir, tmp_path):
    """The config's format reaches the actor's parser and its Channel-B targets (via the encoder's prompts)."""
    import json

    from actor.pipeline import Pipeline, Rollout
    from common.detection.answer import canonical_order
    from common.config.load import load_config
    from common.packing.encode import encoder_from_config

    cfg = load_config("configs/demo_cpu.yaml", [
        f"model.path={tiny_model_dir}", f"data.train_jsonl={synth_data_dir / 'train.jsonl'}",
        f"training.output_dir={tmp_path}", "data.answer_format=objects_array", "data.system_prompt=null"])
    encoder = encoder_from_config(cfg)
    assert encoder.prompts == Prompts.of(None, cfg.data.user_prompt, ARRAY)
    pipeline = Pipeline(cfg, encoder)
    lines = (synth_data_dir / "train.jsonl").read_text().splitlines()[:3]
    samples = [pipeline.sample(f"{json.loads(x)['id']}@0", json.loads(x)) for x in lines]
    tok = pipeline.tokenizer
    perfect = [Rollout(encode(tok, serialize_objects(canonical_order(s.record.objects), ARRAY) + IM_END), ver=1)
               for s in samples]
    segments, metrics = pipeline.build_segments(samples, perfect)
    m = metrics.summary()
    assert m["rollout/f1"] == 1.0 and m["rollout/invalid_rollout"] == 0
    assert len(segments) == len(samples)
    for seg in segments:  # the assistant span of every segment is an objects array
        answer = decode(tok, seg.input_ids[seg.labels != -100])
        assert '{"objects": [' in decode(tok, seg.input_ids) and answer.rstrip().endswith("]}" + IM_END)
    keys_format = [Rollout(encode(tok, serialize_objects(canonical_order(s.record.objects)) + IM_END), ver=1)
                   for s in samples]
    _, metrics = pipeline.build_segments(samples, keys_format)
    assert metrics.summary()["rollout/invalid_rollout"] == len(samples)  # the other format is refused, counted


def test_the_empty_array_is_the_one_well_formed_empty_answer_and_a_bare_brace_pair_fails(tok):
    from common.evaluation.metrics import parse_failed

    empty, braces = parse(tok, '{"objects": []}'), parse(tok, "{}")
    assert empty.invalid_rollout and not empty.truncated and not parse_failed(empty)
    assert braces.invalid_rollout and parse_failed(braces)  # {} is object_keys' empty answer, not this format's
    assert empty.prefix_text == braces.prefix_text == '{"objects": ['
