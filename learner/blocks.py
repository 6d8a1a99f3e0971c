"""How each vision block and decoder layer runs in the learner: gradient checkpointing and regional compile.

Every ``GradientCheckpointingLayer`` (the vision blocks and decoder layers of Qwen2/2.5/3-VL) gets one
:class:`BlockForward` as its ``forward``; the module's ``__call__``, and with it every hook a wrapper puts there
(FSDP2's all-gather before and reshard after, DDP's), stays outside::

    layer(...) = nn.Module.__call__ ─► pre-hooks (FSDP2: unshard) ─► BlockForward ─► post-hooks (FSDP2: reshard)
                                                                        │
                   checkpoint on and grad enabled:  torch.utils.checkpoint(fn, non-reentrant) ─► fn
                   otherwise:                       fn
                   fn = the layer class's forward, or its torch.compile'd form (training.compile: blocks)

Why not transformers' own checkpointing (``gradient_checkpointing_enable``): its place moved between releases.
5.17 (the GPU image) checkpoints ``__call__``, so a checkpointed layer's recomputation in backward runs FSDP2's
hooks a second time (an all-gather per layer more: a 7b step on 2 × H200 took 2.61 s eager and 2.05 s compiled
that way, 2.45 and 1.80 s here; docs/benchmarks.md section 20); 5.24 checkpoints ``forward`` behind
``torch.compiler.disable``, so ``Module.compile`` of a checkpointed layer captures no graph at all. Here the
checkpoint and the compiled region are ours on every release: FSDP2's hooks never run inside the recomputation,
and the compiled function is the layer's forward itself (one graph per kind of layer, shared by every layer of
that kind: compile time does not grow with depth).

What this module does not know: packs, losses, ranks or configs (learner.model.load_policy passes
``training.gradient_checkpointing_every`` and ``training.compile`` in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


class BlockForward:
    """A layer's ``forward``: ``fn(layer, ...)``, recomputed in backward when :attr:`checkpoint` is on."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self.fn: Callable[..., Any] = _class_forward(type(layer))
        self.checkpoint = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.checkpoint and self.layer.training and torch.is_grad_enabled():
            # non-reentrant: keyword inputs and inputs that need no grad (a frozen embedding's output) work
            return checkpoint(self.fn, self.layer, *args, use_reentrant=False, **kwargs)
        return self.fn(self.layer, *args, **kwargs)


def _class_forward(cls: type) -> Callable[..., Any]:
    """The class's own forward, under transformers' checkpointing wrapper where a release adds one (5.2x wraps
    ``forward`` with ``functools.wraps``; its flag is off here anyway, so either form computes the same)."""
    fn = cls.forward
    return getattr(fn, "__wrapped__", fn)


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The vision blocks and decoder layers in module order (the order ``every_n_layers`` counts in)."""
    from transformers.modeling_layers import GradientCheckpointingLayer  # heavy: deferred

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def block_forward(layer: torch.nn.Module) -> BlockForward:
    """The layer's :class:`BlockForward`, installed on first use (transformers' own checkpointing turned off)."""
    bf = layer.__dict__.get("forward")
    if not isinstance(bf, BlockForward):
        layer.gradient_checkpointing = False
        bf = BlockForward(layer)
        layer.forward = bf
    return bf


def set_checkpointing(model: torch.nn.Module, every: int) -> int:
    """Gradient checkpointing on every ``every``-th layer (0: off), counting the vision blocks and the decoder
    layers in module order as transformers' ``every_n_layers`` does. Returns how many layers recompute.

    Why not all of them: each checkpointed layer runs its forward twice, ~1/3 more matmul work, and the
    rest of the step's GPU time is its elementwise ops, recomputed too; a layer left out keeps its whole
    activation instead (``launcher.gpu_budget`` estimates both). Where memory allows, ``every: 2`` keeps
    half the saving for half the recomputation (docs/benchmarks.md section 20 measures it).
    """
    if every < 0:
        raise ValueError(f"training.gradient_checkpointing_every = {every}: must be ≥ 0 (0 = off, 1 = every layer)")
    found = layers(model)
    for i, layer in enumerate(found):
        block_forward(layer).checkpoint = bool(every) and i % every == 0
    return sum(block_forward(layer).checkpoint for layer in found)


def checkpointed(model: torch.nn.Module) -> list[bool]:
    """Which layers recompute in backward, in module order (a question: installs nothing)."""
    return [isinstance(bf := layer.__dict__.get("forward"), BlockForward) and bf.checkpoint for layer in layers(model)]


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """``training.compile: blocks``: ``torch.compile`` each vision block's and decoder layer's forward (regional
    compilation, as torchtitan does; the elementwise work between the matmuls fuses into few kernels). One
    compiled function per layer class serves every layer of that class. Done before DDP/FSDP2 wrap the model,
    whose hooks stay outside the compiled region. Returns how many layers run compiled.

    At the operating point on an H100 it took a 3b step from 1.82 to 1.11 s (docs/benchmarks.md section 20);
    the first steps pay the compilation. ``backend``: tests use ``eager`` (the capture without inductor's
    minutes of C++ builds on a CPU)."""
    found = layers(model)
    if not found:
        raise ValueError(f"training.compile: blocks found no vision blocks or decoder layers in "
                         f"{type(model).__name__}. Fix: set training.compile: none for this model")
    compiled: dict[Callable[..., Any], Callable[..., Any]] = {}  # one wrapper per layer class
    for layer in found:
        bf = block_forward(layer)
        if not is_compiled(bf.fn):
            if bf.fn not in compiled:
                compiled[bf.fn] = torch.compile(bf.fn, backend=backend)
            bf.fn = compiled[bf.fn]
    return len(found)


def is_compiled(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a ``torch.compile`` wrapper (it keeps the original as ``_torchdynamo_orig_callable``)."""
    return hasattr(fn, "_torchdynamo_orig_callable")
