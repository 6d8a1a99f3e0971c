"""``model.attn_implementation: varlen``: one variable-length attention call per layer, no ``[T, T]`` mask.

Where the segment boundaries come from (transformers 5.17-5.24, Qwen2/2.5/3-VL)::

    vision tower   grid_thw ─► cu_seqlens (images) / cu_window_seqlens (windows) ──► each block's attention
                   passes them as ``cu_seq_lens_q/k`` + ``max_length_q/k`` ONLY to implementations whose
                   name contains "flash" (``is_flash_attention_requested``); any other name gets one
                   attention call per window (13,668 a backward pass at 12000 tokens of 1024-px images:
                   docs/benchmarks.md section 20)
    language model pack_inputs' position_ids row 0 (text positions, 0 at every segment start) ──►
                   ``position_ids`` of each decoder layer's attention call; no mask is built, since the
                   name is not in transformers' mask registry (``ALL_MASK_ATTENTION_FUNCTIONS``)

So the function is registered in ``transformers.AttentionInterface`` under :data:`HF_NAME`, a name with
"flash" in it. Loading (``from_pretrained``/``set_attn_implementation``) with such a name makes transformers
look for a flash-attn package or a hub kernel, neither of which exists here, so :func:`apply` loads with
sdpa and then sets the config's implementation (see the NOTE there).

The kernel is torch's own ``torch.nn.attention.varlen.varlen_attn`` (flash attention in torch >= 2.10, CUDA,
no flash-attn build). On the CPU, and for dtypes the kernel lacks (float32), :func:`reference_varlen` runs
one sdpa call per segment: the same arithmetic, slower, so CPU tests exercise this module end to end.

Only packed training forwards come here (the learner never generates): no KV cache, no padding mask;
anything else is refused with the fix. What this module does not know: packs, losses, or configs.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

#: ``model.attn_implementation`` value that selects this module.
VARLEN = "varlen"
#: The name in transformers' registry; "flash" in it routes the vision tower's cu_seqlens here (module doc).
HF_NAME = "tandem_flash_varlen"
#: Implementations that isolate packed segments without a ``[T, T]`` mask (pack_inputs builds none for them).
MASKLESS = ("flash_attention_2", VARLEN)

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def load_name(attn_implementation: str) -> str:
    """The ``attn_implementation`` to pass to ``from_pretrained``: sdpa for varlen (set by :func:`apply`)."""
    return "sdpa" if attn_implementation == VARLEN else attn_implementation


def apply(model: torch.nn.Module, attn_implementation: str) -> None:
    """Switch a loaded model to varlen attention when ``attn_implementation`` is :data:`VARLEN` (else nothing)."""
    if attn_implementation != VARLEN:
        return
    register()
    # NOTE: the config setter, not model.set_attn_implementation: the latter runs transformers'
    # _check_and_adjust_attn_implementation, which for any name containing "flash" calls
    # lazy_import_flash_attention and fails without the flash-attn package or a hub kernel (transformers 5.17-5.24).
    # The setter recurses into text_config and vision_config, which the submodules share by reference.
    model.config._attn_implementation = HF_NAME


def register() -> None:
    """Add :func:`varlen_attention_forward` to transformers' attention registry (idempotent)."""
    from transformers import AttentionInterface  # heavy: deferred

    AttentionInterface.register(HF_NAME, varlen_attention_forward)


# --------------------------------------------------------------------------------------------- the call


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query [1, Hq, T, D]``, ``key``/``value [1, Hkv, T, D]`` →
    ``([1, T, Hq, D], None)``.

    Segments: ``cu_seq_lens_q`` when the caller gives them (the vision tower), else the starts of the text
    positions in ``position_ids`` (0 begins a segment: pack_inputs' row 0), else one segment.
    Causal unless the module says otherwise (vision attention sets ``is_causal = False``).
    """
    if attention_mask is not None:
        raise ValueError(
            f"{HF_NAME}: got an attention mask; varlen attention isolates packed segments by position ids and "
            "supports no padding. Fix: pass packed inputs without attention_mask (learner.model.pack_inputs does), "
            "or use model.attn_implementation: sdpa"
        )
    if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise ValueError(
            f"{HF_NAME}: query {tuple(query.shape)} / key {tuple(key.shape)}: only one packed row without a KV cache "
            "is supported (training forwards). Fix: use model.attn_implementation: sdpa for generation"
        )
    if dropout:
        raise ValueError(f"{HF_NAME}: attention dropout {dropout} is not supported. Fix: set it to 0 in the model config")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if cu_seq_lens_q is not None:
        cu = cu_seq_lens_q.to(torch.int32)
        max_len = int(max_length_q) if max_length_q is not None else int((cu[1:] - cu[:-1]).max())
    else:
        cu, max_len = segments_from_positions(position_ids, query.shape[2], query.device)
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [T, H, D]: the varlen layout
    if q.is_cuda and q.dtype in _KERNEL_DTYPES:
        out = torch_varlen(q, k, v, cu, max_len, causal, scaling)
    else:
        out = reference_varlen(q, k, v, cu, causal, scaling)
    return out[None], None


def torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, causal: bool,
                 scale: float | None) -> torch.Tensor:
    """torch's ``varlen_attn`` over ``[T, H, D]``, across its keyword changes (2.10: ``is_causal``; 2.11+:
    ``window_size=(-1, 0)`` means causal, ``scale``, ``enable_gqa``)."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    kwargs: dict[str, Any] = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    if scale is not None and "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None:
        q = q * (scale * q.shape[-1] ** 0.5)  # the kernel's default is 1/sqrt(D)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


@torch.compiler.disable  # host-read boundaries: compiled, a checkpointed layer's recomputation saved other tensors
def reference_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, causal: bool,
                     scale: float | None) -> torch.Tensor:
    """The same result as :func:`torch_varlen` from one sdpa call per segment (CPU, float32, tests)."""
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale,
                                           enable_gqa=ks.shape[0] != qs.shape[0])
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0)


@torch.compiler.disable  # host syncs and a module-level cache: always eager, also inside compiled layers
def segments_from_positions(position_ids: torch.Tensor | None, length: int,
                            device: torch.device) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens int32, longest segment)`` from text positions that restart at 0 in every segment.

    Every decoder layer (and its recomputation under gradient checkpointing) gets the same ``position_ids``
    tensor, so the last answer is kept: one host sync per pack, not one per layer.
    """
    global _last
    if position_ids is None:
        return torch.tensor([0, length], dtype=torch.int32, device=device), length
    if _last is not None and _last[0] is position_ids and _last[1] == position_ids._version:
        return _last[2], _last[3]
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError(f"{HF_NAME}: the text positions of a pack must start at 0 (got {pos[:8].tolist()}...). "
                         "Fix: build the inputs with learner.model.pack_inputs")
    ends = torch.cat([starts, torch.tensor([pos.numel()], device=pos.device)])
    cu = ends.to(torch.int32)
    max_len = int((ends[1:] - ends[:-1]).max())
    _last = (position_ids, position_ids._version, cu, max_len)
    return cu, max_len


_last: tuple[torch.Tensor, int, torch.Tensor, int] | None = None


def _varlen_params() -> frozenset[str]:
    global _params
    if _params is None:
        from torch.nn.attention.varlen import varlen_attn

        _params = frozenset(inspect.signature(varlen_attn).parameters)
    return _params


_params: frozenset[str] | None = None
