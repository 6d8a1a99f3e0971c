"""The learner's data-parallel engine: DDP (replicated) or FSDP2 (sharded), chosen by ``learner.parallel``.

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards every transformer block of the language model
and of the vision tower, then the root (embeddings, norm, lm_head)::

    parameters (model.dtype, sharded dim 0 over the ranks; host memory with cpu_offload)
      forward/backward of block k: all-gather its shards (learner.fsdp.param_dtype) ─► compute ─► free
      gradients: reduce-scatter in learner.fsdp.reduce_dtype ─► each rank keeps its shard
      AdamW steps on the shards (on the CPU with cpu_offload)

Frozen and trained parameters share a unit: ``model.freeze`` groups, and under ``model.adapter`` every base
weight beside its block's trained ``lora_*`` tensors (learner/recipe.py injects peft's layers before the wrap).
FSDP2 shards and gathers them alike; only parameters that take a gradient are reduce-scattered and get AdamW
state (tests/test_recipe_fsdp.py, tests/test_recipe_resume.py).

Where the weights live: the learner loads the model on the CPU under ``fsdp`` (:func:`load_device`);
``fully_shard`` moves each block's parameters to the rank's device as it shards them, so without
offload the shards end on the GPU and with ``cpu_offload`` they go back to pinned host memory; the
whole model is never on the GPU at once.

The step contract is the same under both engines: ``grad_sync(model, on)`` is DDP's ``no_sync`` or
FSDP2's ``set_requires_gradient_sync`` (gradients reduced on the last micro-step only; with
``cpu_offload`` FSDP2 reduce-scatters after every micro-step instead, so no unsharded gradient
accumulates on the GPU), and every rank runs every block in every forward, in the same order: the
FSDP2 all-gathers are collectives paired by order (``learner.model.forward_rows`` runs the zero
vision term of an image-less pack where the vision tower would have run).

What this module does not know: packs, losses, sync or checkpoints (they ask :func:`is_fsdp`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

#: FSDP2 roots wrapped with cpu_offload or reduce_every_micro_step: gradients reduce-scatter (to host memory with
#: cpu_offload) after every micro-step, since skipping the reduction accumulates unsharded gradients of every block
#: on the GPU.
_REDUCE_EVERY_MICRO_STEP: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def is_fsdp(model: torch.nn.Module) -> bool:
    """True for a model sharded by :func:`wrap` with ``parallel: fsdp`` (its root is an FSDPModule)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def sharded_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP2 shards one by one: decoder layers and vision blocks (Qwen2/2.5-VL layout)."""
    inner = getattr(model, "model", model)
    blocks: list[torch.nn.Module] = []
    lm = getattr(inner, "language_model", inner)
    blocks += list(getattr(lm, "layers", []))
    vis = getattr(inner, "visual", None)
    if vis is not None:
        blocks += list(getattr(vis, "blocks", []))
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to shard (learner.parallel: fsdp expects a "
                         "Qwen2/2.5-VL model). Fix: use learner.parallel: ddp")
    return blocks


def fsdp_dtype(name: str, device: torch.device) -> torch.dtype:
    """``learner.fsdp.param_dtype`` ``auto`` = bfloat16 on CUDA, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_device(learner_cfg: Any, device: torch.device) -> torch.device:
    """Where the loaded weights go before :func:`wrap`: ``device`` under DDP; the CPU under FSDP2, which moves
    one block at a time to ``device`` while sharding it (a 7B model never sits whole on the GPU)."""
    return torch.device("cpu") if learner_cfg.parallel == "fsdp" else device


def join_one_rank_group(device: torch.device) -> bool:
    """FSDP2 needs a process group even for one rank; a world of one (no torchrun) has none
    (``common/distributed/ranks.py``): make one on an in-memory store. True when this call made it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def wrap(model: torch.nn.Module, learner_cfg: Any, device: torch.device, world_size: int, local_rank: int) -> torch.nn.Module:
    """The model as the learner trains it: itself (one DDP rank), DDP, or sharded in place by FSDP2.

    Build the optimizer after this: FSDP2 replaces every parameter by its shard (a DTensor).
    """
    if learner_cfg.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        f = learner_cfg.fsdp
        if world_size == 1:
            join_one_rank_group(device)
        mesh = init_device_mesh(device.type, (world_size,))
        kw: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": f.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(param_dtype=fsdp_dtype(f.param_dtype, device),
                                              reduce_dtype=getattr(torch, f.reduce_dtype)),
            # pinned host memory for fast host-device copies; a CPU-only torch cannot pin (and needs no copies)
            "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda") if f.cpu_offload else OffloadPolicy(),
        }
        # The blocks keep their inputs' dtypes (cast_forward_inputs off; the root still casts pixel_values):
        # torch 2.11's FSDP2 casts a block's inputs in its forward pre-hook but not when the hook runs again in a
        # checkpointed block's recomputation (transformers 5.17 checkpoints __call__, hooks inside), so the vision
        # blocks' float32 rotary cos/sin were bfloat16 in one pass and float32 in the other, and a compiled block's
        # backward stopped on "Recomputed values ... have different metadata" (7b, 2 ranks, docs/benchmarks.md
        # section 22). Uncast, a block sees what it sees under DDP, in every pass.
        block_kw = {**kw, "mp_policy": dataclasses.replace(kw["mp_policy"], cast_forward_inputs=False)}
        for block in sharded_blocks(model):
            fully_shard(block, **block_kw)
        fully_shard(model, **kw)
        if f.cpu_offload or f.reduce_every_micro_step:
            _REDUCE_EVERY_MICRO_STEP.add(model)
        log.info("FSDP2: %d blocks + root sharded over %d rank(s) (param %s, reduce %s, cpu_offload %s, reduce every "
                 "micro-step %s)", len(sharded_blocks(model)), world_size, kw["mp_policy"].param_dtype, f.reduce_dtype,
                 f.cpu_offload, model in _REDUCE_EVERY_MICRO_STEP)
        return model
    if world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    # find_unused_parameters off (it costs a graph traversal per step and warned on every run): every
    # parameter gets a gradient each step, a pack without images through forward_rows' zero vision
    # term. Frozen parameters (model.freeze, an adapter's base weights: requires_grad False) are not DDP's to
    # reduce: it buckets only those that train. Buffers (rope) are constant: no per-forward broadcast. torch >= 2.13
    # names that switch forward_sync_buffers; 2.11 (the GPU image) only has broadcast_buffers.
    no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
               else "broadcast_buffers")
    return DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
               find_unused_parameters=False, **{no_sync: False})


@contextlib.contextmanager
def grad_sync(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """Backward inside reduces gradients across ranks only if ``on`` (DDP no_sync / FSDP2 requires_gradient_sync)."""
    if on or model in _REDUCE_EVERY_MICRO_STEP:
        yield
    elif is_fsdp(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    else:
        yield


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """This process's peak memory since it started, in GiB: ``rss`` (host, ``getrusage``) always; ``allocated``
    and ``reserved`` (``torch.cuda.max_memory_*``) when ``device`` is a GPU."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out = {"rss": rss * (1 if sys.platform == "darwin" else 1024) / 2**30}
    if device.type == "cuda":
        out["allocated"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["reserved"] = torch.cuda.max_memory_reserved(device) / 2**30
    return out
