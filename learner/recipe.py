"""The training recipe on the policy: module groups, frozen modules, peft adapters, per-group AdamW settings,
and the merged weights an adapter run syncs.

Groups by parameter name (HF names: common/model/groups.py; a peft adapter's own tensors live under the layer they
adapt, so they fall in that layer's group).

Adapters are injected in place (``peft.inject_adapter_in_model``), not wrapped in a ``PeftModel``: the policy
keeps its class, its ``model.visual`` / ``get_output_embeddings`` and the HF names of every base weight, so the
packed forward, DDP/FSDP2 wrapping and checkpoints see the same module tree with ``.base_layer`` and
``lora_*`` entries added. :func:`merged_weights` turns that tree back into the served model's names.

What this module does not know: ranks, the optimizer's schedule, or the wire.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from common.model.groups import GROUP_MODULE_REGEX, GROUP_ORDER, group_of  # noqa: F401  (group_of: re-exported)

log = logging.getLogger(__name__)


def apply_recipe(model: torch.nn.Module, model_cfg: Any) -> dict[str, int]:
    """Inject ``model.adapter`` (if any), then freeze ``model.freeze``'s groups; returns trainable parameter
    counts per group (logged). Call before DDP/FSDP2 wrap the model: both read ``requires_grad`` when wrapping."""
    freeze = set(getattr(model_cfg, "freeze", None) or ())
    adapter = getattr(model_cfg, "adapter", None)
    if adapter is not None:
        inject_adapter(model, adapter, freeze)
    for name, p in model.named_parameters():
        if group_of(name) in freeze:
            p.requires_grad_(False)
    counts = {g: 0 for g in GROUP_ORDER}
    for name, p in model.named_parameters():
        if p.requires_grad:
            counts[group_of(name)] += p.numel()
    if freeze or adapter is not None:
        log.info("trainable parameters by group %s (frozen: %s, adapter: %s)", counts, sorted(freeze) or "none",
                 adapter.type if adapter is not None else "none")
    return counts


def inject_adapter(model: torch.nn.Module, adapter: Any, freeze: set[str]) -> None:
    """peft LoRA/DoRA layers in place; every base weight frozen (peft's rule), ``modules_to_save`` trained whole.
    A frozen group's layers get no adapter (``exclude_modules``): they would train nothing and still cost a merge."""
    from peft import inject_adapter_in_model  # heavy: deferred

    targets = adapter.target_modules
    config = lora_config(adapter, freeze)
    inject_adapter_in_model(config, model)
    model._tandem_lora_config = config  # type: ignore[assignment]  # what save_adapter writes beside the tensors
    n = sum(1 for m in model.modules() if _is_lora_layer(m))
    if n == 0:
        raise ValueError(f"model.adapter.target_modules = {targets!r} matched no linear layer of "
                         f"{type(model).__name__}. Fix: use all-linear or names such as [q_proj, v_proj]")


def lora_config(adapter: Any, freeze: set[str]) -> Any:
    """peft's ``LoraConfig`` of ``model.adapter`` (a frozen group's layers excluded)."""
    from peft import LoraConfig

    targets = adapter.target_modules
    excluded = "|".join(GROUP_MODULE_REGEX[g] for g in sorted(freeze))
    return LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout,
                      target_modules=targets if isinstance(targets, str) else list(targets),
                      exclude_modules=f"^({excluded})$" if excluded else None,
                      modules_to_save=list(adapter.modules_to_save) or None,
                      use_dora=adapter.type == "dora", bias="none")


def _is_lora_layer(module: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def param_groups(model: torch.nn.Module, training: Any) -> list[dict[str, Any]]:
    """AdamW parameter groups. With ``training.lr_groups`` set: one per module group with trainable parameters,
    each with its own ``lr`` and ``weight_decay`` (its entry, else ``training.lr`` / ``training.weight_decay``)
    and its ``name`` (the metric ``train/lr_<name>``). Without: one group ``all`` at ``training.lr``, as before
    the groups existed, so an older run's ``optimizer.pt`` (one group) still resumes. The LR schedule scales every
    group's lr by the same factor."""
    settings = getattr(training, "lr_groups", None)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if settings is None or all(getattr(settings, g, None) is None for g in GROUP_ORDER[:-1]):
        return [{"params": [p for _, p in trainable], "lr": training.lr, "weight_decay": training.weight_decay,
                 "name": "all"}]
    by_group: dict[str, list[torch.nn.Parameter]] = {g: [] for g in GROUP_ORDER}
    for name, p in trainable:
        by_group[group_of(name)].append(p)
    groups = []
    for g in GROUP_ORDER:
        if not by_group[g]:
            continue
        own = getattr(settings, g, None) if settings is not None and g != "rest" else None
        lr = own.lr if own is not None and own.lr is not None else training.lr
        wd = own.weight_decay if own is not None and own.weight_decay is not None else training.weight_decay
        groups.append({"params": by_group[g], "lr": lr, "weight_decay": wd, "name": g})
    return groups


# --------------------------------------------------------------------------------------------- merged weights


def has_adapter(model: torch.nn.Module) -> bool:
    return any(_is_lora_layer(m) for m in model.modules())


def hf_name(name: str) -> str:
    """A parameter name as the served (un-adapted) model knows it: peft's wrappers removed."""
    name = name.replace(".base_layer.", ".")
    return re.sub(r"\.modules_to_save\.default\.", ".", name)


@torch.no_grad()
def merged_weight(layer: Any) -> torch.Tensor:
    """W + ΔW of one LoRA/DoRA linear layer for its active adapter, computed aside (the layer's own weights are
    not touched, unlike peft's ``merge``). DoRA, as peft's merge: ``m / ‖W + ΔW‖_row · (W + ΔW)``."""
    base = layer.get_base_layer().weight
    merged = base.detach().clone()
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        delta = layer.get_delta_weight(name).to(merged.dtype)
        if layer.use_dora.get(name, False):
            mag = layer.lora_magnitude_vector[name]
            norm = mag.get_weight_norm(merged, delta, scaling=1).detach()
            merged = (mag.weight / norm).view(-1, 1).to(merged.dtype) * (merged + delta)
        else:
            merged = merged + delta
    return merged


def merged_weights(model: torch.nn.Module, merge: Callable[[Any], Any] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The served model's names and tensors of an adapter-trained policy: each adapted linear's weight merged
    (``merge(layer)``, by default :func:`merged_weight`; FSDP2: learner/recipe_sharded.py's deferred merge), every
    other base parameter as it is, the adapter's own tensors (``lora_*``) and peft's frozen copies of
    ``modules_to_save`` left out. Tied parameters once, as ``named_parameters`` has them."""
    merge = merge or merged_weight
    layers = {name: m for name, m in model.named_modules() if _is_lora_layer(m)}
    for name, p in model.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue
        owner, _, leaf = name.rpartition(".")
        layer_name = owner.removesuffix(".base_layer")
        if leaf == "weight" and owner.endswith(".base_layer") and layer_name in layers:
            yield hf_name(name), merge(layers[layer_name])
        else:
            yield hf_name(name), p.detach()


def frozen_names(model: torch.nn.Module) -> list[str]:
    """The served names (:func:`merged_weights`'s) whose values stay as loaded for the whole run: parameters that
    take no gradient (``model.freeze`` groups; under an adapter every base weight) minus the adapted layers'
    weights (their merge changes; their biases do not) and the adapter's own tensors. A weight sync declares them
    and sends them only where the server cannot vouch for its copy (``SyncInitRequest.skip``). ``requires_grad``
    is set once, before the model is wrapped (:func:`apply_recipe`), and never changes during a run."""
    adapted = {name for name, m in model.named_modules() if _is_lora_layer(m)}
    out = []
    for name, p in model.named_parameters():
        if p.requires_grad or ".lora_" in name or ".original_module." in name:
            continue
        owner, _, leaf = name.rpartition(".")
        if leaf == "weight" and owner.removesuffix(".base_layer") in adapted:
            continue  # its bias (bias="none") is not merged: frozen like any other base weight
        out.append(hf_name(name))
    return out


def adapter_push(model: torch.nn.Module) -> Any:
    """The adapter a ``model.adapter.sync: adapter`` push sends (:class:`learner.weight_sync.base.AdapterPush`): its shape
    and, per adapted layer, ``<layer>.lora_A.weight``, ``<layer>.lora_B.weight`` and (DoRA)
    ``<layer>.lora_magnitude_vector.weight``, the tensors as trained (the server merges in their dtype). Under
    FSDP2 they are the sharded DTensors (detached), which the push gathers when they travel (every rank calls
    this: the gather plan indexes them; learner/weight_sync/boundary.py ``_sharded_source``)."""
    from peft.tuners.lora import Linear as LoraLinear

    from common.weight_sync.messages import AdapterSpec
    from common.weight_sync.weights import dtype_name
    from learner.weight_sync.base import AdapterPush

    config = model._tandem_lora_config
    layers = {name: m for name, m in model.named_modules() if _is_lora_layer(m)}
    odd = [name for name, m in layers.items() if not isinstance(m, LoraLinear)]
    if odd:
        raise ValueError(f"model.adapter.sync: adapter merges linear layers only; {odd[0]!r} is a "
                         f"{type(layers[odd[0]]).__name__}. Fix: model.adapter.sync: merged, or target_modules that "
                         "name linear layers only")
    tensors = []
    for name, layer in layers.items():
        (adapter,) = layer.active_adapters
        tensors.append((f"{name}.lora_A.weight", layer.lora_A[adapter].weight.detach()))
        tensors.append((f"{name}.lora_B.weight", layer.lora_B[adapter].weight.detach()))
        if config.use_dora:
            tensors.append((f"{name}.lora_magnitude_vector.weight",
                            layer.lora_magnitude_vector[adapter].weight.detach()))
    spec = AdapterSpec(type="dora" if config.use_dora else "lora", rank=config.r, alpha=float(config.lora_alpha),
                       dtype=dtype_name(tensors[0][1].dtype), layers=list(layers))
    return AdapterPush(spec=spec, tensors=tensors)


# --------------------------------------------------------------------------------------------- checkpoints

#: Where a learner checkpoint (and ``learner.export --adapter-only``) keeps the adapter: peft's own layout
#: (adapter_config.json + adapter_model.safetensors, keys under ``base_model.model.``), so
#: ``peft.PeftModel.from_pretrained(base, dir)`` loads it as it loads any adapter.
ADAPTER_DIR = "adapter"
_PEFT_PREFIX = "base_model.model."


def base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict under the HF names, the adapter left out and ``modules_to_save`` at their
    frozen originals: what a checkpoint's ``model/`` holds (the adapter goes to ``adapter/``)."""
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_" in name or ".modules_to_save." in name:
            continue
        out[name.replace(".base_layer.", ".").replace(".original_module.", ".")] = t
    return out


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The injected adapter's tensors (peft's ``get_peft_model_state_dict``: ``lora_*`` and ``modules_to_save``),
    whole, on the CPU. Under FSDP2 each is a DTensor gathered here: a collective, so every rank calls it (same
    order on every rank: the state dict's)."""
    from peft import get_peft_model_state_dict

    out = {}
    for k, v in get_peft_model_state_dict(model).items():
        v = v.detach()
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu().contiguous()
    return out


def save_adapter(model: torch.nn.Module, dst: Any, state: dict[str, torch.Tensor] | None = None) -> None:
    """``dst``/adapter_model.safetensors + adapter_config.json of the injected adapter (peft's format); ``state``:
    :func:`adapter_state` taken already (FSDP2: gathered on every rank, written by rank 0)."""
    from pathlib import Path

    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    state = adapter_state(model) if state is None else state
    save_file({_PEFT_PREFIX + k: v for k, v in state.items()}, dst / "adapter_model.safetensors")
    model._tandem_lora_config.save_pretrained(dst)


def load_adapter(model: torch.nn.Module, src: Any) -> None:
    """Restore a :func:`save_adapter` directory into a policy with the same adapter injected; every adapter tensor
    must be there (a resume that trained a fresh adapter would not be exact)."""
    from pathlib import Path

    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = {k.removeprefix(_PEFT_PREFIX): v for k, v in load_file(Path(src) / "adapter_model.safetensors").items()}
    result = set_peft_model_state_dict(model, state)
    missing = [k for k in result.missing_keys if ".lora_" in k or ".modules_to_save." in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"{src}: the adapter does not match model.adapter (missing {missing[:3]}, unexpected "
                         f"{list(result.unexpected_keys)[:3]}). Fix: resume with the model.adapter the run trained with")


def restore_adapter(model: torch.nn.Module, checkpoint: Any, model_cfg: Any) -> None:
    """On resume: load the checkpoint's ``adapter/`` into the freshly injected adapter (learner/rank.py); a
    checkpoint and a config that disagree on having an adapter are refused (the resume would not be exact)."""
    from pathlib import Path

    if checkpoint is None:
        return
    saved = (Path(checkpoint) / ADAPTER_DIR).is_dir()
    wanted = getattr(model_cfg, "adapter", None) is not None
    if saved != wanted:
        raise ValueError(f"{checkpoint} {'holds' if saved else 'holds no'} adapter/ but model.adapter is "
                         f"{'null' if not wanted else 'set'}. Fix: resume with the model.adapter the run trained "
                         "with (export the merged model with python -m learner.export to change recipes)")
    if saved:
        load_adapter(model, Path(checkpoint) / ADAPTER_DIR)


def write_merged(model_dir: Any, adapter_dir: Any, dst: Any) -> None:
    """``dst``: an HF model directory of ``model_dir``'s base weights with ``adapter_dir``'s adapter merged in
    (:func:`merged_weights`: what the rollout server was serving), loadable without peft (``learner.export``)."""
    from pathlib import Path

    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    inject_adapter_in_model(LoraConfig.from_pretrained(str(adapter_dir)), model)
    load_adapter(model, adapter_dir)
    merged = dict(merged_weights(model))
    plain = AutoModelForImageTextToText.from_pretrained(model_dir)
    missing, unexpected = plain.load_state_dict(merged, strict=False)
    if unexpected or any(k not in merged for k, _ in plain.named_parameters()):
        raise ValueError(f"{adapter_dir} does not merge into {model_dir} (unexpected {unexpected[:3]}). Fix: export a "
                         "checkpoint the learner wrote, whole")
    plain.save_pretrained(Path(dst))
