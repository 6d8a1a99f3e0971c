"""The run's prompts (``data.system_prompt`` / ``data.user_prompt``) reach every place a prompt is built.

Teacher forcing (Encoder.prompt), the actor's /infer item (Encoder.prompt_for_rollout), the evaluation's
item (common.evaluation.loop.rollout_item / evaluate_records), and the rollout server's templating of that
item must all agree, or Channel-B splices rollouts after a prompt the model never saw.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from common.packing.encode import Encoder, encoder_from_config
from common.detection.answer import DEFAULT_PROMPTS, SYSTEM_PROMPT, USER_PROMPT, Prompts
from common.data.records import iter_jsonl
from common.config.load import load_config
from common.evaluation.loop import evaluate_records, rollout_item
from common.wire.http import InferResponse
from tests.server_proc import rollout_server_process
from tests.test_learner_harness import write_config

CUSTOM = Prompts(system="You spot shapes. One JSON line, please.", user="Which shapes are there?")


@pytest.fixture(scope="module")
def custom_encoder(tiny_model_dir, synth_data_dir):
    return Encoder(tiny_model_dir, packing_length=4096, image_root=str(synth_data_dir), prompts=CUSTOM)


@pytest.fixture(scope="module")
def default_encoder(tiny_model_dir, synth_data_dir):
    return Encoder(tiny_model_dir, packing_length=4096, image_root=str(synth_data_dir))


@pytest.fixture(scope="module")
def record(synth_data_dir):
    return next(iter(iter_jsonl(synth_data_dir / "train.jsonl")))


def texts_of(item) -> dict[str, str]:
    return {m.role: " ".join(p.text for p in m.content if p.type == "text") for m in item.messages}


def test_custom_prompts_are_in_the_encoders_prompt_ids_and_the_defaults_are_not(custom_encoder, default_encoder, record):
    paths = custom_encoder.image_paths(record)
    decoded = custom_encoder.tokenizer.decode(custom_encoder.prompt(record, paths)["input_ids"])
    assert CUSTOM.system in decoded and CUSTOM.user in decoded
    assert SYSTEM_PROMPT not in decoded and USER_PROMPT not in decoded
    default = default_encoder.tokenizer.decode(default_encoder.prompt(record, paths)["input_ids"])
    assert SYSTEM_PROMPT in default and USER_PROMPT in default


def test_custom_prompts_are_in_the_infer_item_and_both_builders_make_the_same_item(custom_encoder, record):
    paths = custom_encoder.image_paths(record)
    item = custom_encoder.prompt_for_rollout(record, paths, item_id="s@0")
    assert texts_of(item) == {"system": CUSTOM.system, "user": CUSTOM.user}
    assert item.images == paths
    assert rollout_item(record, paths, item_id="s@0", prompts=CUSTOM) == item
    assert rollout_item(record, paths, item_id="s@0") != item  # the default prompts make another item


def test_none_in_the_config_means_the_default_prompts_and_a_text_replaces_only_its_own(tmp_path, tiny_model_dir,
                                                                                     synth_data_dir):
    def config(**data):
        path = write_config(tmp_path / f"cfg{len(data)}.yaml", model_dir=tiny_model_dir, data_dir=synth_data_dir,
                            output_dir=tmp_path / "run", nproc=1, data=data)
        return load_config(path, world_size=1)

    assert config().data.system_prompt is None and config().data.user_prompt is None
    assert encoder_from_config(config()).prompts == DEFAULT_PROMPTS
    both = config(system_prompt=CUSTOM.system, user_prompt=CUSTOM.user)
    assert encoder_from_config(both).prompts == CUSTOM
    assert Prompts.of(None, CUSTOM.user) == Prompts(system=SYSTEM_PROMPT, user=CUSTOM.user)
    assert Prompts.of(CUSTOM.system, None) == Prompts(system=CUSTOM.system, user=USER_PROMPT)


def test_evaluate_records_sends_the_items_of_the_given_prompts(tiny_model_dir, synth_data_dir, custom_encoder):
    records = list(iter_jsonl(synth_data_dir / "val.jsonl"))[:3]
    sent = []

    def infer(items, sampling):
        sent.extend(items)
        return [0], [SimpleNamespace(token_ids=[], finish_reason="stop", logprobs=None) for _ in items]

    result = evaluate_records(records, infer, tokenizer=custom_encoder.tokenizer, coord_ids=custom_encoder.coord_ids,
                              image_root=synth_data_dir, max_new_tokens=8, batch_size=2, prompts=CUSTOM)
    assert result.report.n_images == 3
    assert [texts_of(it) for it in sent] == [{"system": CUSTOM.system, "user": CUSTOM.user}] * 3
    assert sent[0] == custom_encoder.prompt_for_rollout(records[0], custom_encoder.image_paths(records[0]),
                                                        item_id=records[0].id or "eval-0")


@pytest.mark.slow
def test_the_server_templates_a_custom_prompt_item_into_the_encoders_prompt_ids(tiny_model_dir, custom_encoder,
                                                                               default_encoder, record):
    """The custom-prompt variant of the actor's prompt check (test_actor_process: actor/prompt_mismatch == 0)."""
    paths = custom_encoder.image_paths(record)
    items = [custom_encoder.prompt_for_rollout(record, paths, item_id="custom"),
             default_encoder.prompt_for_rollout(record, paths, item_id="default")]
    body = {"items": [json.loads(i.model_dump_json(exclude_none=True)) for i in items],
            "sampling": {"max_tokens": 1, "temperature": 0.0}}
    with rollout_server_process(tiny_model_dir) as server:
        r = httpx.post(server.url + "/infer", json=body, timeout=httpx.Timeout(120.0, connect=5.0))
    assert r.status_code == 200, r.text
    custom_out, default_out = InferResponse.model_validate_json(r.content).outputs
    ours = custom_encoder.prompt(record, paths)["input_ids"]
    assert custom_encoder.check_server_prompt("custom", custom_out.prompt_token_ids, ours)
    np.testing.assert_array_equal(np.asarray(custom_out.prompt_token_ids), ours)
    assert default_encoder.check_server_prompt("default", default_out.prompt_token_ids,
                                               default_encoder.prompt(record, paths)["input_ids"])
    assert custom_out.prompt_token_ids != default_out.prompt_token_ids
