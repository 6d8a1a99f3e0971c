"""The one-process modes: ``step`` against a real rollout server, and ``step`` refused under DDP."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from common.config.load import ConfigError, load_config
from learner.train import run as learner_run
from tests.test_learner_harness import (
    http_text,
    launch_learner,
    private_copy,
    read_metrics,
    read_traces,
    start_server,
    write_config,
)

GUIDANCE = "use stage2_ab.channel_b.mode: async"


@pytest.mark.slow
def test_step_mode_makes_one_optimizer_update_per_step_whatever_the_pack_count(tmp_path, tiny_model_dir, synth_data_dir):
    model, data = private_copy(tiny_model_dir, tmp_path / "model"), private_copy(synth_data_dir, tmp_path / "data")
    steps, rollouts, lr = 2, 3, 1e-3
    cfg_path = write_config(
        tmp_path / "cfg.yaml", model_dir=model, data_dir=data, output_dir=tmp_path / "run", nproc=1,
        training={"max_steps": steps, "gradient_accumulation_steps": 2, "global_max_length": 1024, "lr": lr,
                  "packing_min_fill_ratio": 0.7},
        stage2_ab={"schedule": {"b_ratio": 1.0},
                   "channel_b": {"mode": "step", "rollouts_per_step": rollouts, "rollout_decode_batch_size": 2,
                                 "enable_pipeline": True}},
    )
    server, url = start_server(cfg_path, tmp_path / "server.log")
    learner = launch_learner(cfg_path, tmp_path / "learner.log", nproc=1)
    try:
        rc = learner.wait(240, "the step-mode learner")
        items = re.search(r"^rollout_items_total (\S+)", http_text(f"{url}/metrics"), re.M)
    finally:
        learner.stop()
        server.stop()
    assert rc == 0, f"learner exited with {rc}:\n{learner.tail()}"
    metrics = read_metrics(tmp_path / "run")
    assert [m["stage2_ab/async/step_kind_b"] for m in metrics] == [1] * steps
    forwards = [m["learner/forwards"][0] for m in metrics]
    segments = [m["packing/segments"] for m in metrics]
    assert segments == [rollouts] * steps, "every rollout of the step became a segment and was trained"
    assert all(1 <= f <= rollouts for f in forwards) and sum(forwards) > steps, (
        f"packs per step {forwards}: a variable number, more than one in some step"
    )
    assert [m["learner/optimizer_updates_total"] for m in metrics] == list(range(1, steps + 1))
    # Each pack's inputs are timed as they are built; one rank: the timed parts and time/other add up to the step.
    from learner.metrics import STEP_TIME_KEYS

    for m in metrics:
        assert m["time/prepare_inputs"] > 0 and m["time/other"] >= 0, m["step"]
        assert sum(m[k] for k in STEP_TIME_KEYS) == pytest.approx(m["time/step"], rel=1e-9, abs=1e-12), m["step"]
    # The optimizer itself counted one step per optimizer step: AdamW's per-parameter step counter.
    state = torch.load(tmp_path / "run" / "checkpoints" / str(steps) / "optimizer.pt")["state"]
    assert {float(s["step"]) for s in state.values()} == {float(steps)}
    # ... and so did the LR schedule (cosine from lr to 0 over max_steps, no warmup)
    for s, m in enumerate(metrics):
        assert m["train/lr"] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * (s + 1) / steps)), abs=1e-12)
    assert items and float(items.group(1)) == steps * rollouts, "rollouts_per_step raw rollouts per step, no more"
    traces = read_traces(tmp_path / "run", 1)
    assert len(traces) == sum(forwards) and all(t["forwards"] == t["backwards"] == 1 for t in traces)


def test_step_mode_under_two_ranks_fails_fast_with_the_guidance(tmp_path, tiny_model_dir, synth_data_dir):
    cfg_path = write_config(tmp_path / "cfg.yaml", model_dir=tiny_model_dir, data_dir=synth_data_dir,
                            output_dir=tmp_path / "run", stage2_ab={"channel_b": {"mode": "step"}})
    proc = launch_learner(cfg_path, tmp_path / "learner.log", nproc=2)
    rc = proc.wait(120, "torchrun with mode step")
    proc.stop()
    log = proc.tail(200)
    assert rc != 0 and GUIDANCE in log and "world_size is 2" in log, log
    assert not (tmp_path / "run").exists(), "nothing ran: the config was refused before any training"


def test_the_runtime_check_refuses_step_mode_under_ddp_even_past_the_config(tmp_path, tiny_model_dir, synth_data_dir):
    cfg_path = write_config(tmp_path / "cfg.yaml", model_dir=tiny_model_dir, data_dir=synth_data_dir,
                            output_dir=tmp_path / "run", nproc=1, stage2_ab={"channel_b": {"mode": "step"}})
    cfg = load_config(cfg_path, world_size=1)  # e.g. a config validated for one process, launched on two
    with pytest.raises(ConfigError, match=re.escape(GUIDANCE)):
        learner_run(cfg, SimpleNamespace(world_size=2, rank=0, is_main=True))
