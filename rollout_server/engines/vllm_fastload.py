"""tandem's RPCs inside vLLM's GPU workers (``worker_extension_cls``): fast weight load and a digest.

vLLM mixes this class into its ``Worker`` (vLLM >= 0.8.2), so ``self`` is the worker and the methods
are reached with ``AsyncLLM.collective_rpc(name, kwargs=...)`` on every worker at once. The engine
(:mod:`rollout_server.engines.vllm`) calls, per sync and only for ``weight_load: fast``:

1. ``tandem_prepare(layout)`` on every worker: records the copy plan for this stream layout if it has
   none (:mod:`rollout_server.load_plan`; no weight is written) and says whether it can replay it.
   Nothing is received yet, so if any worker refuses, the engine runs vLLM's native
   ``update_weights`` for this sync instead and the learner's broadcasts are consumed there.
2. ``tandem_receive(timeout_s)``: the packed broadcasts from learner rank 0 over the communicator
   that ``init_weight_transfer_engine`` built (the same group as the native path), each chunk copied
   into the served parameters as it lands.

Quantized models are refused up front: their ``process_weights_after_loading`` repacks values, which
a copy plan cannot express. Imported only inside vLLM's worker processes (never by the app).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from rollout_server import weights as W
from rollout_server.load_plan import FastLoader, PlanError, chunk_layouts

log = logging.getLogger(__name__)


class TandemWorkerExtension:
    """Methods added to vLLM's GPU worker; state lives in ``self._tandem_loader``."""

    def _tandem_model(self) -> torch.nn.Module:
        engine = getattr(self, "weight_transfer_engine", None)
        model = getattr(engine, "model", None)
        return model if model is not None else self.model_runner.model  # type: ignore[attr-defined]

    def tandem_prepare(self, layout: dict[str, Any]) -> dict[str, Any]:
        """``{"ok": True, ...plan summary}`` or ``{"ok": False, "reason": ..., "transient": bool}``; never raises.

        Transient: vLLM's layerwise-reload wrappers are still on the weight loaders (seen on a server
        started with ``load_format=dummy``, whose first update goes through them), so recording now
        would capture their buffering. One native update unwraps them; the next sync tries again.
        """
        wrapped = [n for n, p in self._tandem_model().named_parameters()
                   if getattr(getattr(p, "weight_loader", None), "__name__", "") == "online_process_loader"]
        if wrapped:
            return {"ok": False, "transient": True,
                    "reason": f"{len(wrapped)} weight loaders still carry vLLM's layerwise-reload wrapper "
                              f"({wrapped[0]!r} first): native for this sync"}
        try:
            quant = getattr(self.model_config, "quantization", None)  # type: ignore[attr-defined]
            if quant:
                raise PlanError(f"quantized model ({quant}): its weights are repacked after loading")
            if getattr(self, "_weight_update_active", False):
                raise PlanError("a native weight update is open on this worker")
            loader = getattr(self, "_tandem_loader", None)
            if loader is None:
                loader = FastLoader(self._tandem_model(), self.device)  # type: ignore[attr-defined]
                self._tandem_loader = loader
            layouts = chunk_layouts(layout["names"], layout["dtypes"], layout["shapes"], layout["offsets"],
                                    int(layout["bucket_bytes"]))
            return {"ok": True, **loader.prepare(layouts)}
        except PlanError as exc:
            return {"ok": False, "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001 - reported to the engine, which falls back to native
            log.exception("tandem_prepare failed")
            return {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}

    def tandem_receive(self, timeout_s: float) -> dict[str, float]:
        """One sync's chunks into the served weights; raises on a timeout (the engine marks an error)."""
        loader = getattr(self, "_tandem_loader", None)
        group = getattr(getattr(self, "weight_transfer_engine", None), "model_update_group", None)
        if loader is None or group is None:
            raise RuntimeError("tandem_receive without tandem_prepare / init_weight_transfer_engine")

        def broadcast(buf: torch.Tensor, stream: Any) -> None:
            group.broadcast(buf, src=0, stream=stream)

        return loader.receive(broadcast, time.monotonic() + float(timeout_s))

    def tandem_digest(self) -> str:
        """Exact digest of this worker's served parameters (TP shards differ between workers)."""
        return W.exact_digest(self._tandem_model().named_parameters())


__all__ = ["TandemWorkerExtension"]
