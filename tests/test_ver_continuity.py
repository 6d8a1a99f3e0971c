"""ver never goes back: the learner's sync commits ``max(server ver, learner ver) + 1`` (docs/architecture.md, Versions).

A real server process (hf engine) and the learner's own WeightSync on one process (world size 1).
"""

from __future__ import annotations

import httpx
import pytest

from common.config.load import load_config
from learner.distributed import Dist
from learner.weight_sync.boundary import WeightSync
from learner.weight_sync.http import HttpWeightSender
from tests.server_proc import REPO, rollout_server_process


def server_ver(url: str) -> int:
    return httpx.get(url + "/health", timeout=30).json()["ver"]


@pytest.fixture(scope="module")
def setup(tiny_model_dir, synth_data_dir):
    from transformers import AutoModelForImageTextToText

    with rollout_server_process(tiny_model_dir, []) as srv:
        cfg = load_config(REPO / "configs/demo_cpu.yaml", [
            f"model.path={tiny_model_dir}", f"rollout_matching.vllm.servers=[{{base_url: '{srv.url}'}}]",
            "weight_sync.timeout_s=60"])
        model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
        yield srv, WeightSync(cfg, Dist(backend="gloo")), model


def test_a_resumed_learner_ahead_of_a_restarted_server_continues_from_its_checkpoint_ver(setup):
    srv, sync, model = setup
    assert server_ver(srv.url) == 0  # a freshly (re)started server
    result = sync.run(model, step=40, ver=7)  # checkpoint ver 7
    assert result.ok and result.ver == 8 == server_ver(srv.url)


def test_a_learner_behind_the_server_continues_from_the_server_ver(setup):
    srv, sync, model = setup
    before = server_ver(srv.url)
    result = sync.run(model, step=41, ver=2)  # e.g. resumed from an old checkpoint
    assert result.ok and result.ver == before + 1 == server_ver(srv.url)


def test_a_plain_push_without_a_floor_advances_by_exactly_one(setup):
    srv, sync, model = setup
    before = server_ver(srv.url)
    from learner.weight_sync.served import named_weights

    report = HttpWeightSender(srv.url, timeout_s=60).push(named_weights(model), bucket_bytes=4 << 20)
    assert report.ver == before + 1 == server_ver(srv.url)
