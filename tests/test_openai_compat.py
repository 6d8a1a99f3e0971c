"""The official ``openai`` package, as a real client, talks to the rollout server's /v1 routes."""

from __future__ import annotations

import base64

import openai
import pytest

from tests.server_proc import rollout_server_process

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with rollout_server_process(tiny_model_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60.0, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client, tiny_model_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [str(tiny_model_dir)]


def test_completions_return_text_finish_reason_usage_and_the_ver(client, model_id):
    out = client.completions.create(model=model_id, prompt="Detect all objects.", max_tokens=5, temperature=0)
    assert len(out.choices) == 1 and isinstance(out.choices[0].text, str)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 5 and out.usage.prompt_tokens > 0
    assert out.system_fingerprint == "ver-0"
    batch = client.completions.create(model=model_id, prompt=["Detect all objects.", "hello"], max_tokens=5,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == out.choices[0].text  # greedy: same prompt, same text


def test_seeded_completions_are_reproducible(client, model_id):
    kw = dict(model=model_id, prompt="hello", max_tokens=8, temperature=1.0, seed=11, extra_body={"top_k": 0})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_chat_completions_take_text_and_an_image_data_uri(client, model_id, synth_data_dir):
    png = sorted((synth_data_dir / "images").glob("*.png"))[0].read_bytes()
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    out = client.chat.completions.create(model=model_id, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "You detect objects."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                     {"type": "text", "text": "Detect all objects."}]}])
    msg = out.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert out.choices[0].finish_reason in ("stop", "length")
    text_only = client.chat.completions.create(model=model_id, max_tokens=6, temperature=0,
                                               messages=[{"role": "user", "content": "Detect all objects."}])
    assert out.usage.prompt_tokens > text_only.usage.prompt_tokens  # the image's vision tokens were in the prompt


def test_unsupported_requests_are_a_400_the_client_raises(client, model_id):
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.completions.create(model=model_id, prompt="x", max_tokens=2, n=2)
    with pytest.raises(openai.UnprocessableEntityError, match="do(es)? not download"):  # breaks the schema
        client.chat.completions.create(model=model_id, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=model_id, prompt="x", max_tokens=10**9)


def test_values_the_engine_cannot_take_are_a_422_or_400_naming_them_never_a_500(client, model_id):
    with pytest.raises(openai.UnprocessableEntityError, match="seed"):
        client.completions.create(model=model_id, prompt="x", max_tokens=2, seed=2**64)
    with pytest.raises(openai.UnprocessableEntityError, match="stop"):
        client.completions.create(model=model_id, prompt="x", max_tokens=2, stop=[""])
    with pytest.raises(openai.UnprocessableEntityError, match="role"):
        client.chat.completions.create(model=model_id, max_tokens=2, messages=[{"role": ["user"], "content": "x"}])
