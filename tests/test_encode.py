"""Teacher-forced encoding on the tiny Qwen2.5-VL: prompt, labels, coord positions, rope index, length."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from PIL import Image

from common.packing.encode import Encoder
from common.detection.answer import IM_END, build_messages, canonical_order, serialize_objects
from common.data.records import iter_jsonl
from common.detection.matching import hungarian_match
from common.detection.parsing import parse_rollout
from common.data.processor import load_processor
from common.packing.segment import IGNORE_INDEX, pixel_floats
from common.detection.targets import channel_a_target, reordered_gt_target, rollout_prefix_target


@pytest.fixture(scope="module")
def encoder(tiny_model_dir, synth_data_dir):
    return Encoder(tiny_model_dir, packing_length=4096, image_root=str(synth_data_dir))


@pytest.fixture(scope="module")
def records(synth_data_dir):
    return list(iter_jsonl(synth_data_dir / "train.jsonl"))[:6]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_model_dir).eval()


def encode_a(encoder, record, **kw):
    target = channel_a_target(canonical_order(record.objects), encoder.tokenizer, coord_ids=encoder.coord_ids)
    return encoder.encode(record, target, sample_id=record.id, channel="A", ver=0, **kw), target


def full_conversation(encoder, record):
    """The processor's own encoding of the whole chat, assistant answer included (the reference)."""
    processor = load_processor(encoder.model_path)
    paths = encoder.image_paths(record)
    messages = build_messages(record, paths, assistant=serialize_objects(canonical_order(record.objects)))
    text = processor.apply_chat_template(messages, tokenize=False)
    images = [Image.open(p).convert("RGB") for p in paths]
    return processor(text=[text], images=images, return_tensors="pt")


def test_the_segment_equals_the_processors_encoding_of_the_chat_templated_conversation(encoder, records):
    for record in records:
        segment, target = encode_a(encoder, record)
        ref = full_conversation(encoder, record)
        ids = ref["input_ids"][0].numpy()
        # The template closes the turn with "<|im_end|>\n"; the segment stops at the turn end.
        assert encoder.tokenizer.decode(ids[segment.length :]) == "\n"
        np.testing.assert_array_equal(segment.input_ids, ids[: segment.length])
        np.testing.assert_array_equal(segment.image_grid_thw, ref["image_grid_thw"].numpy())
        assert segment.pixel_values.dtype == np.uint8  # the processor's floats come back from it exactly:
        floats = pixel_floats(segment.pixel_values, segment.pixel_affine)
        np.testing.assert_allclose(floats, ref["pixel_values"].numpy(), rtol=0, atol=1e-6)
        prompt = encoder.prompt(record, encoder.image_paths(record))
        assert segment.meta["prompt_len"] == prompt["input_ids"].shape[0] == segment.length - len(target)


def test_labels_cover_only_the_assistant_span_and_never_a_coord_token(encoder, records):
    coord = set(encoder.coord_ids)
    for record in records:
        segment, target = encode_a(encoder, record)
        p = segment.meta["prompt_len"]
        assert (segment.labels[:p] == IGNORE_INDEX).all()
        supervised = np.flatnonzero(segment.labels != IGNORE_INDEX)
        assert supervised.min() >= p and supervised.size > 0
        np.testing.assert_array_equal(segment.labels[supervised], segment.input_ids[supervised])
        assert not coord.intersection(segment.labels[supervised].tolist())
        assert (segment.weights[segment.labels == IGNORE_INDEX] == 0).all()
        assert (segment.weights[supervised] > 0).all()
        assert segment.labels[-1] == encoder.tokenizer.convert_tokens_to_ids(IM_END)  # the turn end is learned


def test_coord_positions_point_at_coord_tokens_whose_ids_map_to_the_gt_bins(encoder, records):
    coord_ids = np.asarray(encoder.coord_ids)
    for record in records:
        segment, _ = encode_a(encoder, record)
        np.testing.assert_array_equal(segment.input_ids[segment.coord_pos], coord_ids[segment.coord_bins])
        want = [k for o in canonical_order(record.objects) for k in o.bins]
        assert segment.coord_bins.tolist() == want
        assert (segment.labels[segment.coord_pos] == IGNORE_INDEX).all()


def test_channel_b_targets_shift_rollout_positions_by_the_prompt_length(encoder, records):
    record = records[0]
    gt = canonical_order(record.objects)
    rollout_ids = encoder.tokenizer.encode(serialize_objects(gt[:2]) + IM_END, add_special_tokens=False)
    parse = parse_rollout(rollout_ids, encoder.tokenizer, coord_ids=encoder.coord_ids)
    boxes = np.array([o.bins for o in parse.valid_objects], float)
    match = hungarian_match(boxes, np.array([o.bins for o in record.objects], float), candidate_top_k=5, gate=0.3,
                            fp_cost=1.0, fn_cost=1.0)
    for build in (reordered_gt_target, rollout_prefix_target):
        target = build(parse, match, list(record.objects), encoder.tokenizer, coord_ids=encoder.coord_ids)
        segment = encoder.encode(record, target, sample_id="b", channel="B", ver=3)
        p = segment.meta["prompt_len"]
        np.testing.assert_array_equal(segment.input_ids[p:], target.token_ids)
        np.testing.assert_array_equal(segment.coord_pos, target.coord_positions + p)
        np.testing.assert_array_equal(np.asarray(encoder.coord_ids)[segment.coord_bins], segment.input_ids[segment.coord_pos])
        assert segment.ver == 3 and segment.channel == "B"


def test_position_ids_equal_the_models_own_rope_index_for_the_segment(encoder, records, model):
    import torch

    for record in records[:3]:
        segment, _ = encode_a(encoder, record)
        ref = full_conversation(encoder, record)
        n = segment.length
        want, _ = model.model.get_rope_index(
            ref["input_ids"][:, :n], mm_token_type_ids=ref["mm_token_type_ids"][:, :n],
            image_grid_thw=ref["image_grid_thw"], attention_mask=torch.ones(1, n, dtype=torch.long),
        )
        assert segment.position_ids.shape == (3, n)
        np.testing.assert_array_equal(segment.position_ids, want[:, 0].numpy())
        assert segment.position_ids[:, 0].tolist() == [0, 0, 0]  # text positions restart in every segment
        vision = np.flatnonzero(ref["mm_token_type_ids"][0, :n].numpy())
        assert len({tuple(segment.position_ids[:, k]) for k in vision}) == vision.size  # real 3-D positions


def test_a_segment_longer_than_packing_length_is_dropped_counted_and_logged_with_the_fix(tiny_model_dir, synth_data_dir,
                                                                                      records, caplog):
    short = Encoder(tiny_model_dir, packing_length=64, image_root=str(synth_data_dir))
    with caplog.at_level(logging.WARNING, logger="common.packing.encode"):
        segment, _ = encode_a(short, records[0])
        segment2, _ = encode_a(short, records[1])
    assert segment is None and segment2 is None
    assert short.counters["too_long_dropped"] == 2 and short.counters["encoded"] == 0
    assert "training.global_max_length" in caplog.text and "never truncated" in caplog.text


def test_the_rollout_prompt_carries_the_same_messages_and_images(encoder, records):
    record = records[0]
    paths = encoder.image_paths(record)
    item = encoder.prompt_for_rollout(record, paths, item_id="k@0")
    assert item.images == paths and item.id == "k@0"
    # Put the images back in their slots: the chat template renders the very same prompt text.
    it = iter(item.images)
    messages = [{"role": m.role, "content": [{"type": "image", "image": next(it)} if p.type == "image"
                                             else {"type": "text", "text": p.text} for p in m.content]}
                for m in item.messages]
    tmpl = encoder.processor.apply_chat_template
    assert tmpl(messages, tokenize=False, add_generation_prompt=True) == tmpl(
        build_messages(record, paths), tokenize=False, add_generation_prompt=True)


def test_a_server_prompt_that_differs_is_counted(encoder, records):
    prompt = encoder.prompt(records[0], encoder.image_paths(records[0]))["input_ids"]
    before = dict(encoder.counters)
    assert encoder.check_server_prompt("s", prompt.tolist(), prompt)
    assert not encoder.check_server_prompt("s", prompt.tolist()[:-1] + [0], prompt)
    assert encoder.counters["prompt_checked"] == before["prompt_checked"] + 2
    assert encoder.counters["prompt_mismatch"] == before["prompt_mismatch"] + 1
