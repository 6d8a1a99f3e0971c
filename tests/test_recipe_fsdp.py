"""Frozen modules and learning-rate groups under FSDP2 on 2 real gloo ranks: the rank script is
tests/test_learner_fsdp.py's (the real Learner, async steps, full weights gathered to rank 0), with the recipe
passed as overrides. FSDP2 shards frozen and trained parameters alike; only the trained ones get AdamW state."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from learner.recipe import group_of

pytestmark = pytest.mark.slow
STEPS = 3


def test_fsdp_keeps_a_frozen_vision_tower_bit_identical_and_steps_each_group_at_its_lr(tmp_path, tiny_model_dir,
                                                                                       synth_data_dir):
    from tests.test_learner_harness import Proc, private_copy, read_metrics, write_config

    model, data = private_copy(tiny_model_dir, tmp_path / "model"), private_copy(synth_data_dir, tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    cfg = write_config(tmp_path / "cfg.yaml", model_dir=model, data_dir=data, output_dir=out / "run", nproc=2,
                       model={"freeze": ["vision"]},
                       training={"max_steps": STEPS, "save_final": False, "gradient_accumulation_steps": 1,
                                 "trace_micro_steps": False, "lr_groups": {"merger": {"lr": 3e-3}, "llm": {"lr": 1e-3}}},
                       learner={"parallel": "fsdp"}, stage2_ab={"schedule": {"b_ratio": 0.0}})
    script = Path(__file__).resolve().parent / "test_learner_fsdp.py"
    proc = Proc([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
                 str(cfg), str(STEPS), str(out)], out / "learner.log", env={"OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 150
    try:
        rc = proc.wait(max(1.0, deadline - time.monotonic()), "the 2-rank fsdp learner with a frozen vision tower")
    finally:
        proc.stop()
    for r in (0, 1):
        result = json.loads((out / f"rank{r}.json").read_text())
        assert "error" not in result, result["error"]
        assert result["steps"] == STEPS and result["fsdp_params"] > 0, result
    assert rc == 0, proc.tail()
    trained = torch.load(out / "weights.pt")
    from transformers import AutoModelForImageTextToText

    original = dict(AutoModelForImageTextToText.from_pretrained(model).named_parameters())  # the file's legacy names mapped
    vision = [n for n in trained if group_of(n) == "vision"]
    assert vision and all(torch.equal(trained[n], original[n]) for n in vision), "a frozen vision weight changed"
    for g in ("merger", "llm"):
        assert any(not torch.equal(trained[n], original[n]) for n in trained if group_of(n) == g), f"{g} did not train"
    first = read_metrics(out / "run")[0]
    assert (first["train/lr_merger"], first["train/lr_llm"]) == pytest.approx((3e-3, 1e-3), rel=0.5)
    assert first["train/lr_merger"] / first["train/lr_llm"] == pytest.approx(3.0)
