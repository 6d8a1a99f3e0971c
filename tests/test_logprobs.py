"""``sampling.logprobs``: the raw logprob of every generated token, on both engines and over HTTP.

The hf engine's numbers are checked against separate full forward passes of the tiny model (no
padding, no cache, no sampler); the vLLM engine's conversion of ``CompletionOutput.logprobs`` is
checked on hand-made outputs (vLLM itself runs in tests/test_gpu_vllm.py); the server test drives
the real app in process with the real hf engine.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from common.wire.http import InferOutput, InferResponse, SamplingParams
from common.generation.sampling import VLLMSampler, finish_row

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """(model, HFGenerator) on CPU in float32."""
    from transformers import AutoModelForImageTextToText

    from common.generation.generator import HFGenerator
    from common.data.processor import load_processor

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model, HFGenerator(model, load_processor(str(tiny_model_dir)), device="cpu", max_batch=8)


def reference_logprobs(model, out: InferOutput, n: int) -> list[float]:
    """log_softmax of one unpadded forward pass over prompt + the first k tokens, at token k, k < n."""
    ids = out.prompt_token_ids + out.token_ids
    p = len(out.prompt_token_ids)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[: p + n - 1]])).logits[0].float()
    logp = logits[p - 1: p + n - 1].log_softmax(-1)
    return logp.gather(-1, torch.tensor(out.token_ids[:n]).unsqueeze(-1)).squeeze(-1).tolist()


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


# ---------------------------------------------------------------------------------------------
# the sampler and finish_row (hand-made logits)
# ---------------------------------------------------------------------------------------------


def test_the_sampler_records_the_raw_logprob_of_the_chosen_token_before_the_penalty():
    logits = torch.tensor([[0.0, 3.0, 2.0, -5.0]])
    sampler = VLLMSampler(SamplingParams(temperature=0, repetition_penalty=2.0, max_tokens=2, logprobs=True),
                          [0], 1, CPU)
    out = sampler(torch.tensor([[1]]), logits.clone())  # token 1 was seen: 3.0 / 2 < 2.0, token 2 wins
    assert out.argmax(-1).tolist() == [2]
    sampler(torch.tensor([[1, 2]]), torch.tensor([[9.0, 0.0, 0.0, 0.0]]))
    got = sampler.sampled_logprobs()
    want = [logits.log_softmax(-1)[0, 2].item(), torch.tensor([9.0, 0, 0, 0]).log_softmax(-1)[0].item()]
    assert got == [pytest.approx(want, abs=1e-6)]
    assert VLLMSampler(SamplingParams(max_tokens=1), [0], 1, CPU).sampled_logprobs() is None


def test_finish_row_cuts_the_logprobs_with_the_tokens_at_the_turn_end_and_at_a_stop_string():
    class Tok:  # one character per id (chr(96 + id)); id 0 = turn end
        def decode(self, ids, **_):
            return "".join("<E>" if i == 0 else chr(96 + i) for i in ids)

    lps = [-0.1, -0.2, -0.3, -0.4, -0.5]
    end = finish_row(Tok(), [1], [1, 2, 0, 5, 5], [0], SamplingParams(max_tokens=5, logprobs=True), 5, logprobs=lps)
    assert end.token_ids == [1, 2, 0] and end.logprobs == [-0.1, -0.2, -0.3]
    cut = finish_row(Tok(), [1], [1, 2, 3, 4, 4], [0], SamplingParams(max_tokens=5, stop=["bc"]), 5, logprobs=lps)
    assert cut.token_ids == [1, 2, 3] and cut.logprobs == [-0.1, -0.2, -0.3]
    assert finish_row(Tok(), [1], [1, 2], [0], SamplingParams(max_tokens=2), 5).logprobs is None


def test_logprobs_travel_only_when_set_so_older_peers_still_parse_the_messages():
    assert "logprobs" not in json.loads(SamplingParams(max_tokens=4).model_dump_json())
    assert json.loads(SamplingParams(max_tokens=4, logprobs=True).model_dump_json())["logprobs"] is True
    plain = InferOutput(token_ids=[1, 2], text="ab", finish_reason="length", prompt_token_ids=[3])
    assert "logprobs" not in json.loads(plain.model_dump_json())
    with pytest.raises(ValueError, match="1 logprobs for 2 token_ids"):
        InferOutput(token_ids=[1, 2], text="ab", finish_reason="length", prompt_token_ids=[3], logprobs=[-1.0])


# ---------------------------------------------------------------------------------------------
# HFGenerator on the tiny model
# ---------------------------------------------------------------------------------------------


def test_greedy_logprobs_equal_log_softmax_of_a_separate_forward_pass_in_a_left_padded_batch(tiny):
    model, gen = tiny
    prompts = [[5, 6, 7], chat("Detect all objects. " * 3), [11, 12, 13, 14, 15, 16, 17, 18]]
    outs = gen.generate(prompts, None, SamplingParams(temperature=0, max_tokens=8, logprobs=True))
    assert len({len(o.prompt_token_ids) for o in outs}) == 3  # different lengths: rows are left-padded
    for o in outs:
        assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids) > 0
        assert all(lp <= 0 for lp in o.logprobs)
        n = min(4, len(o.token_ids))
        assert o.logprobs[:n] == pytest.approx(reference_logprobs(model, o, n), abs=1e-4)
    plain = gen.generate(prompts, None, SamplingParams(temperature=0, max_tokens=8))
    assert [o.logprobs for o in plain] == [None] * 3
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs]  # asking for logprobs changes no token


def test_sampled_logprobs_are_the_raw_models_whatever_the_temperature_top_k_and_penalty(tiny):
    model, gen = tiny
    knobs = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3, seed=3, max_tokens=6,
                           logprobs=True)
    for o in gen.generate([chat("Detect all objects."), [9, 9, 9]], None, knobs):
        assert len(o.logprobs) == len(o.token_ids)
        assert o.logprobs == pytest.approx(reference_logprobs(model, o, len(o.token_ids)), abs=1e-4)


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(tiny):
    _, gen = tiny
    item = [chat("Detect all objects.")]
    free = gen.generate(item, None, SamplingParams(temperature=0, max_tokens=10, logprobs=True))[0]
    stop = free.text[len(free.text) // 2:][:2] or free.text[:1]
    cut = gen.generate(item, None, SamplingParams(temperature=0, max_tokens=10, stop=[stop], logprobs=True))[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(free.token_ids)
    assert cut.logprobs == pytest.approx(free.logprobs[: len(cut.token_ids)], abs=1e-6)


# ---------------------------------------------------------------------------------------------
# the vLLM engine's conversion (no vLLM needed)
# ---------------------------------------------------------------------------------------------


def test_vllm_completion_logprobs_become_the_sampled_tokens_logprobs_in_order():
    from rollout_server.engines.vllm.convert import sampled_logprobs

    def lp(value, rank=1):
        return SimpleNamespace(logprob=value, rank=rank, decoded_token="x")

    # logprobs=0: one entry per position, the sampled token (a top-1 entry can ride along with N > 0)
    entries = [{90: lp(-0.25)}, {1: lp(-1.5, rank=3), 7: lp(-0.1)}, {151645: lp(-0.0)}]
    assert sampled_logprobs([90, 1, 151645], entries) == [-0.25, -1.5, -0.0]
    assert sampled_logprobs([], []) == []
    with pytest.raises(RuntimeError, match="2 logprob entries for 3 generated tokens"):
        sampled_logprobs([90, 1, 151645], entries[:2])
    with pytest.raises(RuntimeError, match="no logprobs"):
        sampled_logprobs([90], None)
    with pytest.raises(RuntimeError, match="token 5 at position 0"):
        sampled_logprobs([5], [{6: lp(-1.0)}])
    with pytest.raises(RuntimeError, match="nan for sampled token 5"):
        sampled_logprobs([5], [{5: lp(float("nan"))}])


# ---------------------------------------------------------------------------------------------
# POST /infer through the real app (in process, hf engine)
# ---------------------------------------------------------------------------------------------


def test_infer_returns_one_logprob_per_token_only_when_asked(tiny_model_dir):
    from fastapi.testclient import TestClient

    from rollout_server.app import build_app
    from rollout_server.engines.hf import HFEngine

    cfg = SimpleNamespace(sync_idle_timeout_s=30.0, auth_token=None, max_batch_items=8, admission_timeout_s=30.0,
                          max_bucket_mb=16)
    engine = HFEngine(str(tiny_model_dir), dtype="float32", device="cpu", max_batch=4)
    with TestClient(build_app(engine, cfg)) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the in-process hf engine did not load the tiny model within 120 s"
            time.sleep(0.1)
        items = [{"prompt_token_ids": [5, 6, 7]}, {"messages": chat("Detect all objects.")}]
        asked = client.post("/infer", json={"items": items, "sampling": {"max_tokens": 5, "temperature": 0,
                                                                         "logprobs": True}})
        plain = client.post("/infer", json={"items": items, "sampling": {"max_tokens": 5, "temperature": 0}})
    assert asked.status_code == 200 and plain.status_code == 200, (asked.text, plain.text)
    for o in asked.json()["outputs"]:
        assert len(o["logprobs"]) == len(o["token_ids"]) > 0 and all(x <= 0 for x in o["logprobs"])
    assert all("logprobs" not in o for o in plain.json()["outputs"])
    got = InferResponse.model_validate_json(asked.content)
    assert [o.token_ids for o in got.outputs] == [o["token_ids"] for o in plain.json()["outputs"]]
