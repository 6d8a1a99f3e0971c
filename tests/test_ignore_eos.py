"""``sampling.ignore_eos`` (vLLM's ``ignore_eos``): rows generate past their stop tokens to ``max_tokens``.

Checked on the hf engine's generator with the tiny model (made to stop at once by declaring the token
it greedily picks first its eos), on the vLLM sampling conversion (no stop ids, vLLM's own flag), on
the protocol (absent from the JSON unless set) and on ``/v1/completions``'s request model.
"""

from __future__ import annotations

import json

import pytest
import torch

from common.wire.http import SamplingParams


PROMPT = [{"role": "user", "content": "Detect all objects."}]


@pytest.fixture(scope="module")
def generator_stopping_at_its_first_token(tiny_model_dir):
    """An HFGenerator whose eos is the token greedy decoding of PROMPT picks first, and that token."""
    from transformers import AutoModelForImageTextToText

    from common.generation.generator import HFGenerator
    from common.data.processor import load_processor

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    processor = load_processor(str(tiny_model_dir))
    free = HFGenerator(model, processor, device="cpu", max_batch=4)
    first = free.generate([PROMPT], None, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0].token_ids[0]
    model.generation_config.eos_token_id = first  # HFGenerator reads its stop ids from here
    return HFGenerator(model, processor, device="cpu", max_batch=4), first


def test_the_hf_generator_stops_at_eos_unless_ignore_eos(generator_stopping_at_its_first_token):
    gen, eos = generator_stopping_at_its_first_token
    assert eos in gen.stop_token_ids
    stopped = gen.generate([PROMPT, PROMPT], None, SamplingParams(max_tokens=6, temperature=0))
    assert [(o.token_ids, o.finish_reason) for o in stopped] == [([eos], "stop")] * 2
    ran = gen.generate([PROMPT, PROMPT], None, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for o in ran:
        assert len(o.token_ids) == 6 and o.token_ids[0] == eos and o.finish_reason == "length"


def test_vllm_gets_no_stop_ids_and_its_own_flag_with_ignore_eos():
    from rollout_server.engines.vllm.convert import sampling_kwargs

    plain = sampling_kwargs(SamplingParams(max_tokens=4), [7, 9])
    assert plain["stop_token_ids"] == [7, 9] and plain["ignore_eos"] is False
    ignoring = sampling_kwargs(SamplingParams(max_tokens=4, ignore_eos=True, stop=["x"]), [7, 9])
    assert ignoring["stop_token_ids"] == [] and ignoring["ignore_eos"] is True and ignoring["stop"] == ["x"]


def test_ignore_eos_travels_only_when_set_and_v1_completions_takes_it():
    from rollout_server.routes.openai import CompletionRequest

    assert "ignore_eos" not in json.loads(SamplingParams(max_tokens=4).model_dump_json())  # older peers still parse
    assert json.loads(SamplingParams(max_tokens=4, ignore_eos=True).model_dump_json())["ignore_eos"] is True
    assert CompletionRequest(prompt="x", ignore_eos=True).sampling(16).ignore_eos is True
    assert CompletionRequest(prompt="x").sampling(16).ignore_eos is False
