"""The policy on the learner: loading, packed forward, optimizer and LR schedule.

Packed forward, and how segments are kept apart (transformers 5.23-5.24, Qwen2/2.5/3-VL: Qwen3VLTextModel reads the
4-row ``position_ids`` the same way; tests/test_loss.py runs the isolation on both tiny families)::

    pack arrays (common.packing.segment)                     model inputs (batch 1)
    input_ids [T] ──────────────────────────────────► input_ids [1, T]
    position_ids [3, T]  (mRoPE, per segment) ──┐
    cu_seqlens [S+1] ─► text positions [T] ─────┴──► position_ids [4, 1, T]   row 0 = text positions,
                    │                                                          rows 1..3 = mRoPE (t, h, w)
                    └─► block-diagonal causal ─────► attention_mask [1, 1, T, T]   (sdpa: bool, eager: additive)
                                                     None for flash_attention_2 and varlen
    pixel_values [P, D] uint8, pixel_affine [2, D] ─► pixel_values [P, D] = u8 · scale + offset (on the device)
    image_grid_thw [I, 3] ─────────────────────────► the vision tower (it splits images by grid itself)

``Qwen2_5_VLTextModel.forward`` takes a 4-row ``position_ids`` as "packed": row 0 (text positions,
restarting at 0 in every segment) is what the mask builder and flash-attention read to find
segment boundaries (``find_packed_sequence_indices``: a new segment wherever the position does not
step by 1; FA2 derives ``cu_seqlens`` from it), rows 1..3 feed the 3-D rotary embedding. A 3-row
``position_ids`` is *not* treated as packed: segments would attend to each other. For sdpa/eager we
also pass the block-diagonal 4-D mask built from ``cu_seqlens`` ourselves, which the mask builder
returns as-is, so isolation does not rest on that heuristic. A 1-row model (no mRoPE) gets
``position_ids [1, T]`` and the same mask. ``tests/test_loss.py`` proves the isolation.

``model.attn_implementation: varlen`` (learner/attention.py) builds no mask: each LM layer makes one
``varlen_attn`` call over the segments that row 0 starts (0 = a segment start), and each vision block one
over its images or windows; ``tests/test_varlen_attention.py`` proves it equal to sdpa and isolating.

What this module does not know: ranks, queues, or where packs come from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common.packing.segment import PackLimits
from common.detection.coord_tokens import require_coord_tokens
from learner import attention
from learner.blocks import compile_blocks, set_checkpointing
from learner.loss import LossTerms, LossWeights, Normaliser, Rows, head_loss, pack_loss, supervised_rows

log = logging.getLogger(__name__)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` = bfloat16 on CUDA, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_policy(model_cfg: Any, device: torch.device, gradient_checkpointing: bool = False,
                load_device: torch.device | None = None, compile: str = "none",
                checkpoint_every: int = 1) -> tuple[torch.nn.Module, Any, list[int]]:
    """(model in train mode, tokenizer, coord ids) from ``model.path``.

    ``device`` is where it computes (``model.dtype: auto`` resolves against it); the weights are put on
    ``load_device`` (default ``device``): the CPU under FSDP2, which moves them block by block while
    sharding (``learner.parallel.load_device``). ``compile``: ``training.compile`` (learner.blocks.compile_blocks);
    ``checkpoint_every``: ``training.gradient_checkpointing_every`` (learner.blocks.set_checkpointing).
    """
    from transformers import AutoModelForImageTextToText, AutoTokenizer  # heavy: deferred

    tokenizer = AutoTokenizer.from_pretrained(model_cfg.path)
    coord_ids = require_coord_tokens(tokenizer, model_cfg.path) if model_cfg.coord_tokens else []
    dtype = resolve_dtype(model_cfg.dtype, device)
    model = AutoModelForImageTextToText.from_pretrained(
        model_cfg.path, dtype=dtype, attn_implementation=attention.load_name(model_cfg.attn_implementation)
    )
    attention.apply(model, model_cfg.attn_implementation)
    vocab = model.get_output_embeddings().weight.shape[0]
    if coord_ids and max(coord_ids) >= vocab:
        raise ValueError(
            f"{model_cfg.path}: coord token id {max(coord_ids)} is outside the model's vocabulary ({vocab}). "
            "Fix: resize the embeddings when adding the coord tokens and save the model again"
        )
    from learner.recipe import apply_recipe

    apply_recipe(model, model_cfg)  # model.adapter, model.freeze: before any wrapper reads requires_grad
    set_checkpointing(model, checkpoint_every if gradient_checkpointing else 0)
    if compile == "blocks":
        compile_blocks(model)
    model.config.use_cache = False
    model.to(load_device or device).train()
    return model, tokenizer, coord_ids


# --------------------------------------------------------------------------------------------- packs


@dataclass
class PackInputs:
    """One pack on the device: the model's keyword arguments and the rows the loss needs."""

    model_kwargs: dict[str, Any]
    rows: Rows
    n_tokens: int
    n_segments: int


def text_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T]`` positions restarting at 0 at every ``cu_seqlens`` boundary."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    return torch.arange(int(cu_seqlens[-1])) - starts


def block_causal_mask(cu_seqlens: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor | None:
    """``[1, 1, T, T]`` causal mask that only lets a token see its own segment (None for FA2 and varlen,
    which find the segments from the text positions: learner/attention.py).

    sdpa takes the boolean form (True = attend); eager adds the mask to the scores, so it gets 0
    and the dtype's most negative value.
    """
    if attn_implementation in attention.MASKLESS:
        return None
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seg = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
    t = seg.shape[0]
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    if attn_implementation == "sdpa":
        return allowed[None, None]
    mask = torch.zeros(t, t, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def pack_inputs(
    arrays: Mapping[str, np.ndarray], attn_implementation: str, dtype: torch.dtype, device: torch.device
) -> PackInputs:
    """Model inputs for the ``PACK_TENSOR_SPECS`` arrays of one pack (see the module diagram)."""
    t = {k: torch.from_numpy(np.array(v, copy=True) if not v.flags.writeable else v) for k, v in arrays.items()}
    cu = t["cu_seqlens"].long()
    rope = t["position_ids"]
    if rope.shape[0] == 3:
        position_ids = torch.cat([text_positions(cu)[None], rope], dim=0)[:, None, :]
    else:
        position_ids = rope[:1]
    kwargs: dict[str, Any] = {
        "input_ids": t["input_ids"][None].to(device),
        "position_ids": position_ids.to(device),
        "attention_mask": None,
    }
    mask = block_causal_mask(cu, attn_implementation, dtype)
    if mask is not None:
        kwargs["attention_mask"] = mask.to(device)
    if t["image_grid_thw"].shape[0]:
        # uint8 crosses to the device (a quarter of float32's bytes); the processor's affine normalisation runs there
        scale, offset = t["pixel_affine"].to(device)
        kwargs["pixel_values"] = (t["pixel_values"].to(device).float() * scale + offset).to(dtype)
        kwargs["image_grid_thw"] = t["image_grid_thw"].to(device)
    rows = supervised_rows(t["labels"], t["coord_pos"], t["coord_bins"], t["weights"])
    rows = Rows(*(x.to(device) for x in (rows.ce_src, rows.ce_targets, rows.ce_weights, rows.coord_src, rows.coord_bins)))
    return PackInputs(kwargs, rows, n_tokens=int(t["input_ids"].shape[0]), n_segments=int(cu.shape[0] - 1))


def forward_rows(model: torch.nn.Module, inputs: PackInputs,
                 head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Logits ``[N, V]`` at ``inputs.rows.all_src`` only: one packed forward, the vocab projection on N rows.

    With ``head``, the vocab projection does not run: ``head(hidden [N, H], weight [V, H])`` runs in its place
    and its result comes back instead of the logits (:func:`forward_loss`'s chunked head).

    A pack without images (not made by tandem's actors, whose records always carry one, but valid on
    the wire) would leave the vision tower without gradients, and DDP (``find_unused_parameters``
    off: learner/parallel.py) would fail the next step. So under autograd such a pack adds 0 × a tiny
    vision forward (:func:`zero_vision_term`): the logits are unchanged, every vision parameter gets a
    zero gradient. Under FSDP2 every block's all-gather is a collective paired with the other ranks' by
    order, and a rank with images runs the vision tower before the language model: so the zero term
    runs there too (a pre-hook on the language model, inside the root's forward), never after it.
    """
    zero_needed = "pixel_values" not in inputs.model_kwargs and torch.is_grad_enabled()
    early: list[torch.Tensor | None] = []
    hook = None
    if zero_needed:
        from learner.parallel import is_fsdp

        lm = getattr(getattr(model, "model", None), "language_model", None)
        if is_fsdp(model) and lm is not None:
            def vision_first(*_: Any) -> None:  # returns None: the language model's inputs stay as they are
                early.append(zero_vision_term(model))

            hook = lm.register_forward_pre_hook(vision_first)
    try:
        with _head_in_place(model, head):
            out = model(**inputs.model_kwargs, logits_to_keep=inputs.rows.all_src, use_cache=False)
    finally:
        if hook is not None:
            hook.remove()
    logits = out.logits[0] if head is None else out.logits
    if zero_needed:
        zero = early[0] if early else zero_vision_term(model)
        if zero is not None:
            logits = logits + zero.to(logits.dtype)
    return logits


def forward_loss(model: torch.nn.Module, inputs: PackInputs, coord_ids: torch.Tensor, norm: Normaliser,
                 weights: LossWeights, loss_head: str = "plain", *, chunk_bytes: int | None = None) -> LossTerms:
    """One pack's packed forward and loss (``training.loss_head``); ``.backward`` is what to back-propagate.

    ``plain``: :func:`forward_rows` then :func:`learner.loss.pack_loss` on the ``[N, V]`` logits. ``chunked``:
    :func:`learner.loss.head_loss` on the LM head's input rows and weight, run inside the model's forward where
    the LM head would run (:func:`_head_in_place`), never making ``[N, V]`` logits; ``chunk_bytes`` caps its
    vocabulary slices (``learner.loss.CHUNK_BYTES``).
    """
    if loss_head == "plain":
        return pack_loss(forward_rows(model, inputs), inputs.rows, coord_ids, norm, weights)
    if loss_head != "chunked":
        raise ValueError(f"training.loss_head = {loss_head!r}: expected 'plain' or 'chunked'")
    made: list[LossTerms] = []

    def head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        made.append(head_loss(hidden, weight, inputs.rows, coord_ids, norm, weights, chunk_bytes=chunk_bytes))
        return made[-1].backward

    backward = forward_rows(model, inputs, head)  # the same scalar, plus the zero vision term of an image-less pack
    return dataclasses.replace(made[-1], backward=backward)


@contextlib.contextmanager
def _head_in_place(model: torch.nn.Module, head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
                   ) -> Iterator[None]:
    """While open, the LM head projects 0 rows and returns ``head(its input rows, its weight)`` instead.

    Why inside the LM head's call rather than on hidden states returned by the model: under FSDP2 the
    root's parameters (embeddings, norm, lm_head) are gathered only during the root's forward and,
    with ``reshard_after_forward``, freed after it; ``head`` sees the gathered weight there (the tied
    input embedding where the model ties them), and its result leaves the root as the output FSDP2
    hooks, so backward gathers the weight again before ``head``'s backward reads it. DDP and a plain
    model are indifferent to where it runs.
    """
    if head is None:
        yield
        return
    lm_head = getattr(model, "module", model).get_output_embeddings()
    rows: list[torch.Tensor] = []

    def take_rows(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        rows.append(args[0])
        return (args[0][:, :0], *args[1:])  # the projection itself runs on no rows

    def put_head(module: torch.nn.Module, _args: Any, _out: Any) -> torch.Tensor:
        return head(rows.pop()[0], module.weight)

    handles = [lm_head.register_forward_pre_hook(take_rows), lm_head.register_forward_hook(put_head)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def pack_limits(model: torch.nn.Module, packing_length: int, rope_rows: int | None,
                meta_counts: tuple[str, ...] = ()) -> PackLimits:
    """What this policy can take from a pack (``common.packing.segment.pack_rejection``): vocabulary, rope rows, images."""
    inner = getattr(model, "module", model)
    vocab = min(inner.get_input_embeddings().weight.shape[0], inner.get_output_embeddings().weight.shape[0])
    vis = vision_tower(model)
    patch_dim = merge = None
    if vis is not None:
        c = vis.config
        patch_dim, merge = c.in_channels * c.temporal_patch_size * c.patch_size ** 2, c.spatial_merge_size
    return PackLimits(packing_length=packing_length, vocab_size=int(vocab), rope_rows=rope_rows,
                      image_token_id=getattr(inner.config, "image_token_id", None) if vis is not None else None,
                      patch_dim=patch_dim, merge_size=merge or 1, meta_counts=meta_counts)


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The Qwen2/2.5/3-VL vision tower under a (possibly DDP-wrapped or FSDP2-sharded) policy, or None."""
    inner = getattr(getattr(model, "module", model), "model", None)
    return getattr(inner, "visual", None)


def zero_vision_term(model: torch.nn.Module) -> torch.Tensor | None:
    """0 × the sum of a one-image (2 × 2 merged patches, zeros) vision forward: a scalar 0 in the graph
    of every vision parameter. None for a policy without a vision tower.

    Under FSDP2 call it inside the root's forward (:func:`forward_rows` does): the tower's own
    parameters are then gathered, and its blocks gather theirs through their hooks."""
    vis = vision_tower(model)
    if vis is None:
        return None
    cfg = vis.config
    m = cfg.spatial_merge_size
    p = next(vis.parameters())
    pixels = torch.zeros(m * m, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2, device=p.device,
                         dtype=p.dtype)
    out = vis(pixels, grid_thw=torch.tensor([[1, m, m]], device=p.device))
    # a tensor, a ModelOutput (transformers >= 5.2x: pre- and post-merger states) or a tuple; Qwen3-VL's output
    # also holds a list of deepstack features, the only path through its deepstack mergers, so lists are opened
    parts = [out] if isinstance(out, torch.Tensor) else list(out.values() if hasattr(out, "values") else out)
    parts = [t for p in parts for t in (p if isinstance(p, (list, tuple)) else [p]) if isinstance(t, torch.Tensor)]
    return torch.stack([t.float().sum() for t in parts]).sum() * 0.0


# --------------------------------------------------------------------------------------------- optimizer


FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # torch's fused AdamW kernels


def adamw_fused(params: list[torch.nn.Parameter], impl: str) -> bool:
    """``training.adamw_impl``: fused, foreach, or auto = fused where torch has the kernel for every parameter
    (CUDA or CPU, a floating dtype; FSDP2 shards count by their local tensors' device)."""
    if impl != "auto":
        return impl == "fused"
    return bool(params) and all(p.device.type in ("cuda", "cpu") and p.dtype in FUSED_DTYPES for p in params)


def build_optimizer(model: torch.nn.Module, training: Any) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over trainable parameters, one parameter group per module group (``learner.recipe.param_groups``:
    ``training.lr_groups``), and a linear-warmup + cosine schedule to ``min_lr_ratio ·`` each group's lr (LambdaLR
    multiplies every group's own initial lr by the same factor)."""
    from learner.recipe import param_groups

    groups = param_groups(model, training)
    params = [p for g in groups for p in g["params"]]
    fused = adamw_fused(params, training.adamw_impl)
    optimizer = torch.optim.AdamW(groups, lr=training.lr, weight_decay=training.weight_decay,
                                  **({"fused": True} if fused else {"foreach": True}))
    warmup, total, floor = training.warmup_steps, max(1, training.max_steps), training.min_lr_ratio

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_and_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, max_grad_norm: float,
    *, loss_finite: bool = True,
) -> float:
    """Clip (if ``max_grad_norm`` > 0), step, zero; returns the pre-clip gradient norm.

    A non-finite gradient norm, or ``loss_finite`` False, skips the update: the gradients are zeroed; the
    weights, the optimizer state and the LR schedule stay as they were (so no NaN reaches a sync or a
    checkpoint). The caller tells a skip by ``loss_finite`` and ``math.isfinite`` of the returned norm. The norm is
    the same on every rank, so every rank makes the same choice: under DDP the gradients were all-reduced; under
    FSDP2 they are shards (DTensors), and the norm is their all-reduced total (``full_tensor``).
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        norm = 0.0
    elif max_grad_norm > 0 and loss_finite:
        norm = _full_float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    else:
        norm = _full_float(torch.nn.utils.get_total_norm([p.grad for p in params]))
    if loss_finite and math.isfinite(norm):
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _full_float(norm: torch.Tensor) -> float:
    """A gradient norm as a float: a DTensor (FSDP2 shards) is reduced over the ranks first."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)
