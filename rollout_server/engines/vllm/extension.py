"""tandem's RPCs inside vLLM's GPU workers (``worker_extension_cls``): fast weight load and a digest.

vLLM mixes this class into its ``Worker`` (vLLM >= 0.8.2), so ``self`` is the worker and the methods
are reached with ``AsyncLLM.collective_rpc(name, kwargs=...)`` on every worker at once. The engine
(:mod:`rollout_server.engines.vllm.engine`) calls, per sync and only for ``weight_load: fast``:

1. ``tandem_prepare(layout)`` on every worker: records the copy plan for this stream layout if it has
   none (:mod:`rollout_server.engines.vllm.load_plan`; no weight is written) and says whether it can replay it.
   Nothing is received yet, so if any worker refuses, the engine runs vLLM's native
   ``update_weights`` for this sync instead and the learner's broadcasts are consumed there.
2. ``tandem_receive(timeout_s)``: the packed broadcasts from learner rank 0 over the communicator
   that ``init_weight_transfer_engine`` built (the same group as the native path), each chunk copied
   into the served parameters as it lands.

Once every worker has planned a stream, the engine sends the next syncs of the same stream as ONE
call, ``tandem_receive(timeout_s, layout)``: one engine-core round trip less per sync (a
``tandem_prepare`` that found its plan still took ~8 ms on an H200 server, more than NVLink needs
to move a 2 GB model). The worker re-plans on the spot if its
model storage moved; if it then cannot plan at all, the learner is already broadcasting and the
other workers are receiving, so it receives through the model's own loaders instead
(:meth:`~rollout_server.engines.vllm.fast_loader.FastLoader.receive_direct`) and says so (``path: direct``): the
engine turns the fast path off after that sync.

Quantized models are refused up front: their ``process_weights_after_loading`` repacks values, which
a copy plan cannot express. Imported only inside vLLM's worker processes (never by the app).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from common.weight_sync.messages import SharedBuffer
from common.weight_sync import weights as W
from common.weight_sync.shared import gpu_uuid, open_shared
from rollout_server.engines.vllm.fast_loader import NUM_BUFFERS, FastLoader
from rollout_server.engines.vllm.load_plan import (ChunkLayout, PlanError, chunk_layouts, chunk_views, layout_key,
                                                   stream_key)

log = logging.getLogger(__name__)


class TandemWorkerExtension:
    """Methods added to vLLM's GPU worker; state lives in ``self._tandem_loader``."""

    def _tandem_model(self) -> torch.nn.Module:
        engine = getattr(self, "weight_transfer_engine", None)
        model = getattr(engine, "model", None)
        return model if model is not None else self.model_runner.model  # type: ignore[attr-defined]

    def _tandem_wrapped(self) -> list[str]:
        return [n for n, p in self._tandem_model().named_parameters()
                if getattr(getattr(p, "weight_loader", None), "__name__", "") == "online_process_loader"]

    def _tandem_layouts(self, layout: dict[str, Any]) -> tuple[str, list]:
        """``(layout_key, chunk layouts)`` of an announced stream, cut once per distinct stream."""
        skey = stream_key(layout)
        cached = getattr(self, "_tandem_cut", None)
        if cached is None or cached[0] != skey:
            layouts = chunk_layouts(layout["names"], layout["dtypes"], layout["shapes"], layout["offsets"],
                                    int(layout["bucket_bytes"]))
            cached = (skey, layout_key(layouts), layouts)
            self._tandem_cut = cached
        return cached[1], cached[2]

    def tandem_prepare(self, layout: dict[str, Any]) -> dict[str, Any]:
        """``{"ok": True, ...plan summary}`` or ``{"ok": False, "reason", "transient", "loaders_usable"}``;
        never raises.

        Transient (a guard; not seen on vLLM 0.26): vLLM's layerwise-reload wrappers are on the weight
        loaders, i.e. a native update's session is open, so recording now would capture their
        buffering; the next sync tries again. ``loaders_usable``: the model's own loaders may be called
        directly on received chunks (:meth:`tandem_receive`'s fallback): not for a quantized model
        (its weights are repacked after loading) nor through the wrappers.
        """
        quant = getattr(self.model_config, "quantization", None)  # type: ignore[attr-defined]
        if quant:
            return {"ok": False, "transient": False, "loaders_usable": False,
                    "reason": f"quantized model ({quant}): its weights are repacked after loading"}
        if getattr(self, "_weight_update_active", False):
            return {"ok": False, "transient": True, "loaders_usable": False,
                    "reason": "a native weight update is open on this worker"}
        try:
            key, layouts = self._tandem_layouts(layout)
            loader = self._tandem_fast_loader()
            held = loader.held(key)
            if held is not None:  # the steady state: replay calls no loader, so the wrappers do not matter
                return {"ok": True, **held}
            wrapped = self._tandem_wrapped()  # recording would run the loaders: not through the wrappers
            if wrapped:
                return {"ok": False, "transient": True, "loaders_usable": False,
                        "reason": f"{len(wrapped)} weight loaders still carry vLLM's layerwise-reload wrapper "
                                  f"({wrapped[0]!r} first): native for this sync"}
            return {"ok": True, **loader.prepare(layouts, key)}
        except PlanError as exc:  # the loaders do more than place bytes: they still load correctly themselves
            return {"ok": False, "transient": False, "loaders_usable": True, "reason": str(exc)}
        except torch.OutOfMemoryError:
            return {"ok": False, "transient": False, "loaders_usable": True, "reason": self._tandem_oom(layout)}
        except Exception as exc:  # noqa: BLE001 - reported to the engine, which falls back to native
            log.exception("tandem_prepare failed")
            return {"ok": False, "transient": False, "loaders_usable": False,
                    "reason": f"{type(exc).__name__}: {exc}"}

    def _tandem_oom(self, layout: dict[str, Any]) -> str:
        """Why the fast path ran out of memory, and the fix: its buffers are not in vLLM's budget."""
        chunk_mb = max(c.nbytes for c in self._tandem_layouts(layout)[1]) / 2**20
        try:
            free = f"{torch.cuda.mem_get_info(self.device)[0] / 2**20:.0f} MB free"  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the message is still useful without it
            free = "free memory unknown"
        return (f"out of GPU memory for the fast weight load: {NUM_BUFFERS} receive buffers of {chunk_mb:.0f} MB plus the "
                f"copy graphs live outside vLLM's gpu_memory_utilization budget ({free}). Fix: lower "
                f"weight_sync.bucket_mb or rollout_server.gpu_memory_utilization "
                f"(or set rollout_server.weight_load: native)")

    def _tandem_fast_loader(self) -> FastLoader:
        loader = getattr(self, "_tandem_loader", None)
        if loader is None:
            loader = FastLoader(self._tandem_model(), self.device)  # type: ignore[attr-defined]
            self._tandem_loader = loader
        return loader

    def tandem_receive(self, timeout_s: float, layout: dict[str, Any] | None = None) -> dict[str, Any]:
        """One sync's chunks into the served weights; raises on a timeout (the engine marks an error).

        Without ``layout``: the plan ``tandem_prepare`` just made. With it (the one-call path): plan
        here, or receive through the model's loaders when no plan can be made (module docstring).
        """
        group = getattr(getattr(self, "weight_transfer_engine", None), "model_update_group", None)
        if group is None:
            raise RuntimeError("tandem_receive before init_weight_transfer_engine")

        def broadcast(buf: torch.Tensor, stream: Any) -> None:
            group.broadcast(buf, src=0, stream=stream)

        deadline = time.monotonic() + float(timeout_s)
        if layout is None:
            loader = getattr(self, "_tandem_loader", None)
            if loader is None:
                raise RuntimeError("tandem_receive without tandem_prepare")
            return {"path": "plan", **loader.receive(broadcast, deadline)}
        info = self.tandem_prepare(layout)
        loader = self._tandem_fast_loader()
        if info["ok"]:
            return {"path": "plan", "recorded": info["recorded"], **loader.receive(broadcast, deadline)}
        layouts = self._tandem_layouts(layout)[1]
        if not info["loaders_usable"]:
            loader.receive_direct(layouts, broadcast, deadline, load=False)
            raise RuntimeError(f"fast weight load: no plan and no direct load possible ({info['reason']}); the "
                               f"stream was drained; this worker's weights are unchanged, other workers' may be new")
        log.warning("fast weight load: no plan for this sync (%s); receiving through the model's loaders",
                    info["reason"])
        return {"path": "direct", "reason": info["reason"], **loader.receive_direct(layouts, broadcast, deadline)}

    def tandem_gpu_uuid(self) -> str:
        """This worker's GPU UUID (the engine reports them; ``transport: ipc`` needs the learner's to match)."""
        return gpu_uuid(self.device)  # type: ignore[attr-defined]

    def tandem_load_shared(self, layout: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
        """One ``ipc`` bucket (:mod:`rollout_server.engines.vllm.ipc`): open the learner's buffer on this GPU and
        run the model's own loaders on views of it (in place; no plan: each bucket is loaded once per sync)."""
        t0 = time.perf_counter()
        chunk = ChunkLayout(tuple(layout["names"]), tuple(layout["dtypes"]),
                            tuple(tuple(int(d) for d in s) for s in layout["shapes"]),
                            tuple((int(b), int(e)) for b, e in layout["offsets"]))
        with open_shared(SharedBuffer.model_validate(source), self.device) as buf, torch.no_grad():  # type: ignore[attr-defined]
            self._tandem_model().load_weights(chunk_views(buf[:chunk.nbytes], chunk))
            if self.device.type == "cuda":  # type: ignore[attr-defined]
                torch.cuda.synchronize(self.device)  # type: ignore[attr-defined]  # read before the buffer is refilled
        return {"worker_s": time.perf_counter() - t0}

    def tandem_digest(self) -> str:
        """Exact digest of this worker's served parameters (TP shards differ between workers)."""
        return W.exact_digest(self._tandem_model().named_parameters())


__all__ = ["TandemWorkerExtension"]
