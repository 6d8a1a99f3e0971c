"""An adapter-trained policy sharded by FSDP2 (``learner.parallel: fsdp`` with ``model.adapter``): the merged
weights a ``model.adapter.sync: merged`` push serves, computed on rank 0 from tensors gathered whole. A
``model.adapter.sync: adapter`` push computes the same merges for its fingerprint only (the server merges its
own base; the fingerprint covers the complete served model), gathered aside and never sent
(learner/weight_sync/sharded.py).

Under FSDP2 an adapted layer's base weight W, ``lora_A``, ``lora_B`` (and DoRA's magnitude m) are DTensors,
each sharded on dim 0 over the ranks. W + ΔW needs them whole (ΔW = B·A mixes every row of B with every column
of A; DoRA divides by each row's norm of W + ΔW). So the push walks the served weights as it does for a full
fine-tune (learner/weight_sync/sharded.py), and an adapted layer's weight is a ``Derived`` entry there::

    every rank: all-gather W, A, B (, m) of the layer, each in its own dtype      one collective per part
    rank 0:     the learner's ``merged_weight`` (learner/recipe.py: peft's get_delta_weight and DoRA's
                get_weight_norm) on a scratch peft layer holding the gathered tensors: the DDP path's merge,
                bit for bit -> cast to the serving dtype -> into the bucket
    ranks > 0:  drop them

Nothing is merged into the training weights: a merge and unmerge in place would leave the frozen base a
rounding away from what it was, and would change every rank's shards inside the push. Extra memory on rank 0:
one layer's gathered parts and its merge at a time; the scratch layers hold no storage between merges (their
parameters are put back on the ``meta`` device).

What this module does not know: servers, buckets, or the wire.
"""

from __future__ import annotations

from typing import Any

import torch

from learner.recipe import merged_weight, merged_weights
from learner.weight_sync.sharded import Derived

#: Scratch peft layers by (out, in, r, dora): built on ``meta`` once, their tensors swapped in for each merge.
_SCRATCH: dict[tuple[int, int, int, bool], Any] = {}


def sharded_merged_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """:func:`learner.recipe.merged_weights` of a sharded policy: every served name with its DTensor, an adapted
    layer's weight as a :class:`Derived` of its base and adapter tensors (gathered by the push, merged on rank 0).
    The same list, in the same order, on every rank (the push's gathers are paired by order)."""
    return list(merged_weights(model, merge=_deferred_merge))


def _deferred_merge(layer: Any) -> Derived:
    (adapter,) = layer.active_adapters
    base = layer.get_base_layer().weight
    parts = [base, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight]
    if layer.use_dora.get(adapter, False):
        parts.append(layer.lora_magnitude_vector[adapter].weight)
    return Derived([p.detach() for p in parts], lambda full: merge_gathered(layer, adapter, full), base.shape,
                   base.dtype)


@torch.no_grad()
def merge_gathered(layer: Any, adapter: str, full: list[torch.Tensor]) -> torch.Tensor:
    """W + ΔW of ``layer`` (a peft LoRA/DoRA Linear whose tensors are sharded) from its tensors gathered whole:
    ``full`` = [W, A, B] (+ [m] for DoRA), computed by :func:`learner.recipe.merged_weight` on a scratch layer of
    the same shape, scaling and fan-in/fan-out."""
    w, a, b, *mag = full
    scratch = _scratch(w.shape[0], w.shape[1], a.shape[0], bool(mag))
    tensors = [(scratch.get_base_layer(), w), (scratch.lora_A[adapter], a), (scratch.lora_B[adapter], b)]
    if mag:
        tensors.append((scratch.lora_magnitude_vector[adapter], mag[0]))
    scratch.scaling[adapter] = layer.scaling[adapter]
    scratch.fan_in_fan_out = layer.fan_in_fan_out
    try:
        for module, t in tensors:
            module.weight = torch.nn.Parameter(t, requires_grad=False)
        return merged_weight(scratch)
    finally:
        for module, t in tensors:  # hold no storage until the next merge
            module.weight = torch.nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device="meta"), requires_grad=False)


def _scratch(n_out: int, n_in: int, rank: int, dora: bool) -> Any:
    """A peft LoRA/DoRA layer over a plain ``nn.Linear``, all on ``meta`` (no storage, no arithmetic)."""
    key = (n_out, n_in, rank, dora)
    if key not in _SCRATCH:
        from peft import LoraConfig, inject_adapter_in_model

        root = torch.nn.Module()
        root.add_module("layer", torch.nn.Linear(n_in, n_out, bias=False, device="meta"))
        with torch.random.fork_rng(devices=[]):  # peft's init draws on the CPU generator: not the training stream's
            inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=["layer"], use_dora=dora,
                                               bias="none"), root)
        _SCRATCH[key] = root.layer
    return _SCRATCH[key]
