"""Fast weight loading: a model's own weight loaders, recorded once as a list of copies, then replayed.

Why: vLLM's ``update_weights`` runs every received tensor through the model's Python weight loaders
under the layerwise-reload wrappers (~0.2 ms of host work per tensor), so a sync costs 0.13-0.16 s
whatever its size while NVLink moves a 7B model in ~40 ms (docs/benchmarks.md). For an unquantized
model those loaders only *place* bytes: fused q/k/v and gate/up rows, tensor-parallel slices, zeroed
vocabulary padding. The placement depends on the layout of the stream (names, shapes, dtypes,
chunking), not on the values, so it can be captured once and replayed as plain tensor copies.

How a plan is recorded (:func:`record_plan`): the loader is called on views of the receive buffers
(their contents do not matter) under a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that
intercepts every aten op writing into a parameter or buffer of the model and does NOT execute it:

* ``copy_(param_view, src)`` with ``src`` a view of a receive buffer -> a recorded copy;
* ``fill_`` / ``zero_`` of a parameter view -> a recorded fill (e.g. vocabulary padding);
* an op that reads received bytes and makes a new tensor (``contiguous`` of a permuted view, ``cat``,
  a dtype cast: vLLM's conv patch-embedding loader does this) -> a recorded *compute* step, replayed
  into the same output tensor each sync, so a later copy from it is a copy from received bytes too
  (such intermediates stay allocated: at most :data:`MAX_DERIVED_BYTES`);
* anything else that writes model storage (arithmetic into a parameter, ``index_copy_``, a copy
  from a tensor not derived from received bytes, ``param.data = ...`` rebinding), or a loader that
  branches on received values (``item()``) -> :class:`PlanError`, and the caller keeps the native
  path. So a loader whose effect a replay cannot reproduce is refused, never replayed wrongly.

Every written parameter must be covered exactly (written elements == its size, checked with a mask
where writes overlap); parameters the stream never touches are counted and reported.

A plan is replayed by :class:`rollout_server.engines.vllm.fast_loader.FastLoader` (receive buffers, CUDA streams
and graphs, deadlines).

What this module does not know: vLLM, CUDA streams, or how bytes arrive. It takes a model, a
``load_fn`` (``model.load_weights``) and buffers to record against.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.weight_sync import weights as W

log = logging.getLogger(__name__)

_FILLS = {torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default}
#: Ops that hand received values to Python: a loader branching on them cannot be replayed.
_READS_VALUES = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                 torch.ops.aten.equal.default}
#: Intermediate tensors a plan may keep (outputs of recorded compute steps), per worker.
MAX_DERIVED_BYTES = 1 << 30


class PlanError(RuntimeError):
    """The model's loaders do more than place bytes (or the layout changed): use the native path."""


@dataclass(frozen=True)
class ChunkLayout:
    """Tensors of one packed broadcast: names, dtypes, shapes and byte ranges within the chunk."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    spans: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return self.spans[-1][1]


def chunk_layouts(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                  offsets: Sequence[Sequence[int]], bucket_bytes: int) -> list[ChunkLayout]:
    """Cut an announced stream (``SyncBucketHeader`` fields) into chunks by the shared packing rule."""
    sizes = [int(e) - int(b) for b, e in offsets]
    out = []
    for idx in W.packed_chunks(sizes, bucket_bytes):
        spans, pos = [], 0
        for i in idx:
            spans.append((pos, pos + sizes[i]))
            pos += sizes[i]
        out.append(ChunkLayout(tuple(names[i] for i in idx), tuple(dtypes[i] for i in idx),
                               tuple(tuple(int(d) for d in shapes[i]) for i in idx), tuple(spans)))
    return out


def layout_key(layouts: Sequence[ChunkLayout]) -> str:
    """Identity of a stream layout: a plan is valid for exactly one."""
    raw = json.dumps([[c.names, c.dtypes, c.shapes, c.spans] for c in layouts]).encode()
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


def stream_key(layout: dict[str, Any]) -> str:
    """Identity of an announced stream (names, dtypes, shapes, offsets, bucket size) before it is cut.

    Cheaper than :func:`layout_key` (no chunking): the engine compares it across syncs to decide that
    every worker already holds a plan, and a worker to skip re-cutting a stream it has seen.
    """
    raw = json.dumps([list(layout["names"]), list(layout["dtypes"]), [list(x) for x in layout["shapes"]],
                      [list(x) for x in layout["offsets"]], int(layout["bucket_bytes"])]).encode()
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


def chunk_views(buf: torch.Tensor, layout: ChunkLayout) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of a uint8 receive buffer holding ``layout``."""
    return [(n, buf[b:e].view(W.torch_dtype(d)).view(s))
            for n, d, s, (b, e) in zip(layout.names, layout.dtypes, layout.shapes, layout.spans)]


# ---------------------------------------------------------------------------------------- recording


def storage_of(t: torch.Tensor) -> int:
    """Identity of the memory a tensor views (its storage's data pointer)."""
    return t.untyped_storage().data_ptr()


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors an aten op writes in place (``Tensor(a!)`` arguments, ``out=`` included)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        val = args[i] if i < len(args) else kwargs.get(arg.name)
        vals = val if isinstance(val, (list, tuple)) else [val]
        out.extend(v for v in vals if isinstance(v, torch.Tensor))
    return out


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in an op's arguments or result (nested lists, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


def _caller() -> str:
    """The innermost Python frame outside torch and this module: the loader line that issued an op."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        f = frame.filename.replace("\\", "/")
        if "/torch/" not in f and frame.filename != __file__:
            return f"{'/'.join(f.split('/')[-3:])}:{frame.lineno} {frame.name}"
    return "?"


class _Recorder(TorchDispatchMode):
    """Runs a loader with every write into model storage recorded instead of executed.

    ``sources`` grows: the storage of every tensor computed from received bytes joins it, so a copy
    from such a tensor is replayable once the compute step that made it is replayed first.
    """

    def __init__(self, targets: dict[int, str], sources: set[int], derived_bytes: int = 0) -> None:
        super().__init__()
        self.targets, self.sources = targets, sources
        self.ops: list[tuple] = []  # ("copy", dst, src) | ("fill", dst, value) | ("compute"|"call", ...)
        self.error: str | None = None
        self.derived_bytes = derived_bytes
        self.derived_by: dict[str, int] = {}  # op -> bytes it materialised (named in the refusal)
        self.derived_at: dict[str, str] = {}  # op -> the loader code that first issued it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        hits = [t for t in written if storage_of(t) in self.targets]
        if hits:
            return self._model_write(func, args, hits)
        inputs = tensors_in(args) + tensors_in(kwargs)
        if not any(storage_of(t) in self.sources for t in inputs):
            return func(*args, **kwargs)  # nothing received flows in: same result every sync
        if func in _READS_VALUES:
            self._refuse(f"the loader reads received values ({func}) and may branch on them")
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if written:  # in place into a scratch tensor (e.g. empty() then copy_ of received bytes): replay the call
            self.ops.append(("call", func, args, kwargs))
            self._derive(func, [t for t in written if storage_of(t) not in self.sources])
        else:  # a new tensor computed from received bytes (views need nothing: they alias)
            fresh = [t for t in tensors_in(out) if storage_of(t) not in {storage_of(i) for i in inputs}]
            if fresh:
                self.ops.append(("compute", func, args, kwargs, out))
                self._derive(func, fresh)
        return out

    def _derive(self, func: Any, tensors: list[torch.Tensor]) -> None:
        """``tensors`` now hold received bytes each replay: copies from them are replayable."""
        for t in tensors:
            if storage_of(t) in self.sources:
                continue
            self.sources.add(storage_of(t))
            self.derived_bytes += t.untyped_storage().nbytes()
            self.derived_by[str(func)] = self.derived_by.get(str(func), 0) + t.untyped_storage().nbytes()
            if str(func) not in self.derived_at:
                self.derived_at[str(func)] = _caller()
        if self.derived_bytes > MAX_DERIVED_BYTES:
            top = sorted(self.derived_by.items(), key=lambda kv: -kv[1])[:3]
            where = "; ".join(f"{k} first at {self.derived_at[k]}" for k, _ in top if k in self.derived_at)
            self._refuse(f"the loader materialises over {MAX_DERIVED_BYTES >> 20} MB of intermediate tensors "
                         f"(this chunk, by op: {', '.join(f'{k} {v >> 20} MB' for k, v in top)}; {where})")

    def _model_write(self, func: Any, args: tuple, hits: list[torch.Tensor]) -> Any:
        name = self.targets[storage_of(hits[0])]
        if func is torch.ops.aten.copy_.default:
            src = args[1]
            if isinstance(src, torch.Tensor) and storage_of(src) in self.sources:
                self.ops.append(("copy", args[0], src))
                return args[0]
            what = (f"{src.dtype} {tuple(src.shape)} on {src.device}" if isinstance(src, torch.Tensor)
                    else type(src).__name__)
            self._refuse(f"{name!r} is written from a tensor not derived from received bytes ({what})")
        elif func in _FILLS:
            value = 0 if func is torch.ops.aten.zero_.default else args[1]
            if isinstance(value, torch.Tensor):
                value = value.item()
            self.ops.append(("fill", args[0], value))
            return args[0]
        else:
            self._refuse(f"{name!r} is written by {func} (not a copy or a fill)")
        return args[0]  # refused: skip the write, the caller raises after the loader returns

    def _refuse(self, why: str) -> None:
        if self.error is None:
            self.error = why


@dataclass
class LoadPlan:
    """Per chunk, the ops to replay after it arrives; plus what was checked when it was recorded."""

    key: str
    layouts: list[ChunkLayout]
    ops: list[list[tuple]]
    storages: dict[str, int]
    n_copies: int = 0
    n_fills: int = 0
    n_computes: int = 0
    derived_bytes: int = 0
    written: list[str] = field(default_factory=list)
    untouched: list[str] = field(default_factory=list)
    record_s: float = 0.0
    graphs: list[Any] | None = None  # one CUDA graph per chunk (None: an empty chunk), or replay op by op
    graph_note: str = "eager"  # "cuda graphs" or why the ops are issued one by one

    def summary(self) -> dict[str, Any]:
        return {"key": self.key, "chunks": len(self.layouts), "copies": self.n_copies, "fills": self.n_fills,
                "computes": self.n_computes, "derived_bytes": self.derived_bytes,
                "params_written": len(self.written), "params_untouched": len(self.untouched),
                "untouched": self.untouched[:8], "record_s": round(self.record_s, 4), "graphs": self.graph_note}


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, each storage once (what a plan may write)."""
    named = dict(model.named_parameters(remove_duplicate=True))
    for n, b in model.named_buffers(remove_duplicate=True):
        if b is not None and n not in named:
            named[n] = b
    return named


def _snapshot(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor, int]]:
    """Who owns what: (module, attr, tensor object, its data alias, data_ptr), to undo a rebinding."""
    out = []
    for mod in model.modules():
        for attr, t in list(mod._parameters.items()) + list(mod._buffers.items()):
            if t is not None:
                out.append((mod, attr, t, t.data, t.data_ptr()))
    return out


def _restore(snap: list) -> list[str]:
    """Put back any tensor a loader rebound; names what it had to restore."""
    fixed = []
    for mod, attr, t, data, ptr in snap:
        current = mod._parameters.get(attr, mod._buffers.get(attr))
        if current is not t:
            (mod._parameters if attr in mod._parameters else mod._buffers)[attr] = t
            fixed.append(f"{type(mod).__name__}.{attr} (replaced)")
        if t.data_ptr() != ptr:
            t.data = data
            fixed.append(f"{type(mod).__name__}.{attr} (.data rebound)")
    return fixed


def record_plan(model: torch.nn.Module, load_fn: Callable[[list[tuple[str, torch.Tensor]]], Any],
                layouts: list[ChunkLayout], buffers: list[torch.Tensor]) -> LoadPlan:
    """Dry-run ``load_fn`` chunk by chunk on views of ``buffers``; the model is left untouched.

    Raises :class:`PlanError` naming the first parameter whose loader is not a pure placement, a
    parameter whose elements are not all covered, or a loader that rebinds a tensor (undone first).
    """
    t0 = time.perf_counter()
    tensors = model_tensors(model)
    targets = {storage_of(t): n for n, t in tensors.items()}
    sources = {storage_of(b) for b in buffers}
    snap = _snapshot(model)
    ops: list[list[tuple]] = []
    derived = 0
    try:
        for k, layout in enumerate(layouts):
            rec = _Recorder(targets, sources, derived)
            with torch.no_grad(), rec:
                load_fn(chunk_views(buffers[k % len(buffers)], layout))
            if rec.error:
                raise PlanError(rec.error)
            ops.append(rec.ops)
            derived = rec.derived_bytes
    finally:
        fixed = _restore(snap)
    if fixed:
        raise PlanError(f"the loader rebinds model tensors instead of writing them: {fixed[:3]}")
    counts: dict[int, int] = {}
    dsts: dict[int, list[torch.Tensor]] = {}
    for chunk_ops in ops:
        for kind, dst, *_ in chunk_ops:
            if kind not in ("copy", "fill"):
                continue
            counts[storage_of(dst)] = counts.get(storage_of(dst), 0) + dst.numel()
            dsts.setdefault(storage_of(dst), []).append(dst)
    written, untouched = [], []
    for name, t in tensors.items():
        got = counts.get(storage_of(t))
        if got is None:
            untouched.append(name)
            continue
        written.append(name)
        if got != t.numel() and not _covers(t, dsts[storage_of(t)]):
            raise PlanError(f"{name!r}: the loader writes {got} of its {t.numel()} elements; a replay would leave "
                            f"stale values")
    flat = [op for chunk_ops in ops for op in chunk_ops]
    return LoadPlan(key=layout_key(layouts), layouts=list(layouts), ops=ops,
                    storages={n: storage_of(t) for n, t in tensors.items()},
                    n_copies=sum(op[0] == "copy" for op in flat), n_fills=sum(op[0] == "fill" for op in flat),
                    n_computes=sum(op[0] in ("compute", "call") for op in flat), derived_bytes=derived,
                    written=written, untouched=untouched, record_s=time.perf_counter() - t0)


def _covers(t: torch.Tensor, views: list[torch.Tensor]) -> bool:
    """Exact check for overlapping writes: every element of ``t`` is in some view."""
    mask = torch.zeros(t.untyped_storage().nbytes() // t.element_size(), dtype=torch.bool, device=t.device)
    for v in views:
        mask.as_strided(v.size(), v.stride(), v.storage_offset()).fill_(True)
    return bool(mask.as_strided(t.size(), t.stride(), t.storage_offset()).all())


__all__ = ["ChunkLayout", "LoadPlan", "PlanError", "chunk_layouts", "chunk_views", "layout_key", "model_tensors",
           "record_plan", "storage_of", "stream_key", "tensors_in"]
