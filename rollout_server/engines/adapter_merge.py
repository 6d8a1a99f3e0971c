"""The server side of an ``adapter`` weight sync: the adapted layers' base weights, and peft's merge of a pushed
adapter into a copy of them (``SyncInitRequest.adapter``; docs/models.md, Adapters).

One :class:`AdapterMerger` per adapter shape (type, rank, alpha, dtype, layers), built at the first session that
declares it and kept for the engine's life::

    base       each adapted layer's weight as the server loaded it (a copy, in the adapter's dtype): never written
    shadow     a module tree with one plain nn.Linear per adapted layer, its weight the base copy, wrapped by peft's
               own LoRA/DoRA layer (``inject_adapter_in_model``, the learner's injection)
    merge      per layer: the pushed A, B (and DoRA magnitude) copied into the shadow's adapter, peft's
               ``merge(safe_merge=True)`` (it merges into a new tensor: the base copy stays as it was), the result
               cast to the serving dtype, the shadow reset to the base copy

So every sync merges from the base, never from the last merge, with peft's LoRA/DoRA algebra (no copy of it here),
which is what the learner's ``learner/recipe.py`` ``merged_weight`` equals bit for bit.

What this module does not know: sessions, HTTP, the served model (the engine hands it base weights and takes the
merged ones back), or the learner.
"""

from __future__ import annotations

import torch

from common.weight_sync.messages import AdapterSpec, TensorSpec
from common.weight_sync import weights as W

ADAPTER = "default"  # peft's adapter name inside the shadow


def adapter_tensor_specs(spec: AdapterSpec, weight_shapes: dict[str, list[int]]) -> list[TensorSpec]:
    """The tensors an ``adapter`` session sends for ``spec``: per layer (``weight_shapes[layer]`` = [out, in])
    ``<layer>.lora_A.weight`` [r, in], ``<layer>.lora_B.weight`` [out, r], DoRA ``<layer>.lora_magnitude_vector.weight``
    [out], all in ``spec.dtype``."""
    out = []
    for layer in spec.layers:
        n_out, n_in = weight_shapes[layer]
        out.append(TensorSpec(name=f"{layer}.lora_A.weight", dtype=spec.dtype, shape=[spec.rank, n_in]))
        out.append(TensorSpec(name=f"{layer}.lora_B.weight", dtype=spec.dtype, shape=[n_out, spec.rank]))
        if spec.type == "dora":
            out.append(TensorSpec(name=f"{layer}.lora_magnitude_vector.weight", dtype=spec.dtype, shape=[n_out]))
    return out


class AdapterMerger:
    """The base copies and peft shadow of one adapter shape (module docstring)."""

    def __init__(self, spec: AdapterSpec, base: dict[str, torch.Tensor]) -> None:
        """``base``: each layer of ``spec.layers`` -> its served weight [out, in] as loaded (copied here)."""
        from peft import LoraConfig, inject_adapter_in_model  # heavy: only servers that take adapter syncs

        self.spec = spec
        dtype = W.torch_dtype(spec.dtype)
        self.base = {layer: base[layer].detach().to(dtype=dtype, copy=True) for layer in spec.layers}
        root = torch.nn.Module()
        for layer, weight in self.base.items():
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            _put(root, layer, linear)
        # Exact names as targets: peft matches a target by the name or its dotted suffix, and only these exist here.
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, target_modules=list(spec.layers),
                            use_dora=spec.type == "dora", bias="none")
        inject_adapter_in_model(config, root)
        root.eval()
        self.layers = {layer: root.get_submodule(layer) for layer in spec.layers}

    @torch.no_grad()
    def merge(self, tensors: dict[str, torch.Tensor], serving_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``{<layer>.weight: merged}`` from the pushed adapter tensors (names of :func:`adapter_tensor_specs`)."""
        out = {}
        for name, layer in self.layers.items():
            layer.lora_A[ADAPTER].weight.copy_(tensors[f"{name}.lora_A.weight"])
            layer.lora_B[ADAPTER].weight.copy_(tensors[f"{name}.lora_B.weight"])
            if self.spec.type == "dora":
                layer.lora_magnitude_vector[ADAPTER].weight.copy_(tensors[f"{name}.lora_magnitude_vector.weight"])
            linear = layer.get_base_layer()
            linear.weight.data = self.base[name]
            layer.merged_adapters.clear()
            layer.merge(safe_merge=True, adapter_names=[ADAPTER])  # a new tensor: the base copy is not written
            out[f"{name}.weight"] = linear.weight.data.to(serving_dtype)
            linear.weight.data = self.base[name]
            layer.merged_adapters.clear()
        return out


def _put(root: torch.nn.Module, dotted: str, module: torch.nn.Module) -> None:
    """``root.<dotted> = module``, making the plain parent modules on the way."""
    *parents, leaf = dotted.split(".")
    node = root
    for part in parents:
        child = getattr(node, part, None) if part in node._modules else None
        if child is None:
            child = torch.nn.Module()
            node.add_module(part, child)
        node = child
    node.add_module(leaf, module)
