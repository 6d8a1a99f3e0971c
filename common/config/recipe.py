"""The training recipe's model keys: frozen modules (``model.freeze``), adapters (``model.adapter``) and
per-module learning rates (``training.lr_groups``).

Split from ``common/config/schema.py`` (whose ``ModelConfig`` and ``TrainingConfig`` hold these fields);
:func:`check_recipe_rules` holds their cross-field rules, called by :func:`common.config.load._check_rules`.

The three module groups of a Qwen-VL policy (``learner/recipe.py`` maps parameter names onto them)::

    vision   model.visual.*, the vision tower, minus its merger(s)
    merger   model.visual.merger.* (+ model.visual.deepstack_merger_list.* on Qwen3-VL): vision -> LLM
    llm      model.language_model.* and lm_head.*

What this module does not know: torch, peft, or parameter names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from common.config.fields import doc

#: Module groups ``model.freeze`` and ``training.lr_groups`` name (order: learner/recipe.py's group order).
GROUPS = ("vision", "merger", "llm")


@dataclass
class AdapterConfig:
    """A peft LoRA/DoRA adapter trained instead of the full weights (``model.adapter``; null = full fine-tuning)."""

    type: Literal["lora", "dora"] = doc("lora, or dora (LoRA plus a learned per-row magnitude; peft use_dora).")
    rank: int = doc("LoRA rank r of every adapted layer.", 8)
    alpha: float = doc("LoRA alpha: the update is scaled by alpha / rank.", 16.0)
    dropout: float = doc("Dropout on the adapter's input (peft lora_dropout); 0 = none.", 0.0)
    target_modules: str | list[str] = doc(
        "Linear layers that get an adapter: all-linear (every nn.Linear but the LM head, the vision tower's "
        "included) or a list of module-name suffixes / a regex (peft target_modules). Keep the vision tower out "
        "with model.freeze: [vision] plus a list that names only LLM layers, e.g. [q_proj, k_proj, v_proj, o_proj].",
        "all-linear")
    modules_to_save: list[str] = doc(
        "Modules trained in full beside the adapter (peft modules_to_save), e.g. [lm_head] to learn new coord-token "
        "rows; they are synced and checkpointed whole.", factory=list)
    sync: Literal["merged", "adapter"] = doc(
        "How the weights reach the rollout server. merged: the learner computes W + ΔW (DoRA: with its magnitude) "
        "for every adapted layer, leaving its training weights as they are, and pushes the changed weights under "
        "the HF names (the adapted layers' merged weights and modules_to_save; frozen weights stay on the server). "
        "adapter: only the adapter's tensors (LoRA A/B, DoRA magnitudes) travel, plus modules_to_save, and the "
        "server merges them into its kept base weights with peft's merge (the vllm engine: over "
        "weight_sync.transport: http only, merged on the server's CPU). Under learner.parallel: fsdp both work: merged "
        "gathers each adapted layer and merges on rank 0; adapter gathers the adapter's tensors to send them and "
        "each adapted layer's parts for the fingerprint only. Cost (3b, DoRA r16, vLLM on H200s): merged over nccl "
        "0.09 s a push, adapter 17-23 s (the server's CPU merge): prefer merged on one node; adapter sends ~80x fewer "
        "bytes, for slow wires. docs/models.md, Adapters, has the bytes and seconds of each.",
        "merged")


@dataclass
class LrGroup:
    """One module group's optimizer settings; a null key takes training.lr / training.weight_decay."""

    lr: float | None = doc("Peak learning rate of the group (the schedule scales it as it scales training.lr).", None)
    weight_decay: float | None = doc("AdamW weight decay of the group.", None)


@dataclass
class LrGroups:
    """Per-module-group AdamW settings (``training.lr_groups``); a group left out trains at training.lr."""

    vision: LrGroup | None = doc("The vision tower minus its merger (model.visual.*).", None)
    merger: LrGroup | None = doc("The vision-to-LLM merger(s) (model.visual.merger.*, deepstack mergers).", None)
    llm: LrGroup | None = doc("The language model and the LM head.", None)


def check_recipe_rules(cfg: Any, problems: Any) -> None:
    """Fail-fast rules of ``model.freeze``, ``model.adapter`` and ``training.lr_groups``."""
    m, t = cfg.model, cfg.training
    freeze = list(m.freeze or [])
    if len(set(freeze)) != len(freeze):
        problems.add("model.freeze", freeze, "names a group twice", "list each of vision, merger, llm at most once")
    for name in GROUPS:
        group = getattr(t.lr_groups, name, None) if t.lr_groups is not None else None
        if group is None:
            continue
        if name in freeze:
            problems.add(f"training.lr_groups.{name}", "...", f"the {name} group is frozen (model.freeze)",
                         f"remove training.lr_groups.{name}, or {name} from model.freeze")
        if isinstance(group.lr, float) and group.lr < 0:
            problems.add(f"training.lr_groups.{name}.lr", group.lr, "must be ≥ 0", "use e.g. 2.0e-5")
        if isinstance(group.weight_decay, float) and group.weight_decay < 0:
            problems.add(f"training.lr_groups.{name}.weight_decay", group.weight_decay, "must be ≥ 0", "use e.g. 0.0")
    if set(freeze) >= set(GROUPS) and m.adapter is None:
        problems.add("model.freeze", freeze, "every group is frozen: nothing would train",
                     "leave a group out of model.freeze, or add model.adapter")
    a = m.adapter
    if a is None:
        return
    if isinstance(a.rank, int) and a.rank < 1:
        problems.add("model.adapter.rank", a.rank, "must be ≥ 1", "use e.g. 8 or 16")
    if isinstance(a.dropout, float) and not 0 <= a.dropout < 1:
        problems.add("model.adapter.dropout", a.dropout, "outside [0, 1)", "use 0.0 (the origin's) or e.g. 0.05")
    if isinstance(a.target_modules, str) and a.target_modules != "all-linear" and not a.target_modules.strip():
        problems.add("model.adapter.target_modules", a.target_modules, "empty", "use all-linear or a list of names")
    if a.sync == "adapter" and cfg.rollout_server.engine == "vllm" and cfg.weight_sync.transport != "http":
        problems.add("weight_sync.transport", cfg.weight_sync.transport, "the vllm engine takes an adapter-only sync "
                     "over http only (the adapter's tensors are staged on the server, merged on its CPU at commit and "
                     "loaded with the other staged tensors)",
                     "set weight_sync.transport: http for model.adapter.sync: adapter, or model.adapter.sync: merged "
                     "to push merged weights over nccl/ipc")
