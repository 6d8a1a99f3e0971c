"""A DoRA run with a frozen vision tower and per-group learning rates on 2 real gloo ranks (DDP): N steps, stop,
resume, M more == one uninterrupted N + M run, to the bit (losses, the adapter, the weights), and the checkpoint
holds the adapter beside a plain HF directory of the base weights. The harness is tests/test_learner_resume.py's
(fake actors, no rollout server: every sync fails fast and training goes on)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.test_learner_harness import SegmentPool, private_copy, read_metrics, write_config
from tests.test_learner_resume import train

pytestmark = pytest.mark.slow

N, M = 2, 2
RECIPE = {"model": {"freeze": ["vision"], "adapter": {"type": "dora", "rank": 4, "alpha": 8,
                                                       "target_modules": "all-linear"}},
          # min_lr_ratio 1: a constant lr, so part 1 (max_steps N) runs the same schedule as the whole run (N + M)
          "training": {"gradient_accumulation_steps": 1, "save_every_steps": N, "min_lr_ratio": 1.0,
                       "lr_groups": {"merger": {"lr": 3e-3}, "llm": {"lr": 1e-3}}}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, synth_data_dir):
    tmp = tmp_path_factory.mktemp("recipe-resume")
    model, data = private_copy(tiny_model_dir, tmp / "model"), private_copy(synth_data_dir, tmp / "data")
    pool = SegmentPool(model, data)
    common = dict(model_dir=model, data_dir=data, **RECIPE,
                  stage2_ab={"channel_b": {"async": {"version_window": 2, "queue_limit": 4, "prefetch_target_packs": 2}}},
                  learner={"pack_wait_s": 20.0})
    whole = write_config(tmp / "whole.yaml", output_dir=tmp / "whole", **common)
    parts = write_config(tmp / "parts.yaml", output_dir=tmp / "parts", **common)
    train(whole, tmp / "whole.log", pool, N + M, resume=False)
    train(parts, tmp / "part1.log", pool, N, resume=False)
    train(parts, tmp / "part2.log", pool, N + M, resume=True)
    return {"model": model, "whole": tmp / "whole", "parts": tmp / "parts"}


def test_the_resumed_adapter_run_steps_exactly_as_the_uninterrupted_one(runs):
    whole, parts = read_metrics(runs["whole"]), read_metrics(runs["parts"])
    assert [m["step"] for m in parts] == list(range(N + M))
    assert [m["loss/total"] for m in parts] == [m["loss/total"] for m in whole], "losses differ after the resume"
    a = load_file(runs["whole"] / "checkpoints" / str(N + M) / "adapter" / "adapter_model.safetensors")
    b = load_file(runs["parts"] / "checkpoints" / str(N + M) / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first = load_file(runs["parts"] / "checkpoints" / str(N) / "adapter" / "adapter_model.safetensors")
    assert any(not torch.equal(first[k], b[k]) for k in b), "the adapter did not train after the resume"


def test_the_checkpoint_holds_the_adapter_beside_the_untouched_base_weights(runs):
    ckpt = runs["whole"] / "checkpoints" / str(N + M)
    adapter = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["r"] == 4
    assert any("lora_magnitude_vector" in k for k in adapter) and not any(".visual.blocks." in k for k in adapter)
    from transformers import AutoModelForImageTextToText

    assert not any(".lora_" in k or "base_layer" in k for k in load_file(ckpt / "model" / "model.safetensors"))
    base = dict(AutoModelForImageTextToText.from_pretrained(ckpt / "model").named_parameters())
    original = dict(AutoModelForImageTextToText.from_pretrained(runs["model"]).named_parameters())
    assert base.keys() == original.keys()
    assert all(torch.equal(base[k], original[k]) for k in original), "a base weight changed"


def test_each_group_logs_its_own_lr(runs):
    m = read_metrics(runs["whole"])[0]
    assert m["train/lr_merger"] == pytest.approx(3e-3) and m["train/lr_llm"] == pytest.approx(1e-3)
    assert "train/lr_vision" not in m, "the frozen vision tower has no parameter group"


def test_export_writes_the_merged_model_and_on_request_the_adapter_alone_as_peft_loads_it(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from learner.export import export

    ckpt = runs["whole"] / "checkpoints" / str(N + M)
    merged_dir, adapter_dir = export(ckpt, tmp_path / "merged"), export(ckpt, tmp_path / "adapter", adapter_only=True)
    merged = AutoModelForImageTextToText.from_pretrained(merged_dir)  # no peft needed to load it
    assert (merged_dir / "tokenizer_config.json").is_file()
    # peft's own path: the base + the adapter-only export, merged by peft
    reference = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(ckpt / "model"),
                                          adapter_dir).merge_and_unload()
    ref = dict(reference.named_parameters())
    got = dict(merged.named_parameters())
    assert got.keys() == ref.keys()
    worst = max(float((got[k] - ref[k]).detach().abs().max()) for k in got)
    assert worst <= 1e-6, f"the merged export differs from peft's merge by {worst}"
    base = dict(AutoModelForImageTextToText.from_pretrained(ckpt / "model").named_parameters())
    assert any(not torch.equal(got[k], base[k]) for k in got), "the export holds no adapter update"
