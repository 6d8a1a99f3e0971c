"""An ``adapter`` sync for an engine that cannot read its served weights back (vLLM): the adapted layers' base
weights read from the model directory, and one session's adapter tensors, checked, kept and merged at commit.

vLLM holds its weights fused and sharded in worker processes, so the API process cannot take a base copy of
``<layer>.weight`` from them as the hf engine does. In an adapter run every base weight is frozen, so the served
model directory IS the base: :func:`base_weights` loads it with transformers on CPU, exactly as the hf engine and
the learner load it (same class, same key mapping, the adapter's dtype), and keeps only the adapted layers'
weights, checked against the served manifest's shapes. It costs one CPU load of the model, once per adapter
shape (the engine keeps the :class:`~rollout_server.engines.adapter_merge.AdapterMerger` built from it).

:class:`AdapterStage` is one session's side: which sent names are adapter tensors, their checks (shape, dtype, a
repeat), and at commit the merge (peft's, through the merger: no algebra here) into ``{<layer>.weight: merged}``
in the serving dtype, timed, which the engine then loads like any other staged tensor.

What this module does not know: vLLM, HTTP, sessions, or how the engine loads the merged tensors.
"""

from __future__ import annotations

import logging
import time

import torch

from common.weight_sync import weights as W
from common.weight_sync.messages import AdapterSpec, TensorSpec
from rollout_server.engines.adapter_merge import AdapterMerger, adapter_tensor_specs
from rollout_server.engines.base import WeightUpdateError

log = logging.getLogger(__name__)


def load_hf_model(model_path: str, dtype: torch.dtype) -> torch.nn.Module:
    """The served checkpoint in transformers on CPU, as the hf engine loads it (a text-only one as a causal LM)."""
    from transformers import AutoModelForImageTextToText

    try:
        return AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype)
    except ValueError:  # a text-only checkpoint
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)


def layer_shapes(spec: AdapterSpec, manifest: dict[str, TensorSpec], alias: dict[str, str]) -> dict[str, list[int]]:
    """``{layer: [out, in]}`` of every adapted layer from the served manifest; :class:`WeightUpdateError` (field
    ``adapter``) naming a layer whose ``.weight`` is not served or not a linear weight."""
    shapes = {}
    for layer in spec.layers:
        name = alias.get(f"{layer}.weight", f"{layer}.weight")
        served = manifest.get(name)
        if served is None:
            raise WeightUpdateError(f"adapter layer {layer!r}: {name!r} is not a parameter of the served model (send "
                                    f"HF module names, e.g. {next(iter(manifest), '?')!r})", "adapter")
        if len(served.shape) != 2:
            raise WeightUpdateError(f"adapter layer {layer!r}: {name!r} is {served.shape}, not a linear weight",
                                    "adapter")
        shapes[layer] = list(served.shape)
    return shapes


def base_weights(model_path: str, spec: AdapterSpec, shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """``{layer: weight}`` of every layer of ``spec.layers`` as the learner loads it from ``model_path`` (CPU,
    ``spec.dtype``); :class:`WeightUpdateError` (field ``adapter``) naming the first layer the directory lacks or
    holds in another shape than ``shapes[layer]`` (the served manifest's)."""
    t0 = time.monotonic()
    model = load_hf_model(model_path, W.torch_dtype(spec.dtype))
    params = {W.hf_name(n): p for n, p in model.named_parameters()}
    out = {}
    for layer in spec.layers:
        weight = params.get(f"{layer}.weight")
        if weight is None:
            raise WeightUpdateError(f"adapter layer {layer!r}: {model_path} has no {layer + '.weight'!r} (its "
                                    f"parameters are e.g. {next(iter(params), '?')!r}); the adapter must name the "
                                    "served model's own linear layers", "adapter")
        if list(weight.shape) != list(shapes[layer]):
            raise WeightUpdateError(f"adapter layer {layer!r}: {model_path} holds {list(weight.shape)}, the server "
                                    f"serves {list(shapes[layer])}", "adapter")
        out[layer] = weight.detach()
    del model, params
    log.info("adapter sync: base weights of %d layer(s) read from %s in %.1fs", len(out), model_path,
             time.monotonic() - t0)
    return out


class AdapterStage:
    """One adapter session: the adapter tensors it must send (``specs``), those staged so far, the merge."""

    def __init__(self, merger: AdapterMerger, shapes: dict[str, list[int]]) -> None:
        self.merger = merger
        self.specs = {s.name: s for s in adapter_tensor_specs(merger.spec, shapes)}
        self.adapted = {f"{layer}.weight" for layer in merger.spec.layers}
        self.staged: dict[str, torch.Tensor] = {}
        self.merge_s: float | None = None

    def owns(self, name: str) -> bool:
        """An adapter tensor of this session (not a served name)."""
        return name in self.specs

    def take(self, name: str, tensor: torch.Tensor) -> int:
        """Keep one adapter tensor (a copy: a bucket's body does not outlive its request); bytes."""
        spec = self.specs[name]
        dtype = W.dtype_name(tensor.dtype)
        if name in self.staged:
            raise WeightUpdateError(f"{name!r} sent twice in this session", name)
        if list(tensor.shape) != spec.shape or dtype != spec.dtype:
            raise WeightUpdateError(f"{name!r} is {dtype} {list(tensor.shape)}, the adapter session expects "
                                    f"{spec.dtype} {spec.shape}", name)
        self.staged[name] = tensor.detach().to("cpu", copy=True)
        return tensor.numel() * tensor.element_size()

    def merged(self, serving_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``{<layer>.weight: base merged with the staged adapter}`` in ``serving_dtype`` (CPU, peft's algebra);
        :class:`WeightUpdateError` when an adapter tensor was not sent. Sets :attr:`merge_s`."""
        missing = [n for n in self.specs if n not in self.staged]
        if missing:
            raise WeightUpdateError(f"{len(missing)} of {len(self.specs)} adapter tensors were not sent (first: "
                                    f"{missing[0]!r}); old weights kept")
        t0 = time.monotonic()
        out = self.merger.merge(self.staged, serving_dtype)
        self.merge_s = time.monotonic() - t0
        return out


def adapter_key(spec: AdapterSpec) -> str:
    """One merger per adapter shape: its type, rank, alpha, dtype and layers."""
    return spec.model_dump_json()


__all__ = ["AdapterStage", "base_weights", "layer_shapes", "load_hf_model", "adapter_key"]
