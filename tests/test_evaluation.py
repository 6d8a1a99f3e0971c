"""The eval loop: records -> fake /infer with crafted token ids -> strict parse -> report and eval/* record."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from common.detection.answer import IM_END, canonical_order, serialize_objects
from common.evaluation.loop import evaluate_records, load_eval_set, rollout_item
from common.wire.http import InferItem, SamplingParams
from common.detection.coord_tokens import coord_token_ids


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def val(synth_data_dir):
    return load_eval_set(synth_data_dir / "val.jsonl", max_images=6)


def ids(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def perfect(tok, record) -> list[int]:
    return ids(tok, serialize_objects(canonical_order(record.objects)) + IM_END)


class FakeInfer:
    """Answers per record id from a script; batch k is served under ver ``first_ver + k``."""

    def __init__(self, script: dict, first_ver: int = 3, abort_once: str | None = None, logprobs: bool = False):
        self.script, self.ver, self.abort_once, self.logprobs = script, first_ver, abort_once, logprobs
        self.calls: list[list[str]] = []

    def __call__(self, items: list[InferItem], sampling: SamplingParams):
        assert sampling.temperature == 0 and sampling.seed == 0
        self.calls.append([it.id for it in items])
        outs = []
        for it in items:
            token_ids, reason = self.script[it.id]
            if it.id == self.abort_once:
                self.abort_once, token_ids, reason = None, token_ids[:3], "abort"
            lps = [-0.5] * len(token_ids) if self.logprobs else None
            outs.append(SimpleNamespace(token_ids=token_ids, finish_reason=reason, text="", logprobs=lps))
        ver, self.ver = self.ver, self.ver + 1
        return [ver], outs


def script_for(tok, records):
    r = records
    return {
        r[0].id: (perfect(tok, r[0]), "stop"),
        r[1].id: (ids(tok, "hello there"), "length"),  # garbage: a parse failure
        r[2].id: (perfect(tok, r[2])[:-1][: len(perfect(tok, r[2])) // 2], "length"),  # truncated mid-answer
        r[3].id: (ids(tok, "{}" + IM_END), "stop"),  # well-formed empty answer: not a parse failure
        r[4].id: (ids(tok, '{"object_1": 5}' + IM_END), "stop"),  # nothing valid, one drop: a failure
        r[5].id: (perfect(tok, r[5]), "stop"),
    }


def test_parse_failures_truncations_and_vers_are_counted_across_batches(tok, val):
    records = val.records
    infer = FakeInfer(script_for(tok, records))
    res = evaluate_records(records, infer, tokenizer=tok, coord_ids=coord_token_ids(tok),
                           image_root=val.image_root, max_new_tokens=64, batch_size=4)
    assert [len(c) for c in infer.calls] == [4, 2]
    rep = res.report
    assert rep.n_images == 6
    assert rep.parse_failure_rate == pytest.approx(2 / 6)  # garbage + {"object_1": 5}; "{}" is not one
    assert rep.truncated_rate == pytest.approx(2 / 6)
    assert rep.dropped_objects["key_invalid"] >= 1
    assert (res.ver_min, res.ver_max) == (3, 4)
    assert [im.ver for im in res.images] == [3, 3, 3, 3, 4, 4]
    assert rep.score_source == "constant"
    # records 0 and 5 are answered perfectly, record 2 partly: every prediction matches some GT.
    n_perfect = len(records[0].objects) + len(records[5].objects)
    assert n_perfect <= rep.n_matched == rep.n_pred
    assert rep.precision == pytest.approx(1.0)
    assert rep.recall == pytest.approx(rep.n_matched / sum(len(r.objects) for r in records))
    assert res.images[0].images[0].startswith(val.image_root)


def test_the_record_has_the_eval_keys_and_omits_undefined_values(tok, val):
    records = val.records[:2]
    script = {r.id: (ids(tok, "nope"), "length") for r in records}
    res = evaluate_records(records, FakeInfer(script, first_ver=7), tokenizer=tok, coord_ids=None,
                           image_root=val.image_root, max_new_tokens=16, batch_size=8)
    rec = res.record()
    assert {"eval/precision", "eval/recall", "eval/f1", "eval/map", "eval/map_50", "eval/parse_failure_rate",
            "eval/truncated_rate", "eval/objects_per_image", "eval/gt_per_image", "eval/n_images",
            "eval/ver", "eval/time_s", "eval/score_source"} <= set(rec)
    assert "eval/mean_matched_iou" not in rec  # no matches: undefined, omitted
    assert "eval/ver_min" not in rec  # one version only
    assert rec["eval/ver"] == 7 and rec["eval/n_images"] == 2 and rec["eval/parse_failure_rate"] == 1.0
    assert rec["eval/map"] == 0.0 and rec["eval/f1"] == 0.0
    json.dumps(res.as_dict())  # the report is JSON-serialisable as is


def test_aborted_rollouts_are_resubmitted_and_logprobs_become_coord_scores(tok, val):
    records = val.records[:2]
    script = {r.id: (perfect(tok, r), "stop") for r in records}
    infer = FakeInfer(script, abort_once=records[1].id, logprobs=True)
    res = evaluate_records(records, infer, tokenizer=tok, coord_ids=None, image_root=val.image_root,
                           max_new_tokens=64, batch_size=8)
    assert infer.calls == [[records[0].id, records[1].id], [records[1].id]]
    assert res.report.parse_failure_rate == 0.0 and res.report.f1 == pytest.approx(1.0)
    assert res.report.score_source == "coord_logprob"
    scores = [p.score for im in res.images for p in im.preds]
    assert scores and scores == pytest.approx([0.6065306597] * len(scores))  # exp(-0.5)
    assert res.images[1].ver == 4  # the resubmission's version


def test_bad_lines_and_missing_images_are_skipped_and_named(tmp_path, synth_data_dir):
    lines = (synth_data_dir / "val.jsonl").read_text().splitlines()
    shutil.copytree(synth_data_dir / "images", tmp_path / "images")
    no_image = json.loads(lines[2]) | {"images": ["images/nope.png"]}
    bad_box = json.loads(lines[3]) | {"objects": [{"desc": "x", "bbox_2d": [1, 2, 3]}]}
    (tmp_path / "val.jsonl").write_text("\n".join([lines[0], "{not json", json.dumps(no_image), lines[1],
                                                   json.dumps(bad_box), "", lines[4]]) + "\n")
    ev = load_eval_set(tmp_path / "val.jsonl")
    assert len(ev.records) == 3 and len(ev.skipped) == 3
    assert ev.skipped[0].startswith("val.jsonl:2: invalid JSON")
    assert "val.jsonl:3: image not found" in ev.skipped[1]
    assert ev.skipped[2].startswith("val.jsonl:5") and "bbox_2d" in ev.skipped[2]
    capped = load_eval_set(tmp_path / "val.jsonl", max_images=2)
    assert [r.id for r in capped.records] == [r.id for r in ev.records[:2]]


def test_the_eval_prompt_is_the_actors_rollout_prompt(tiny_model_dir, val):
    from common.packing.encode import Encoder

    enc = Encoder(tiny_model_dir, 4096, image_root=val.image_root)
    rec = val.records[0]
    paths = enc.image_paths(rec)
    assert rollout_item(rec, paths, item_id="x") == enc.prompt_for_rollout(rec, paths, item_id="x")
