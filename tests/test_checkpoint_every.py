"""``training.gradient_checkpointing_every`` (issue 31): which layers recompute, that the packed loss and its
gradients do not depend on it, the config rule, and the launcher's memory estimate. The speed and peak memory
per setting are GPU figures (docs/benchmarks.md section 20)."""

from __future__ import annotations

import pytest
import torch

from common.config.load import ConfigError, load_config
from launcher import gpu_budget as G
from learner.blocks import checkpointed, set_checkpointing
from tests.conftest import REPO_ROOT
from tests.test_gpu_budget import ONE_GPU, PRESET_05B
from tests.test_varlen_attention import loss_and_grads, norm_of, policy, segments


def layer_flags(model) -> list[bool]:
    flags = checkpointed(model)
    assert len(flags) == len(model.model.visual.blocks) + len(model.model.language_model.layers)
    return flags


def test_every_nth_layer_recomputes_and_the_packed_loss_and_gradients_do_not_change(tiny_model_dir):
    model, tokenizer, coord_ids = policy(tiny_model_dir, "sdpa")
    segs = segments(model, tokenizer, coord_ids)
    norm = norm_of(segs)
    results = {}
    for every in (0, 1, 2, 3):
        n = set_checkpointing(model, every)
        flags = layer_flags(model)
        assert n == sum(flags)
        assert flags == [bool(every) and i % every == 0 for i in range(len(flags))], (every, flags)
        model.zero_grad(set_to_none=True)
        results[every] = loss_and_grads(model, coord_ids, segs, "sdpa", norm)
    assert layer_flags(model).count(True) == -(-len(layer_flags(model)) // 3)
    _, terms0, grads0 = results[0]
    for every in (1, 2, 3):
        _, terms, grads = results[every]
        assert terms.total == pytest.approx(terms0.total, rel=1e-6)
        for name, g in grads0.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=f"every {every}: {name}")


def test_a_negative_count_is_refused():
    with pytest.raises(ValueError, match="gradient_checkpointing_every"):
        set_checkpointing(torch.nn.Linear(2, 2), -1)


def test_the_config_rule_names_the_key_and_the_fix():
    with pytest.raises(ConfigError) as err:
        load_config(REPO_ROOT / "configs/demo_cpu.yaml", ["training.gradient_checkpointing_every=0"])
    assert "training.gradient_checkpointing_every" in str(err.value)
    assert "gradient_checkpointing: false" in str(err.value)


def test_the_memory_estimate_counts_the_layers_that_keep_their_activations():
    def act(*overrides: str) -> int:
        return G.learner_need(load_config(ONE_GPU, list(overrides)), PRESET_05B)["activations"]

    none, every1 = act(), act("training.gradient_checkpointing=true")
    every2 = act("training.gradient_checkpointing=true", "training.gradient_checkpointing_every=2")
    every_all = act("training.gradient_checkpointing=true", f"training.gradient_checkpointing_every={10 ** 6}")
    assert every1 < every2 < none
    assert every2 == pytest.approx((none + every1) / 2, rel=0.1), "half the layers keep their activations"
    # only vision block 0 recomputes, and last, once the rest is freed: it saves its activations less its input
    assert every_all < none and every_all == pytest.approx(none, rel=0.1)
    assert act("training.gradient_checkpointing_every=2") == none, "without gradient_checkpointing it counts nothing"


def test_a_refusal_with_every_nth_layer_leads_with_checkpointing_every_layer_when_that_fits():
    cfg = load_config(ONE_GPU, ["training.gradient_checkpointing=true", "training.gradient_checkpointing_every=4",
                                "training.global_max_length=16384"])
    need = sum(G.learner_need(cfg, PRESET_05B).values())
    every1 = sum(G.learner_need(load_config(ONE_GPU, ["training.gradient_checkpointing=true",
                                                      "training.global_max_length=16384"]), PRESET_05B).values())
    total = int((need + every1) / 2 / (1 - cfg.rollout_server.gpu_memory_utilization))  # between the two needs
    why = G.refusal(cfg, PRESET_05B, total, [0])
    assert why is not None, (need, every1, total)
    fixes = why.split("Change one of:")[1].strip().splitlines()
    assert fixes[0].strip().startswith("training.gradient_checkpointing_every: 1 (now 4)"), fixes[0]
    assert "this alone is enough" in fixes[0]
