"""``data.min_pixels`` / ``data.max_pixels``: one image size for the learner's encoder, the rollout server and the
evaluator, checked at start and on every prompt (common/data/image_size.py).

The tiny models resize the synthetic 112-px images to 16 image tokens by their own preprocessor configs; with
``data.max_pixels`` at 56² (Qwen2.5-VL, sides a multiple of 28) or 64² (Qwen3-VL, 32) every process sees 4.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from actor.client import RolloutClient
from common.data import image_size
from common.detection.answer import canonical_order
from common.data.records import iter_jsonl
from common.config.load import ConfigError, load_config
from common.wire.http import HealthResponse, InferResponse
from common.detection.targets import channel_a_target
from common.packing.encode import Encoder, encoder_from_config
from tests.server_proc import REPO, rollout_server_process

CONFIG = REPO / "configs" / "demo_cpu.yaml"
#: family -> (fixture of its tiny model, data.max_pixels giving 2 x 2 merged patches of a 112-px image, side multiple)
FAMILIES = {"qwen2.5-vl": ("tiny_model_dir", 56 * 56, 28), "qwen3-vl": ("tiny_qwen3_model_dir", 64 * 64, 32)}
TIMEOUT = httpx.Timeout(120.0, connect=5.0)


def image_tokens(encoder: Encoder, ids) -> int:
    return int(np.sum(np.asarray(ids) == encoder.processor.image_token_id))


def expected_tokens(record, pixels: image_size.ImagePixels) -> int:
    """The Qwen-VL resize rule (transformers' own smart_resize), one token per multiple_of² block."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    f = pixels.multiple_of
    h, w = smart_resize(record.height, record.width, f, min_pixels=pixels.min_pixels, max_pixels=pixels.max_pixels)
    return (h // f) * (w // f)


def config(model_dir: Path, data_dir: Path, *overrides: str):
    return load_config(CONFIG, [f"model.path={model_dir}", f"data.train_jsonl={data_dir / 'train.jsonl'}",
                                f"data.image_root={data_dir}", "training.global_max_length=4096", *overrides])


@pytest.fixture(scope="module")
def record(synth_data_dir):
    """The largest training image (112 × 112 in the seed-0 set: 16 tokens at the tiny models' own size, 4 at 56²)."""
    return max(iter_jsonl(synth_data_dir / "train.jsonl"), key=lambda r: r.width * r.height)


# ------------------------------------------------------------------------------------------------ config


def test_bad_image_sizes_are_refused_at_load_naming_the_key_and_the_fix(tiny_model_dir, tiny_qwen3_model_dir,
                                                                        synth_data_dir):
    cases = [
        (tiny_model_dir, ["data.max_pixels=0"], "data.max_pixels = 0: must be ≥ 1"),
        (tiny_model_dir, ["data.min_pixels=-5"], "data.min_pixels = -5: must be ≥ 1"),
        (tiny_model_dir, ["data.min_pixels=5000", "data.max_pixels=4000"],
         "data.min_pixels = 5000: above data.max_pixels = 4000. Fix: set data.min_pixels ≤ data.max_pixels"),
        (tiny_model_dir, ["data.max_pixels=700"], "below one merged patch of"),  # 28 × 28 = 784
        (tiny_qwen3_model_dir, ["data.max_pixels=1000"], "(32 × 32 = 1024 px"),  # Qwen3-VL: 32 × 32
        (tiny_model_dir, ["data.max_pixels=2000"], "below the model's own min_pixels = 3136"),
        (tiny_model_dir, ["data.min_pixels=20000"], "above the model's own max_pixels = 12544"),
    ]
    for model_dir, overrides, expected in cases:
        with pytest.raises(ConfigError) as err:
            config(model_dir, synth_data_dir, *overrides)
        assert expected in str(err.value) and "Fix:" in str(err.value), (overrides, str(err.value))
    # every problem at once, with the others of the config
    with pytest.raises(ConfigError) as err:
        config(tiny_model_dir, synth_data_dir, "data.max_pixels=0", "data.min_pixels=0", "training.max_steps=-1")
    assert len(err.value.problems) == 3, err.value.problems
    ok = config(tiny_qwen3_model_dir, synth_data_dir, "data.max_pixels=1024", "data.min_pixels=1024")
    assert (ok.data.min_pixels, ok.data.max_pixels) == (1024, 1024)


def test_the_processor_refuses_a_size_the_model_cannot_take_even_without_the_config_check(tiny_model_dir):
    from common.data.processor import load_processor

    with pytest.raises(image_size.ImageSizeError, match=r"data\.max_pixels = 100: below one merged patch"):
        load_processor(tiny_model_dir, max_pixels=100)


# ------------------------------------------------------------------------------------------------ encoder


@pytest.mark.parametrize("family", FAMILIES)
def test_the_learners_encoded_sample_carries_fewer_image_tokens_with_a_smaller_max_pixels(family, request, record,
                                                                                          synth_data_dir):
    fixture, small, multiple = FAMILIES[family]
    model_dir = request.getfixturevalue(fixture)
    default = encoder_from_config(config(model_dir, synth_data_dir))
    smaller = encoder_from_config(config(model_dir, synth_data_dir, f"data.max_pixels={small}"))
    own = image_size.model_pixels(model_dir)
    assert default.image_pixels == own  # unset keys: the model's preprocessor_config.json, as before
    assert smaller.image_pixels == image_size.ImagePixels(own.min_pixels, small, multiple)
    assert expected_tokens(record, smaller.image_pixels) < expected_tokens(record, default.image_pixels)
    for enc in (default, smaller):
        tokens = expected_tokens(record, enc.image_pixels)
        target = channel_a_target(canonical_order(record.objects), enc.tokenizer, coord_ids=enc.coord_ids)
        seg = enc.encode(record, target, sample_id=record.id, channel="A", ver=0)
        assert image_tokens(enc, seg.input_ids) == tokens, family
        t, h, w = seg.image_grid_thw[0]
        patch = multiple // 2
        assert (h * patch) % multiple == 0 and (w * patch) % multiple == 0  # sides a multiple of patch × merge
        assert h * patch * w * patch <= enc.image_pixels.max_pixels
        assert seg.pixel_values.shape[0] == t * h * w


# ------------------------------------------------------------------------------------ server and evaluator


@pytest.fixture(scope="module")
def small_server(tiny_model_dir):
    """A real rollout server (hf engine) on loopback, given data.max_pixels = 56²."""
    with rollout_server_process(tiny_model_dir, [f"data.max_pixels={56 * 56}", "rollout_server.hf_max_batch=2"]) as srv:
        yield srv


def server_prompt(server, encoder: Encoder, record) -> list[int]:
    item = encoder.prompt_for_rollout(record, encoder.image_paths(record), item_id=record.id)
    body = {"items": [item.model_dump(mode="json", exclude_none=True)], "sampling": {"max_tokens": 2, "temperature": 0}}
    r = httpx.post(server.url + "/infer", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return InferResponse.model_validate_json(r.content).outputs[0].prompt_token_ids


@pytest.mark.slow
def test_the_server_and_the_encoder_see_the_same_smaller_image_tokens_and_the_checks_pass(small_server, record,
                                                                                          tiny_model_dir,
                                                                                          synth_data_dir):
    encoder = encoder_from_config(config(tiny_model_dir, synth_data_dir, f"data.max_pixels={56 * 56}"))
    health = HealthResponse.model_validate_json(httpx.get(small_server.url + "/health", timeout=TIMEOUT).content)
    assert health.engine_info["image_pixels"] == {"min_pixels": 56 * 56, "max_pixels": 56 * 56, "multiple_of": 28}
    ours = encoder.prompt(record, encoder.image_paths(record))["input_ids"]
    theirs = server_prompt(small_server, encoder, record)
    assert image_tokens(encoder, theirs) == image_tokens(encoder, ours) == expected_tokens(record, encoder.image_pixels)
    assert image_tokens(encoder, ours) < expected_tokens(record, image_size.model_pixels(tiny_model_dir))
    assert encoder.check_server_prompt(record.id, theirs, ours)  # the per-prompt check
    with RolloutClient([small_server.url], config_path=str(CONFIG)) as client:  # the actors' start check
        assert client.image_pixels_mismatch(encoder.image_pixels) is None


@pytest.mark.slow
def test_a_server_given_another_size_is_caught_at_start_and_per_prompt_with_the_fix(small_server, record,
                                                                                    tiny_model_dir, synth_data_dir,
                                                                                    caplog):
    encoder = Encoder(tiny_model_dir, 4096, image_root=str(synth_data_dir))  # the model's own size, not the server's
    with RolloutClient([small_server.url], config_path="my.yaml") as client:
        why = client.image_pixels_mismatch(encoder.image_pixels)
    assert why is not None and "max_pixels 3136" in why and "12544" in why, why
    assert "data.min_pixels / data.max_pixels" in why and "python -m rollout_server --config my.yaml" in why
    ours = encoder.prompt(record, encoder.image_paths(record))["input_ids"]
    with caplog.at_level(logging.ERROR, logger="common.packing.encode"):
        assert not encoder.check_server_prompt(record.id, server_prompt(small_server, encoder, record), ours)
    assert encoder.counters["prompt_mismatch"] == 1
    small = image_size.ImagePixels(56 * 56, 56 * 56, 28)
    assert (f"the server's prompt carries {expected_tokens(record, small)} image tokens, the encoder's "
            f"{expected_tokens(record, encoder.image_pixels)}") in caplog.text, caplog.text
    assert "data.min_pixels / data.max_pixels" in caplog.text


def evaluator(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run([sys.executable, "-m", "evaluator", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_the_evaluator_uses_the_configs_size_and_refuses_a_server_that_resizes_otherwise(small_server, tmp_path,
                                                                                         tiny_model_dir,
                                                                                         synth_data_dir):
    raw = yaml.safe_load(CONFIG.read_text())
    raw["data"]["max_pixels"] = 56 * 56
    small_cfg = tmp_path / "small.yaml"
    small_cfg.write_text(yaml.safe_dump(raw))
    common = ["--model", str(tiny_model_dir), "--data", str(synth_data_dir / "val.jsonl"), "--max-images", "2",
              "--max-new-tokens", "8", "--grid", "0"]

    # its own server, started with the config: resizes as the config says (recorded in report.json)
    proc = evaluator(*common, "--out", str(tmp_path / "own"), "--config", str(small_cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "own" / "report.json").read_text())
    assert report["image_size"]["data.max_pixels"] == 56 * 56 and report["image_size"]["data.min_pixels"] is None
    assert report["image_size"]["served"] == {"min_pixels": 3136, "max_pixels": 3136, "multiple_of": 28}

    # a running server with the same size: accepted
    proc = evaluator(*common, "--out", str(tmp_path / "url"), "--config", str(small_cfg), "--url", small_server.url)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "url" / "report.json").read_text())["image_size"]["served"]["max_pixels"] == 3136

    # the same server for a config without the key (the model's own 112² = 16 tokens): refused at start, with the fix
    proc = evaluator(*common, "--out", str(tmp_path / "other"), "--config", str(CONFIG), "--url", small_server.url)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "resizes images to min_pixels 3136, max_pixels 3136" in proc.stderr and "12544" in proc.stderr
    assert "data.min_pixels / data.max_pixels" in proc.stderr
    assert not (tmp_path / "other" / "report.json").exists()


def actor(cfg_overrides, client, tmp_path, model_dir, data_dir):
    from actor.loop import ActorLoop
    from tests.ports import free_port_block

    cfg = config(model_dir, data_dir, f"training.output_dir={tmp_path}", f"transport.base_port={free_port_block(2)}",
                 "actor.learner_wait_timeout_s=20", "actor.stop_timeout_s=30", "learner.nproc_per_node=1",
                 "training.pack_max_wait_s=0.3", "stage2_ab.channel_b.rollout_decode_batch_size=2",
                 "rollout_matching.decoding.max_new_tokens=16", *cfg_overrides)
    return ActorLoop(cfg, 0, 0, client=client, config_path="small.yaml")


@pytest.mark.slow
def test_an_actor_with_the_servers_size_passes_the_start_check_and_every_prompt_check(small_server, tmp_path,
                                                                                      tiny_model_dir, synth_data_dir):
    from actor.loop import EXIT_OK
    from tests.fake_learner import FakeLearnerRank

    with RolloutClient([small_server.url], config_path="small.yaml") as client:
        loop = actor([f"data.max_pixels={56 * 56}", "actor.max_samples=2"], client, tmp_path, tiny_model_dir,
                     synth_data_dir)
        with FakeLearnerRank(loop.cfg.transport, consume_every_s=0.05):
            assert loop.run() == EXIT_OK
    c = loop.counters()
    assert c["actor/prompt_mismatch"] == 0 and loop.encoder.counters["prompt_checked"] == 2, c


@pytest.mark.slow
def test_an_actor_whose_encoder_resizes_otherwise_exits_2_at_start_naming_the_fix(small_server, tmp_path, caplog,
                                                                                  tiny_model_dir, synth_data_dir):
    from actor.loop import EXIT_CONFIG
    from tests.fake_learner import FakeLearnerRank

    with RolloutClient([small_server.url], config_path="small.yaml") as client:
        loop = actor(["actor.max_samples=2"], client, tmp_path, tiny_model_dir, synth_data_dir)  # the model's size
        with FakeLearnerRank(loop.cfg.transport, consume_every_s=0.05), caplog.at_level(logging.ERROR):
            assert loop.run() == EXIT_CONFIG
    assert f"the rollout server at {small_server.url} resizes images to min_pixels 3136, max_pixels 3136" in caplog.text
    assert "python -m rollout_server --config small.yaml" in caplog.text
    assert loop.encoder.counters["prompt_checked"] == 0  # stopped before any rollout


def test_the_data_checker_counts_tokens_at_the_configured_size(tiny_model_dir, synth_data_dir, capsys):
    from common.data.cli import main

    args = ["stats", str(synth_data_dir / "val.jsonl"), "--config", str(CONFIG), f"model.path={tiny_model_dir}",
            f"data.image_root={synth_data_dir}"]
    lines = {}
    for extra in ([], [f"data.max_pixels={56 * 56}"]):
        assert main(args + extra) == 0
        out = capsys.readouterr().out
        lines[bool(extra)] = next(line for line in out.splitlines() if "tokens per sample" in line)
    low = {k: int(v.split("min ")[1].split(",")[0]) for k, v in lines.items()}
    assert low[True] < low[False], lines
