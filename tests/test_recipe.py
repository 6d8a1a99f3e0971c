"""The training recipe on the real tiny Qwen2.5-VL: frozen module groups, per-group learning rates, peft adapters
(LoRA/DoRA) and the merged weights an adapter run syncs (learner/recipe.py), and their config rules."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from common.config.load import ConfigError, load_config
from common.packing.segment import Pack
from learner.loss import LossWeights, Normaliser, pack_loss
from learner.model import build_optimizer, clip_and_step, forward_rows, load_policy, pack_inputs
from learner.recipe import group_of, hf_name
from learner.weight_sync.served import named_weights
from tests.test_loss import image_segment

CPU = torch.device("cpu")
DEMO = "configs/demo_cpu.yaml"


def policy(path, freeze=(), adapter=None):
    torch.manual_seed(0)
    cfg = SimpleNamespace(path=str(path), dtype="float32", attn_implementation="sdpa", coord_tokens=True,
                          freeze=list(freeze), adapter=adapter)
    return load_policy(cfg, CPU)


def training(lr=1e-3, lr_groups=None, max_grad_norm=1.0):
    return SimpleNamespace(lr=lr, weight_decay=0.0, lr_groups=lr_groups, adamw_impl="foreach", warmup_steps=0,
                           max_steps=1000, min_lr_ratio=0.0, max_grad_norm=max_grad_norm)


def dora(**kw):
    return SimpleNamespace(**{"type": "dora", "rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": "all-linear",
                              "modules_to_save": [], "sync": "merged", **kw})


def train_steps(model, tokenizer, coord_ids, t, n: int = 2) -> torch.optim.Optimizer:
    """``n`` optimizer steps on one-image packs (every group gets a gradient)."""
    optimizer, scheduler = build_optimizer(model, t)
    for step in range(n):
        seg = image_segment(model, tokenizer, coord_ids, seed=step, n_images=1, n_text=20, n_boxes=1)
        inputs = pack_inputs(Pack(ver=0, channel="B", segments=[seg]).tensors(), "sdpa", torch.float32, CPU)
        terms = pack_loss(forward_rows(model, inputs), inputs.rows, torch.tensor(coord_ids),
                          Normaliser(ce_tokens=20, boxes=1), LossWeights())
        terms.backward.backward()
        clip_and_step(model, optimizer, scheduler, t.max_grad_norm)
    return optimizer


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------------------------- freeze, lr groups


def test_the_module_groups_follow_the_qwen_vl_names():
    assert group_of("model.visual.blocks.0.attn.qkv.weight") == "vision"
    assert group_of("model.visual.patch_embed.proj.weight") == "vision"
    assert group_of("model.visual.merger.mlp.0.weight") == "merger"
    assert group_of("model.visual.deepstack_merger_list.1.linear_fc1.weight") == "merger"  # Qwen3-VL
    assert group_of("model.language_model.layers.0.self_attn.q_proj.base_layer.weight") == "llm"
    assert group_of("lm_head.weight") == "llm"


def test_a_frozen_vision_tower_is_bit_identical_after_training_while_the_rest_moves(tiny_model_dir):
    model, tokenizer, coord_ids = policy(tiny_model_dir, freeze=["vision"])
    before = snapshot(model)
    optimizer = train_steps(model, tokenizer, coord_ids, training())
    after = snapshot(model)
    assert [g["name"] for g in optimizer.param_groups] == ["all"]  # no training.lr_groups: one group
    assert not any(p is q for p in optimizer.param_groups[0]["params"] for q in model.model.visual.blocks.parameters())
    by_group: dict[str, list[bool]] = {}
    for n in before:
        by_group.setdefault(group_of(n), []).append(torch.equal(before[n], after[n]))
    assert by_group["vision"] and all(by_group["vision"]), "a frozen vision weight changed"
    assert not all(by_group["merger"]) and not all(by_group["llm"]), "the trained groups did not move"


def test_each_parameter_group_takes_its_first_adamw_step_at_its_own_lr(tiny_model_dir):
    # AdamW's first step moves a parameter by lr · g / (|g| + eps) ≈ lr wherever |g| >> eps (weight decay 0).
    lrs = {"vision": 1e-4, "merger": 3e-3, "llm": 1e-3}
    groups = SimpleNamespace(**{g: SimpleNamespace(lr=lr, weight_decay=None) for g, lr in lrs.items()})
    model, tokenizer, coord_ids = policy(tiny_model_dir)
    before = snapshot(model)
    optimizer = train_steps(model, tokenizer, coord_ids, training(lr=5e-2, lr_groups=groups, max_grad_norm=0.0), n=1)
    assert {g["name"]: g["initial_lr"] for g in optimizer.param_groups} == lrs
    moved: dict[str, list[float]] = {g: [] for g in lrs}
    for n, p in model.named_parameters():
        step = (p.detach() - before[n]).abs()
        moved[group_of(n)] += step[step > 0].tolist()
    for g, lr in lrs.items():
        steps = torch.tensor(moved[g])
        assert steps.numel() > 100, g
        # most elements move by lr (tiny gradients, |g| ~ eps, move less; none moves more)
        assert float(steps.max()) <= lr * 1.001 and float(steps.median()) == pytest.approx(lr, rel=1e-3), g


def test_lr_groups_and_freeze_are_checked_at_load_naming_the_key_and_the_fix():
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["training.lr_groups.visoin.lr=1e-3"])
    assert "training.lr_groups.visoin" in str(err.value) and "did you mean training.lr_groups.vision" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["model.freeze=[vision]", "training.lr_groups.vision.lr=1e-3"])
    assert "training.lr_groups.vision" in str(err.value) and "remove training.lr_groups.vision" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["model.freeze=[vision,merger,llm]"])
    assert "nothing would train" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["model.freeze=[vit]"])
    assert "model.freeze[0]" in str(err.value) and "'vision', 'merger', 'llm'" in str(err.value)
    cfg = load_config(DEMO, ["model.freeze=[vision]", "training.lr_groups.merger.lr=1e-3"])
    assert cfg.model.freeze == ["vision"] and cfg.training.lr_groups.merger.lr == 1e-3


# --------------------------------------------------------------------------------------------- adapters


def test_adapter_keys_are_checked_at_load_and_unserved_modes_are_refused():
    cfg = load_config(DEMO, ["model.adapter.type=dora", "model.adapter.target_modules=[q_proj,v_proj]"])
    assert cfg.model.adapter.type == "dora" and cfg.model.adapter.target_modules == ["q_proj", "v_proj"]
    cfg = load_config(DEMO, ["model.adapter.type=dora", "learner.parallel=fsdp"])  # merged sync: FSDP2 takes it
    assert cfg.learner.parallel == "fsdp" and cfg.model.adapter.sync == "merged"
    cfg = load_config(DEMO, ["model.adapter.type=dora", "model.adapter.sync=adapter", "learner.parallel=fsdp"])
    assert cfg.learner.parallel == "fsdp" and cfg.model.adapter.sync == "adapter"  # a sharded adapter session
    for overrides, words in ((["model.adapter.type=lora", "model.adapter.sync=adapter", "rollout_server.engine=vllm",
                               "weight_sync.transport=nccl"], "set weight_sync.transport: http"),
                             (["model.adapter.type=lora", "model.adapter.rank=0"], "model.adapter.rank"),
                             (["model.adapter.rank=8"], "model.adapter.type")):
        with pytest.raises(ConfigError) as err:
            load_config(DEMO, overrides)
        assert words in str(err.value), (overrides, str(err.value))


def test_a_dora_adapter_trains_while_the_base_weights_stay_bit_identical(tiny_model_dir):
    model, tokenizer, coord_ids = policy(tiny_model_dir, freeze=["vision"], adapter=dora())
    before = snapshot(model)
    train_steps(model, tokenizer, coord_ids, training())
    after = snapshot(model)
    lora = [n for n in before if ".lora_" in n]
    assert lora and not any(".visual.blocks." in n for n in lora), "frozen groups get no adapter"
    assert any(not torch.equal(before[n], after[n]) for n in lora if "lora_B" in n)
    assert all(torch.equal(before[n], after[n]) for n in before if ".lora_" not in n), "a base weight changed"


def test_merged_weights_equal_peft_merge_under_the_served_names_and_leave_training_weights_alone(tiny_model_dir):
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForImageTextToText

    served_names = {n for n, _ in AutoModelForImageTextToText.from_pretrained(tiny_model_dir).named_parameters()}
    model, tokenizer, coord_ids = policy(tiny_model_dir, adapter=dora(target_modules=["q_proj", "down_proj", "qkv"]))
    train_steps(model, tokenizer, coord_ids, training(lr=1e-2))
    before = snapshot(model)
    merged = dict(named_weights(model))
    assert set(merged) == served_names
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters()), "merging touched the training weights"
    reference = copy.deepcopy(model)  # peft's own merge, in place on a copy
    for m in reference.modules():
        if isinstance(m, LoraLayer):
            m.merge(safe_merge=True)
    expected = {hf_name(n): p for n, p in reference.named_parameters() if ".lora_" not in n}
    assert all(torch.equal(merged[n], expected[n]) for n in served_names)
    base = {hf_name(n): before[n] for n in before if ".lora_" not in n}  # the base weights, by served name
    changed = [n for n in served_names if not torch.equal(merged[n], base[n])]
    assert changed and all(n.endswith("weight") and any(k in n for k in ("q_proj", "down_proj", "qkv"))
                           for n in changed)


# --------------------------------------------------------------------------------------------- merged sync


@pytest.mark.slow
def test_a_merged_sync_lands_weights_whose_served_digest_equals_the_learners_merged_weights(tiny_model_dir):
    """A real hf server on loopback; the learner's sync source (named_weights) of a trained DoRA policy."""
    from common.weight_sync import weights as W
    from learner.weight_sync.base import cast_stream, plan
    from learner.weight_sync.http import HttpWeightSender
    from tests.server_proc import rollout_server_process

    token = "recipe-token"
    model, tokenizer, coord_ids = policy(tiny_model_dir, freeze=["vision"], adapter=dora())
    train_steps(model, tokenizer, coord_ids, training(lr=1e-2))
    merged = dict(named_weights(model))
    with rollout_server_process(tiny_model_dir, [f"rollout_server.auth_token={token}"]) as srv:
        client = HttpWeightSender(srv.url, auth_token=token, timeout_s=60, client_id="recipe-test")
        try:
            first = served_digest(srv, token)
            report = client.push(named_weights(model), bucket_bytes=1 << 20)
            session = client.open()  # for the manifest the push planned against
            session.abort("only the manifest was wanted")
        finally:
            client.close()
        after = served_digest(srv, token)
    local = W.exact_digest(cast_stream(session.info, plan(session.info, merged.items())))
    assert report.ver == after.ver == first.ver + 1
    assert after.digests[0] == local != first.digests[0]
    assert report.bytes == sum(t.numel() * t.element_size() for t in merged.values()), "merged sync = full weights"


def served_digest(srv, token):
    """tests/test_weights_digest.py's served_digest with this test's token."""
    import httpx

    from common.weight_sync.messages import SyncDigestResponse

    r = httpx.get(srv.url + "/sync/digest", headers={"Authorization": f"Bearer {token}"}, timeout=60)
    assert r.status_code == 200, r.text
    return SyncDigestResponse.model_validate_json(r.content)


def test_modules_to_save_train_whole_and_sync_under_their_served_names(tiny_model_dir):
    from learner.recipe import base_state

    model, tokenizer, coord_ids = policy(tiny_model_dir, adapter=dora(type="lora", target_modules=["q_proj"],
                                                                      modules_to_save=["merger"]))
    served = dict(named_weights(model))
    before = {n: t.clone() for n, t in served.items()}
    train_steps(model, tokenizer, coord_ids, training(lr=1e-2))
    after = dict(named_weights(model))
    assert after.keys() == before.keys()
    merger = [n for n in after if ".visual.merger." in n]
    assert merger and all(not torch.equal(after[n], before[n]) for n in merger if n.endswith("weight")), \
        "the trained copy of the merger is what syncs"
    kept = base_state(model)  # a checkpoint's model/: the merger as loaded; the trained copy lives in adapter/
    assert all(torch.equal(kept[n], before[n]) for n in merger)
