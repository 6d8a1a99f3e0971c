"""Packed buckets: tensors laid end to end in one flat byte buffer, the unit every weight-sync transport moves.

    layout = packed_layout(planned, dtypes)          # [(name, dtype, shape, (begin, end))], no gaps
    pack_into(out, planned, layout)                   # cast + copy each tensor into its span of ``out``
    tensors = unpack(buf, names, dtypes, shapes, offsets)   # views (no copy) of a received buffer

One layout rule for every transport: HTTP bodies (``POST /sync/bucket``), CUDA-IPC / shared-memory
buffers (``/sync/ipc``) and NCCL broadcasts all carry tensors at the offsets
:func:`common.weight_sync.weights.packed_offsets` gives, cut into buckets by
:func:`common.weight_sync.weights.packed_chunks`, so a server that recorded a copy plan for one stream
layout replays it whatever carried the bytes. No per-tensor header in the bytes and no text
encoding: the layout travels as JSON beside them (:class:`common.weight_sync.messages.SyncBucketHeader`).

Imports torch only; the learner and the server use the same functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.weight_sync.messages import SYNC_DTYPE_BYTES
from common.weight_sync import weights as W

Span = tuple[int, int]
Entry = tuple[str, str, list[int], Span]


def packed_layout(planned: Sequence[tuple[str, torch.Tensor]], dtypes: dict[str, str]) -> list[Entry]:
    """``[(name, serving dtype, shape, (begin, end))]`` of ``planned`` laid end to end from byte 0."""
    specs = [(dtypes[n], list(t.shape)) for n, t in planned]
    return [(n, d, s, span) for (n, _), (d, s), span in zip(planned, specs, W.packed_offsets(specs))]


def bucket_plan(planned: Sequence[tuple[str, torch.Tensor]], dtypes: dict[str, str],
                bucket_bytes: int) -> list[list[Entry]]:
    """The stream cut into buckets by the shared rule (:func:`~common.weight_sync.weights.packed_chunks`);
    each bucket's offsets start at 0."""
    whole = packed_layout(planned, dtypes)
    out = []
    for idx in W.packed_chunks([e - b for _, _, _, (b, e) in whole], bucket_bytes):
        base = whole[idx[0]][3][0]
        out.append([(n, d, s, (b - base, e - base)) for n, d, s, (b, e) in (whole[i] for i in idx)])
    return out


def nbytes_of(layout: Sequence[Entry]) -> int:
    return layout[-1][3][1] if layout else 0


def pack_into(out: torch.Tensor, tensors: Sequence[torch.Tensor], layout: Sequence[Entry]) -> None:
    """Copy each tensor, cast to its layout dtype, into its span of the flat uint8 ``out``.

    ``out`` may live on another device than the tensors (GPU weights into a pinned host buffer, or into a
    CUDA buffer shared by IPC): the copy casts and moves in one step per tensor, no intermediate.
    """
    for t, (name, dtype, shape, (b, e)) in zip(tensors, layout):
        dst = out[b:e].view(W.torch_dtype(dtype)).view(shape)
        dst.copy_(t.detach(), non_blocking=out.device.type == "cuda" or out.is_pinned())


def check_layout(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                 offsets: Sequence[Sequence[int]], nbytes: int) -> None:
    """ValueError unless the spans tile ``[0, nbytes)`` in order, each as long as its dtype and shape need.

    The header model checks each span's length; this checks they are packed (no gap, no overlap, no
    byte of the buffer outside a tensor), so a buffer cannot smuggle data past the declared tensors.
    """
    pos = 0
    for name, dtype, shape, (b, e) in zip(names, dtypes, shapes, offsets):
        if b != pos:
            raise ValueError(f"{name!r} starts at byte {b}, expected {pos}: tensors are packed end to end from 0 "
                             "(common/weight_sync/packed.py)")
        need = SYNC_DTYPE_BYTES[dtype]
        for d in shape:
            need *= int(d)
        if e - b != need:
            raise ValueError(f"{name!r}: span of {e - b} bytes, {dtype} {list(shape)} needs {need}")
        pos = e
    if pos != nbytes:
        raise ValueError(f"the tensors declared end at byte {pos}, the body has {nbytes} bytes")


def unpack(buf: torch.Tensor, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
           offsets: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """Tensors viewing the flat uint8 ``buf`` (no copy; they keep ``buf`` alive). Checks the layout first.

    A span whose start is not a multiple of its element size (mixed dtypes laid end to end) is copied
    once, as a view of it could not be typed.
    """
    check_layout(names, dtypes, shapes, offsets, buf.numel())
    out = {}
    for name, dtype, shape, (b, e) in zip(names, dtypes, shapes, offsets):
        raw = buf[b:e] if b % SYNC_DTYPE_BYTES[dtype] == 0 else buf[b:e].clone()
        out[name] = raw.view(W.torch_dtype(dtype)).view([int(d) for d in shape])
    return out


def from_bytes(data: bytearray | memoryview) -> torch.Tensor:
    """A flat uint8 tensor sharing ``data``'s memory (a received body, no copy)."""
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)


__all__ = ["Entry", "bucket_plan", "check_layout", "from_bytes", "nbytes_of", "pack_into", "packed_layout", "unpack"]
