"""A DoRA run with a frozen vision tower and per-group learning rates on 2 real gloo ranks (torchrun, the learner as
users start it), under DDP and under FSDP2.

DDP: N steps, stop, resume, M more == one uninterrupted N + M run, to the bit (losses, the adapter, the weights), and
the checkpoint holds the adapter beside a plain HF directory of the base weights. FSDP2: the loss curve follows
DDP's, the frozen base stays bit-identical in the sharded checkpoint, a resume from the FSDP2 checkpoint steps
exactly as the uninterrupted run, and the export writes the merged model and the adapter alone. The harness is
tests/test_learner_resume.py's (fake actors with the same B packs, no rollout server: every sync fails fast and
training goes on); the merged push from a sharded model is tests/test_sync_fsdp.py's ``adapter`` scenario.

Runs (same seed, same A data, same B packs; N + M steps, a checkpoint every N)::

    ddp        whole   N + M        the reference of both engines (one run: the DDP tests and the FSDP2 comparison)
    ddp_parts  N, resume, M         bit for bit against ddp whole
    fsdp       whole   N + M        the loss curve against ddp's (fp32 on CPU: the engines sum gradients in another
                                    order; loss rel 1e-5 per step, as tests/test_learner_fsdp.py)
    fsdp_parts N, resume, M         bit for bit against fsdp whole
"""

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
def setup(tmp_path_factory, tiny_model_dir, synth_data_dir):
    """(the module's folder, a private model copy, the B pack pool, ``config(name, parallel)``)."""
    tmp = tmp_path_factory.mktemp("recipe-resume")
    model, data = private_copy(tiny_model_dir, tmp / "model"), private_copy(synth_data_dir, tmp / "data")
    common = dict(model_dir=model, data_dir=data, **RECIPE,
                  stage2_ab={"channel_b": {"async": {"version_window": 2, "queue_limit": 4, "prefetch_target_packs": 2}}})

    def config(name: str, parallel: str):
        return write_config(tmp / f"{name}.yaml", output_dir=tmp / name,
                            learner={"pack_wait_s": 20.0, "parallel": parallel}, **common)

    return tmp, model, SegmentPool(model, data), config


def _whole_and_parts(setup, whole: str, parts: str, parallel: str) -> None:
    tmp, _, pool, config = setup
    whole_cfg, parts_cfg = config(whole, parallel), config(parts, parallel)
    train(whole_cfg, tmp / f"{whole}.log", pool, N + M, resume=False)
    train(parts_cfg, tmp / f"{parts}1.log", pool, N, resume=False)
    train(parts_cfg, tmp / f"{parts}2.log", pool, N + M, resume=True)


@pytest.fixture(scope="module")
def ddp(setup):
    _whole_and_parts(setup, "ddp", "ddp_parts", "ddp")
    tmp, model = setup[:2]
    return {"model": model, "whole": tmp / "ddp", "parts": tmp / "ddp_parts"}


@pytest.fixture(scope="module")
def runs(setup, ddp):
    """Both engines' runs: ``ddp`` (the whole DDP run above), ``fsdp`` and ``parts`` (FSDP2's whole and resumed)."""
    _whole_and_parts(setup, "fsdp", "fsdp_parts", "fsdp")
    tmp, model = setup[:2]
    return {"model": model, "ddp": ddp["whole"], "fsdp": tmp / "fsdp", "parts": tmp / "fsdp_parts"}


def _final(runs, name: str, step: int = N + M):
    return runs[name] / "checkpoints" / str(step)


def assert_resumed_as_whole(runs: dict, whole: str, parts: str) -> None:
    """``parts`` (N steps, resume, M steps) stepped exactly as ``whole`` (N + M): losses and the final adapter."""
    a_metrics, b_metrics = read_metrics(runs[whole]), read_metrics(runs[parts])
    assert [m["step"] for m in b_metrics] == list(range(N + M))
    assert [m["loss/total"] for m in b_metrics] == [m["loss/total"] for m in a_metrics], "losses differ after the resume"
    a = load_file(_final(runs, whole) / "adapter" / "adapter_model.safetensors")
    b = load_file(_final(runs, parts) / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first = load_file(_final(runs, parts, N) / "adapter" / "adapter_model.safetensors")
    assert any(not torch.equal(first[k], b[k]) for k in b), "the adapter did not train after the resume"


# ------------------------------------------------------------------------------------------------------- DDP


def test_the_resumed_adapter_run_steps_exactly_as_the_uninterrupted_one(ddp):
    assert_resumed_as_whole(ddp, "whole", "parts")


def test_the_checkpoint_holds_the_adapter_beside_the_untouched_base_weights(ddp):
    ckpt = _final(ddp, "whole")
    adapter = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["r"] == 4
    assert any("lora_magnitude_vector" in k for k in adapter) and not any(".visual.blocks." in k for k in adapter)
    from transformers import AutoModelForImageTextToText

    assert not any(".lora_" in k or "base_layer" in k for k in load_file(ckpt / "model" / "model.safetensors"))
    base = dict(AutoModelForImageTextToText.from_pretrained(ckpt / "model").named_parameters())
    original = dict(AutoModelForImageTextToText.from_pretrained(ddp["model"]).named_parameters())
    assert base.keys() == original.keys()
    assert all(torch.equal(base[k], original[k]) for k in original), "a base weight changed"


def test_each_group_logs_its_own_lr(ddp):
    m = read_metrics(ddp["whole"])[0]
    assert m["train/lr_merger"] == pytest.approx(3e-3) and m["train/lr_llm"] == pytest.approx(1e-3)
    assert "train/lr_vision" not in m, "the frozen vision tower has no parameter group"


def test_export_writes_the_merged_model_and_on_request_the_adapter_alone_as_peft_loads_it(ddp, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from learner.export import export

    ckpt = _final(ddp, "whole")
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


# ----------------------------------------------------------------------------------------------------- FSDP2


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
    assert_resumed_as_whole(runs, "fsdp", "parts")


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
