"""Weight tensors on both ends of a sync: names, manifest, fingerprint, safetensors buckets.

Imported by the learner-side sender (:mod:`rollout_server.sync_client`) and by the engines, so the
two sides compute names and fingerprints with the same code. Imports torch and safetensors only
(no fastapi, no transformers): the learner can use it without the server's dependencies.

A bucket on the wire is one safetensors blob (the ``POST /sync/bucket`` body) plus a JSON
:class:`common.protocol.SyncBucketHeader` (the ``X-Tandem-Bucket`` header) that repeats its layout,
so the server can check the declaration against the bytes before staging anything. No pickle.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Iterator

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from common.protocol import SYNC_DTYPE_BYTES, TensorSpec

#: safetensors dtype codes <-> torch dtype names used by the protocol.
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
              "I64": "int64", "I32": "int32", "U8": "uint8"}

#: Elements sampled per tensor by :func:`fingerprint` (evenly spaced, first and last included).
FINGERPRINT_SAMPLES = 4096


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16 -> "bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16" -> torch.bfloat16``; ValueError for names outside the protocol's list."""
    if name not in SYNC_DTYPE_BYTES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(SYNC_DTYPE_BYTES)}")
    return getattr(torch, name)


def hf_name(name: str) -> str:
    """The HF module's own parameter name: drop DDP's ``module.`` prefix and torch.compile's
    ``_orig_mod.`` wherever it sits (``module._orig_mod.model.x`` -> ``model.x``)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name.replace("_orig_mod.", "")


def manifest_of(model: torch.nn.Module) -> tuple[list[TensorSpec], list[list[str]]]:
    """Served parameters (tied groups once, under their first name) and the tied groups.

    The first name of a group is the one ``named_parameters()`` keeps, which is the same on the
    learner's copy of the architecture.
    """
    by_storage: dict[int, list[str]] = {}
    params: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = hf_name(name)
        by_storage.setdefault(id(p), []).append(name)
        params.setdefault(name, p)
    manifest, tied = [], []
    for names in by_storage.values():
        p = params[names[0]]
        manifest.append(TensorSpec(name=names[0], dtype=dtype_name(p.dtype), shape=list(p.shape)))
        if len(names) > 1:
            tied.append(names)
    return manifest, tied


def fingerprint(named: Iterable[tuple[str, torch.Tensor]], dtypes: dict[str, str] | None = None) -> str:
    """A cheap deterministic hash over weights: name, dtype, shape and a fixed sample of values.

    Samples :data:`FINGERPRINT_SAMPLES` evenly spaced elements per tensor (raw bytes, no float
    arithmetic), so it costs O(#tensors), is identical on CPU and GPU for the same values, and
    changes with any re-initialisation or training step. It is a check that both sides hold the
    same weights, not a proof: a change confined to unsampled elements goes unseen.

    ``dtypes`` (name -> dtype name) hashes each tensor as if cast to that dtype first (the learner
    fingerprints what the server will hold without casting whole tensors).
    """
    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted(named, key=lambda kv: kv[0]):
        t = t.detach()
        flat = t.reshape(-1)
        n = flat.numel()
        if n > FINGERPRINT_SAMPLES:
            idx = torch.linspace(0, n - 1, FINGERPRINT_SAMPLES, device=flat.device).round().long()
            flat = flat[idx]
        dtype = dtypes.get(name) if dtypes else None
        if dtype is not None and t.is_floating_point():
            flat = flat.to(torch_dtype(dtype))
        h.update(f"{name}|{dtype_name(flat.dtype)}|{list(t.shape)}|".encode())
        h.update(flat.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def encode_bucket(tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[tuple[str, str, list[int], tuple[int, int]]]]:
    """One safetensors blob and its layout ``[(name, dtype, shape, (begin, end))]`` (data offsets).

    Tensors must already be CPU, contiguous, in their serving dtype, and not share storage.
    """
    blob = st_save(tensors)
    return blob, bucket_layout(blob)


def bucket_layout(blob: bytes) -> list[tuple[str, str, list[int], tuple[int, int]]]:
    """The layout a safetensors blob declares in its own header; ValueError if it is not one."""
    if len(blob) < 8:
        raise ValueError(f"body of {len(blob)} bytes is not a safetensors blob (needs an 8-byte header length)")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise ValueError(f"safetensors header claims {n} bytes, body has {len(blob) - 8}")
    try:
        header = json.loads(blob[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    layout = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[entry["dtype"]]
            begin, end = entry["data_offsets"]
            layout.append((name, dtype, list(entry["shape"]), (int(begin), int(end))))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"safetensors entry {name!r} has an unsupported dtype or malformed layout: {entry!r}") from None
    layout.sort(key=lambda e: e[3][0])
    return layout


def decode_bucket(blob: bytes) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors blob (copies owned by the caller); ValueError if malformed."""
    try:
        return st_load(blob)
    except Exception as exc:  # safetensors raises its own SafetensorError type
        raise ValueError(f"body is not a readable safetensors blob: {exc}") from None


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Group tensors in order into dicts of at most ``bucket_bytes`` (a bigger tensor goes alone)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket
