"""A DoRA adapter under FSDP2 on 2 real gloo ranks (torchrun, the learner as users start it), against the same
recipe under DDP: the loss curve follows DDP's, the frozen base stays bit-identical in the sharded checkpoint,
a resume from the FSDP2 checkpoint steps exactly as the uninterrupted run, and the export writes the merged model
and the adapter alone. The harness is tests/test_recipe_resume.py's (fake actors with the same B packs, no rollout
server: every sync fails fast and training goes on); the merged push from a sharded model is
tests/test_sync_fsdp.py's ``adapter`` scenario.

Runs (same seed, same A data, same B packs; N + M steps, a checkpoint every N)::

    ddp  whole   N + M
    fsdp whole   N + M        the loss curve against ddp's (fp32 on CPU: the engines sum gradients in another
                              order; loss rel 1e-5 per step, as tests/test_learner_fsdp.py)
    fsdp parts   N, resume, M  bit for bit against fsdp whole
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.test_learner_harness import SegmentPool, private_copy, read_metrics, write_config
from tests.test_learner_resume import train
from tests.test_recipe_resume import RECIPE

pytestmark = pytest.mark.slow

N, M = 2, 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, synth_data_dir):
    tmp = tmp_path_factory.mktemp("recipe-fsdp-adapter")
    model, data = private_copy(tiny_model_dir, tmp / "model"), private_copy(synth_data_dir, tmp / "data")
    pool = SegmentPool(model, data)
    common = dict(model_dir=model, data_dir=data, **RECIPE,
                  stage2_ab={"channel_b": {"async": {"version_window": 2, "queue_limit": 4,
                                                     "prefetch_target_packs": 2}}})
    paths = {}
    for name, parallel in (("ddp", "ddp"), ("fsdp", "fsdp"), ("parts", "fsdp")):
        paths[name] = write_config(tmp / f"{name}.yaml", output_dir=tmp / name,
                                   learner={"pack_wait_s": 20.0, "parallel": parallel}, **common)
    train(paths["ddp"], tmp / "ddp.log", pool, N + M, resume=False)
    train(paths["fsdp"], tmp / "fsdp.log", pool, N + M, resume=False)
    train(paths["parts"], tmp / "part1.log", pool, N, resume=False)
    train(paths["parts"], tmp / "part2.log", pool, N + M, resume=True)
    return {"model": model, **{name: tmp / name for name in paths}}


def _final(runs, name: str, step: int = N + M):
    return runs[name] / "checkpoints" / str(step)


def test_an_fsdp2_adapter_run_follows_the_ddp_adapter_runs_loss_curve(runs):
    ddp, fsdp = read_metrics(runs["ddp"]), read_metrics(runs["fsdp"])
    assert [m["step"] for m in fsdp] == list(range(N + M))
    kinds = [[m["stage2_ab/async/step_kind_b"] for m in run] for run in (ddp, fsdp)]
    assert kinds[0] == kinds[1] and 1 in kinds[0], "the same A/B sequence (B steps included) in both runs"
    for step, (a, b) in enumerate(zip(ddp, fsdp)):
        assert b["loss/total"] == pytest.approx(a["loss/total"], rel=1e-5), f"step {step}: ddp {a} vs fsdp {b}"
        assert (b["train/lr_merger"], b["train/lr_llm"]) == (a["train/lr_merger"], a["train/lr_llm"])
    assert "train/lr_vision" not in fsdp[0], "the frozen vision tower has no parameter group under FSDP2 either"
    assert json.loads((_final(runs, "fsdp") / "trainer_state.json").read_text())["parallel"] == "fsdp"


def test_the_resumed_fsdp2_adapter_run_steps_exactly_as_the_uninterrupted_one(runs):
    whole, parts = read_metrics(runs["fsdp"]), read_metrics(runs["parts"])
    assert [m["step"] for m in parts] == list(range(N + M))
    assert [m["loss/total"] for m in parts] == [m["loss/total"] for m in whole], "losses differ after the resume"
    a = load_file(_final(runs, "fsdp") / "adapter" / "adapter_model.safetensors")
    b = load_file(_final(runs, "parts") / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first = load_file(_final(runs, "parts", N) / "adapter" / "adapter_model.safetensors")
    assert any(not torch.equal(first[k], b[k]) for k in b), "the adapter did not train after the resume"


def _sharded_model(ckpt, model_dir):
    """The policy with the checkpoint's adapter injected and its dcp/ loaded (in one process, no ranks)."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    inject_adapter_in_model(LoraConfig.from_pretrained(str(ckpt / "adapter")), model)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=ckpt / "dcp", no_dist=True)
    model.load_state_dict(state["model"])
    return model


def test_fsdp2_keeps_every_base_weight_bit_identical_and_checkpoints_the_adapter_it_trained(runs):
    from peft import get_peft_model_state_dict
    from transformers import AutoModelForImageTextToText

    ckpt = _final(runs, "fsdp")
    assert not (ckpt / "model").exists() and (ckpt / "dcp").is_dir(), "an fsdp checkpoint is sharded"
    sharded = _sharded_model(ckpt, runs["model"])
    original = AutoModelForImageTextToText.from_pretrained(runs["model"]).state_dict()
    base = {k.replace(".base_layer.", "."): v for k, v in sharded.state_dict().items() if ".lora_" not in k}
    assert base.keys() == original.keys()
    changed = [k for k in original if not torch.equal(base[k], original[k])]
    assert not changed, f"{len(changed)} frozen base weight(s) changed under FSDP2, e.g. {changed[:3]}"
    adapter = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True and not any(".visual.blocks." in k for k in adapter)
    in_dcp = get_peft_model_state_dict(sharded)  # adapter/ is the gathered copy of what dcp/ holds
    assert {"base_model.model." + k for k in in_dcp} == adapter.keys()
    assert all(torch.equal(in_dcp[k], adapter["base_model.model." + k]) for k in in_dcp)
    ddp = load_file(_final(runs, "ddp") / "adapter" / "adapter_model.safetensors")
    assert ddp.keys() == adapter.keys()
    worst = max(float((ddp[k] - adapter[k]).abs().max()) for k in ddp)
    assert 0 < max(float(v.abs().max()) for k, v in adapter.items() if "lora_B" in k) and worst <= 1e-4, worst


def test_the_export_of_an_fsdp2_adapter_checkpoint_is_the_merged_model_and_on_request_the_adapter_alone(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from learner.export import export

    ckpt = _final(runs, "fsdp")
    merged_dir, adapter_dir = export(ckpt, tmp_path / "merged"), export(ckpt, tmp_path / "adapter", adapter_only=True)
    got = dict(AutoModelForImageTextToText.from_pretrained(merged_dir).named_parameters())  # loads without peft
    assert (merged_dir / "tokenizer_config.json").is_file()
    reference = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(runs["model"]),
                                          adapter_dir).merge_and_unload()  # peft's own merge of the base + adapter
    ref = dict(reference.named_parameters())
    assert got.keys() == ref.keys()
    worst = max(float((got[k] - ref[k]).detach().abs().max()) for k in got)
    assert worst <= 1e-6, f"the merged export differs from peft's merge by {worst}"
    ddp_dir = export(_final(runs, "ddp"), tmp_path / "ddp")
    ddp = dict(AutoModelForImageTextToText.from_pretrained(ddp_dir).named_parameters())
    drift = max(float((got[k] - ddp[k]).detach().abs().max()) for k in got)
    assert drift <= 1e-4, f"the fsdp and ddp runs' merged models differ by {drift}"
