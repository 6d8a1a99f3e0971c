"""What the learner serves: the HF names and tensors a push sends, under whatever wraps the model.

DDP and ``torch.compile`` wrap the HF module (:func:`unwrap`); FSDP2 shards its parameters in place as DTensors
(:func:`is_sharded`); a peft adapter adds tensors the server does not serve (:func:`named_weights` yields the
served model's names, an adapted layer's weight merged aside). learner/weight_sync/boundary.py pushes what this
module names; learner/checkpoint.py and the benches read the same names.

What this module does not know: servers, transports, or when to sync.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The HF module under DDP / torch.compile wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """HF parameter names and tensors, tied parameters once (under the name ``named_parameters`` keeps).
    Under FSDP2 the tensors are the sharded DTensors (nothing gathered). A policy with a peft adapter
    (``model.adapter.sync: merged``) yields the served model's names and each adapted layer's W + ΔW, made
    aside: its training weights stay as they are (learner/recipe.py ``merged_weights``); sharded, that W + ΔW
    is a ``Derived`` entry the push gathers and rank 0 merges (learner/recipe_sharded.py)."""
    from learner.recipe import has_adapter, merged_weights

    inner = unwrap(model)
    if has_adapter(inner):
        if is_sharded(model):
            from learner.recipe_sharded import sharded_merged_weights

            yield from sharded_merged_weights(inner)
        else:
            yield from merged_weights(inner)
        return
    for name, p in inner.named_parameters():
        yield name, p.detach()


def is_sharded(model: torch.nn.Module) -> bool:
    """The learner shards the model with FSDP2 (``learner.parallel: fsdp``): the sync gathers on every rank."""
    from learner.parallel import is_fsdp

    return is_fsdp(model)
