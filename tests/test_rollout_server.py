"""A real rollout server process (hf engine, tiny model) on a loopback port: serving behaviour."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from common.wire.codec import SCHEMA_VERSION
from common.wire.http import HealthResponse, InferResponse
from tests.ports import free_port_block
from tests.server_proc import REPO, rollout_server_process

pytestmark = pytest.mark.slow
TIMEOUT = httpx.Timeout(60.0, connect=5.0)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with rollout_server_process(tiny_model_dir, ["rollout_server.hf_max_batch=3"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def image_path(synth_data_dir) -> Path:
    return sorted((synth_data_dir / "images").glob("*.png"))[0]


def infer(server, items, **sampling) -> InferResponse:
    sampling.setdefault("max_tokens", 6)
    r = httpx.post(server.url + "/infer", json={"items": items, "sampling": sampling}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return InferResponse.model_validate_json(r.content)


def chat(text: str, n_images: int = 0) -> list[dict]:
    return [{"role": "user", "content": [*([{"type": "image"}] * n_images), {"type": "text", "text": text}]}]


def test_health_answers_loading_first_then_ok_with_engine_model_and_ver(server, tiny_model_dir):
    assert server.statuses_seen[0] == "loading" and server.statuses_seen[-1] == "ok", server.statuses_seen
    r = httpx.get(server.url + "/health", timeout=TIMEOUT)
    h = HealthResponse.model_validate_json(r.content)
    assert r.status_code == 200
    assert (h.status, h.engine, h.ver, h.sync_state, h.world_size) == ("ok", "hf", 0, "idle", 1)
    assert h.model == str(tiny_model_dir) and h.schema_version == SCHEMA_VERSION
    assert h.engine_info["device"] == "cpu" and h.engine_info["n_params"] > 0, h.engine_info


def test_infer_completes_chat_and_token_id_prompts_in_order_with_ids_echoed(server):
    resp = infer(server, [{"id": "a", "messages": chat("Detect all objects.")},
                          {"id": "b", "prompt_token_ids": [5, 6, 7, 8]},
                          {"id": "c", "messages": [{"role": "user", "content": "plain text"}]}], temperature=0)
    assert resp.ver == 0 and resp.engine == "hf" and resp.elapsed_s > 0
    assert [o.id for o in resp.outputs] == ["a", "b", "c"]
    assert resp.outputs[1].prompt_token_ids == [5, 6, 7, 8]
    for o in resp.outputs:
        assert o.finish_reason in ("stop", "length") and 1 <= len(o.token_ids) <= 6
        assert o.finish_reason == "stop" or len(o.token_ids) == 6


def test_infer_takes_an_image_as_a_server_path_or_a_data_uri_with_the_same_result(server, image_path):
    uri = "data:image/png;base64," + base64.b64encode(image_path.read_bytes()).decode()
    resp = infer(server, [{"messages": chat("Detect all objects.", 1), "images": [str(image_path)]},
                          {"messages": chat("Detect all objects.", 1), "images": [uri]},
                          {"messages": chat("Detect all objects.")}], temperature=0)
    with_path, with_uri, without = resp.outputs
    assert with_path.token_ids == with_uri.token_ids
    assert with_path.prompt_token_ids == with_uri.prompt_token_ids
    assert len(with_path.prompt_token_ids) > len(without.prompt_token_ids)  # the image's vision tokens
    inline = infer(server, [{"messages": [{"role": "user", "content": [
        {"type": "image", "image": uri}, {"type": "text", "text": "Detect all objects."}]}]}], temperature=0)
    assert inline.outputs[0].token_ids == with_path.token_ids


def test_a_token_id_prompt_with_one_image_pad_per_image_matches_the_chat_prompt(server, image_path, tiny_model_dir):
    by_chat = infer(server, [{"messages": chat("Detect all objects.", 1), "images": [str(image_path)]}], temperature=0)
    expanded = by_chat.outputs[0].prompt_token_ids
    pad = json.loads((tiny_model_dir / "config.json").read_text())["image_token_id"]
    assert expanded.count(pad) > 1
    template_form = [t for k, t in enumerate(expanded) if t != pad or (k > 0 and expanded[k - 1] != pad)]
    by_ids = infer(server, [{"prompt_token_ids": template_form, "images": [str(image_path)]},
                            {"prompt_token_ids": expanded, "images": [str(image_path)]}], temperature=0)
    for out in by_ids.outputs:
        assert out.prompt_token_ids == expanded
        assert out.token_ids == by_chat.outputs[0].token_ids


def test_greedy_decoding_is_deterministic_across_calls_and_batch_composition(server):
    item = {"messages": chat("Detect all objects.")}
    alone = infer(server, [item], temperature=0, max_tokens=8).outputs[0]
    again = infer(server, [item], temperature=0, max_tokens=8).outputs[0]
    batched = infer(server, [{"prompt_token_ids": [9, 9, 9]}, item, {"messages": chat("x " * 30)}],
                    temperature=0, max_tokens=8).outputs[1]
    assert alone.token_ids == again.token_ids == batched.token_ids


def test_seeded_sampling_is_reproducible_and_independent_of_batch_composition(server):
    item = {"messages": chat("Detect all objects.")}
    knobs = dict(temperature=1.0, top_p=0.95, top_k=0, max_tokens=12)
    a = infer(server, [item], seed=123, **knobs).outputs[0]
    b = infer(server, [{"prompt_token_ids": [3, 4]}, item, item], seed=123, **knobs).outputs
    c = infer(server, [item], seed=124, **knobs).outputs[0]
    assert a.token_ids == b[1].token_ids == b[2].token_ids  # same seed, same prompt: same tokens (as vLLM)
    assert a.token_ids != c.token_ids


def test_stop_strings_cut_the_text_and_max_tokens_bounds_the_output(server):
    item = {"messages": chat("Detect all objects.")}
    free = infer(server, [item], temperature=0, max_tokens=10).outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop = free.text[len(free.text) // 2:][:2] or free.text[:1]
    cut = infer(server, [item], temperature=0, max_tokens=10, stop=[stop]).outputs[0]
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)] and len(cut.token_ids) <= 10


def test_metrics_expose_requests_tokens_inflight_admission_sync_and_ver(server):
    infer(server, [{"prompt_token_ids": [1, 2, 3]}], temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    for key in ("rollout_requests_total", "rollout_items_total", "rollout_generated_tokens_total",
                "rollout_prompt_tokens_total", "rollout_tokens_per_second", "rollout_inflight",
                "rollout_admission_waiting", "rollout_admission_wait_seconds_count", "rollout_fence_reruns", "rollout_fence_spared",
                'rollout_sync_seconds_count{phase="fence"}', 'rollout_sync_seconds_count{phase="commit"}',
                'rollout_syncs_total{outcome="committed"}', "rollout_ver 0.0", "rollout_infer_seconds_bucket"):
        assert key in text, key
    assert 'rollout_requests_total{code="200",route="/infer"}' in text
    generated = next(line for line in text.splitlines() if line.startswith("rollout_generated_tokens_total"))
    assert float(generated.split()[-1]) > 0


def test_a_config_error_exits_with_code_2_naming_the_key_before_binding_anything():
    r = subprocess.run([sys.executable, "-m", "rollout_server", "--config", str(REPO / "configs" / "demo_cpu.yaml"),
                        "rollout_server.prot=1"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "rollout_server.prot" in r.stderr and "rollout_server.port" in r.stderr  # "did you mean"


def test_a_server_bound_beyond_loopback_without_a_token_refuses_to_start_naming_the_key():
    r = subprocess.run([sys.executable, "-m", "rollout_server", "--config", str(REPO / "configs" / "demo_cpu.yaml"),
                        "rollout_server.host=0.0.0.0", f"rollout_server.port={free_port_block(1)}"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "rollout_server.auth_token" in r.stderr and "oc.env:TANDEM_SYNC_TOKEN" in r.stderr, r.stderr[-2000:]


def test_sigterm_stops_the_server_cleanly_with_exit_code_0(server):
    assert server.stop() == 0
    assert "Traceback" not in server.log_tail(200)


def test_the_vllm_engine_module_imports_without_vllm_and_selecting_it_exits_3_naming_the_fix(tmp_path):
    import importlib.util

    import rollout_server.engines.vllm.engine as vllm_engine  # must import where vLLM is absent

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert not vllm_engine.vllm_available()
    r = subprocess.run([sys.executable, "-m", "rollout_server", "--config", str(REPO / "configs" / "demo_cpu.yaml"),
                        "rollout_server.engine=vllm", f"rollout_server.port={free_port_block(1)}"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "vLLM is not installed" in r.stderr and "rollout_server.engine=hf" in r.stderr
