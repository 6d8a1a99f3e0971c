"""Replaying copy plans (:mod:`rollout_server.engines.vllm.load_plan`) as weights arrive: buffers, streams, graphs.

Chunk ``k`` of a stream is received into slot ``k % NUM_BUFFERS`` of persistent buffers; on CUDA the
receive runs on one stream and the chunk's copies on another, so copying chunk ``k`` overlaps
receiving chunk ``k + 1`` and a slot is reused only once its copies are done (events). On CUDA each
chunk's ops are also captured once into a CUDA graph (capturing runs nothing), so a replay is one
graph launch per chunk instead of one Python-issued kernel per tensor (~850 copies at an estimated
~5 us of host time each are about what NVLink needs for a 2 GB model). A capture that fails leaves
the plan replayed op by op (``summary()["graphs"]`` says which). Every host wait polls against a
deadline.

When no plan can be made while the stream is already on its way (:meth:`FastLoader.receive_direct`),
the chunks are received into the same buffers and handed to the model's own loader, so the peers of
the collective are never left waiting.

What this module does not know: vLLM. It takes a model, a ``load_fn`` (``model.load_weights``) and a
``broadcast(buffer, stream)`` callable; ``rollout_server/engines/vllm/extension.py`` binds them inside
vLLM's workers, and tests bind them to plain modules and gloo.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from rollout_server.engines.vllm.load_plan import (ChunkLayout, LoadPlan, PlanError, chunk_views, layout_key, model_tensors,
                                      record_plan, storage_of, tensors_in)

log = logging.getLogger(__name__)

#: Receive slots (as vLLM's packed consumer: chunk k+1 arrives while chunk k is copied).
NUM_BUFFERS = 2
_ALIGN = 64  # bytes: every slot can be viewed as any protocol dtype


def _replay(ops: list[tuple]) -> None:
    """One chunk's recorded ops, in order (also what a CUDA graph captures)."""
    for op in ops:
        kind = op[0]
        if kind == "copy":
            op[1].copy_(op[2])
        elif kind == "fill":
            op[1].fill_(op[2])
        elif kind == "compute":  # recompute from this sync's bytes into the tensor later ops read
            _, func, args, kwargs, out = op
            for old, new in zip(tensors_in(out), tensors_in(func(*args, **kwargs))):
                old.copy_(new)
        else:  # "call": in place on such an intermediate
            op[1](*op[2], **op[3])


def _wait(event: Any, deadline: float, what: str) -> None:
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited past the sync deadline for {what}; learner rank 0 is gone or stuck")
        time.sleep(0.0002)


class FastLoader:
    """Persistent receive buffers + the plan for the current layout, for one model on one device.

    ``prepare(layouts)`` is cheap once a plan exists (a key compare and a storage check); the first
    time, or when the layout or the model's storage changed, it records a new plan (~the cost of one
    native load, no weights written) and, on CUDA, captures its graphs. ``receive(broadcast,
    deadline)`` runs one sync.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device,
                 load_fn: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None) -> None:
        self.model, self.device = model, torch.device(device)
        self.load_fn = load_fn or model.load_weights  # type: ignore[operator]
        self.plan: LoadPlan | None = None
        self.buffers: list[torch.Tensor] = []
        self.use_graphs = self.device.type == "cuda"
        self._streams: tuple[Any, Any] | None = None

    def _ensure_buffers(self, nbytes: int) -> None:
        nbytes = -(-nbytes // _ALIGN) * _ALIGN
        if self.buffers and self.buffers[0].numel() >= nbytes:
            return
        self.plan = None  # its views (and graphs) point into the old buffers
        self.buffers = []  # free the old slots before allocating the new ones
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(NUM_BUFFERS)]

    def _stale(self, plan: LoadPlan) -> str | None:
        now = {n: storage_of(t) for n, t in model_tensors(self.model).items()}
        if now != plan.storages:
            changed = sorted(set(now.items()) ^ set(plan.storages.items()))
            return f"model storage changed since the plan was recorded ({changed[0][0]!r} first)"
        return None

    def held(self, key: str) -> dict[str, Any] | None:
        """The summary of the plan for ``key`` if it is held and the model's storage has not moved."""
        if self.plan is not None and self.plan.key == key and self._stale(self.plan) is None:
            return {"recorded": False, **self.plan.summary()}
        return None

    def prepare(self, layouts: list[ChunkLayout], key: str | None = None) -> dict[str, Any]:
        """Plan for ``layouts`` (recorded if needed); raises :class:`PlanError` (nothing received yet).

        ``key``: :func:`layout_key` of ``layouts`` when the caller already has it (saves hashing them).
        """
        key = key or layout_key(layouts)
        held = self.held(key)
        if held is not None:
            return held
        self._ensure_buffers(max(c.nbytes for c in layouts))
        self.plan = None  # a failed recording leaves no plan behind
        plan = record_plan(self.model, self.load_fn, layouts, self.buffers)
        if self.use_graphs:
            self._capture(plan)
        self.plan = plan
        log.info("fast weight load: plan %s recorded in %.3fs: %d chunks, %d copies, %d fills, %d computes, "
                 "%d tensors written, %d untouched; replay: %s", plan.key, plan.record_s, len(layouts), plan.n_copies,
                 plan.n_fills, plan.n_computes, len(plan.written), len(plan.untouched), plan.graph_note)
        return {"recorded": True, **plan.summary()}

    def _capture(self, plan: LoadPlan) -> None:
        """One CUDA graph per chunk, all in one memory pool (they replay in capture order, on one stream)."""
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        graphs: list[Any] = []
        pool = None
        try:
            with torch.cuda.stream(side), torch.no_grad():
                for chunk_ops in plan.ops:
                    if not chunk_ops:
                        graphs.append(None)
                        continue
                    g = torch.cuda.CUDAGraph()
                    g.capture_begin(pool=pool, capture_error_mode="thread_local")
                    try:
                        _replay(chunk_ops)
                    finally:
                        g.capture_end()
                    pool = pool if pool is not None else g.pool()
                    graphs.append(g)
        except Exception as exc:  # noqa: BLE001 - the op-by-op replay is always there
            plan.graphs, plan.graph_note = None, f"eager (graph capture failed: {type(exc).__name__}: {exc})"[:300]
            log.warning("fast weight load: %s", plan.graph_note)
            return
        finally:
            torch.cuda.current_stream(self.device).wait_stream(side)
        plan.graphs = graphs
        n = sum(g is not None for g in graphs)
        plan.graph_note = f"cuda graphs ({n}, captured in {time.perf_counter() - t0:.3f}s)"

    def receive(self, broadcast: Callable[[torch.Tensor, Any], None], deadline: float) -> dict[str, float]:
        """Receive every chunk of the prepared layout and replay its copies into the model's storage.

        Returns host seconds (``receive_s``: first broadcast posted to last copy done; ``issue_s``: all
        work queued) and on CUDA ``gpu_s``, the same span timed by events on the device.
        """
        plan = self.plan
        if plan is None:
            raise PlanError("receive() before a successful prepare()")
        t0 = time.perf_counter()
        out: dict[str, float] = {}
        with torch.no_grad():
            if self.device.type == "cuda":
                out = self._receive_cuda(plan, broadcast, deadline, t0)
            else:
                for k, layout in enumerate(plan.layouts):
                    broadcast(self.buffers[k % NUM_BUFFERS][:layout.nbytes], None)
                    _replay(plan.ops[k])
        return {"receive_s": time.perf_counter() - t0, "bytes": float(sum(c.nbytes for c in plan.layouts)), **out}

    def _receive_cuda(self, plan: LoadPlan, broadcast: Callable[[torch.Tensor, Any], None], deadline: float,
                      t0: float) -> dict[str, float]:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        recv, copy = self._streams
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # The model's last forward and the caller's work are ordered before any byte lands.
        start = torch.cuda.current_stream(self.device).record_event()
        recv.wait_event(start)
        copy.wait_event(start)
        first.record(recv)
        freed: list[Any] = [None] * NUM_BUFFERS
        graphs = plan.graphs
        for k, layout in enumerate(plan.layouts):
            slot = k % NUM_BUFFERS
            with torch.cuda.stream(recv):
                if freed[slot] is not None:
                    recv.wait_event(freed[slot])  # slot reuse only after the copies that read it
                broadcast(self.buffers[slot][:layout.nbytes], recv)
                arrived = recv.record_event()
            with torch.cuda.stream(copy):
                copy.wait_event(arrived)
                if graphs is None:
                    _replay(plan.ops[k])
                elif graphs[k] is not None:
                    graphs[k].replay()
                freed[slot] = copy.record_event()
        last.record(copy)
        issued = time.perf_counter() - t0
        _wait(last, deadline, f"{len(plan.layouts)} weight chunk(s) ({sum(c.nbytes for c in plan.layouts)} bytes)")
        torch.cuda.current_stream(self.device).wait_event(last)
        return {"issue_s": issued, "gpu_s": first.elapsed_time(last) / 1e3}

    def receive_direct(self, layouts: list[ChunkLayout], broadcast: Callable[[torch.Tensor, Any], None],
                       deadline: float, load: bool = True) -> dict[str, float]:
        """No plan: receive each chunk into the buffers and run the model's own loader on it.

        For a stream that is already being broadcast when planning fails (the other ranks of the
        collective are receiving it): the same bytes land through the loader itself. ``load=False``
        only drains the stream (the caller then reports an error).
        """
        self.plan = None  # the buffers' contents change under any recorded views
        self._ensure_buffers(max(c.nbytes for c in layouts))
        t0 = time.perf_counter()
        with torch.no_grad():
            for k, layout in enumerate(layouts):
                buf = self.buffers[k % NUM_BUFFERS][:layout.nbytes]
                broadcast(buf, None)  # the current stream: the loader below runs after it
                if load:
                    self.load_fn(chunk_views(buf, layout))
            if self.device.type == "cuda":
                done = torch.cuda.current_stream(self.device).record_event()
                _wait(done, deadline, f"{len(layouts)} weight chunk(s) loaded without a plan")
        return {"receive_s": time.perf_counter() - t0, "bytes": float(sum(c.nbytes for c in layouts))}


__all__ = ["FastLoader", "NUM_BUFFERS"]
