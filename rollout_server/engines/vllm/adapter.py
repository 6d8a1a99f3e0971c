"""The vLLM engine's session terms: frozen names kept (``skip``) and ``adapter`` sessions merged on the server.

``/sync/init`` declares what a learner will not send (``SyncInitRequest.skip``, ``adapter``); this mixin of
:class:`rollout_server.engines.vllm.engine.VLLMEngine` decides per transport (the engine learns an NCCL session
from ``init_nccl``, which runs just before ``open_session`` in the same ``/sync/init``):

===========  =====================================  ====================================================
transport    skip (frozen names stay as served)     adapter (merged here, served as plain weights)
===========  =====================================  ====================================================
http         taken: the workers load only what was  taken: adapter tensors are staged apart, merged on
             staged (each bucket is a partial load  CPU at commit (peft, :mod:`..adapter_merge`), the
             already), the commit's coverage counts merged ``<layer>.weight`` staged like an HTTP bucket
             the skipped names as served            and loaded by the same worker call as every bucket
ipc          taken, as http (bucket by bucket)      refused at the first bucket, before any load (the
                                                    adapter's bytes sit in the learner's GPU memory)
nccl         refused (``skip_refused``: sent in     refused at /sync/init (a 400 naming the fix)
             full): vLLM's native layerwise reload
             of a partial stream is untested
===========  =====================================  ====================================================

The base an adapter merges into is read from the model directory once per adapter shape
(:func:`rollout_server.engines.adapter_base.base_weights`): in an adapter run every base weight is frozen, so
the checkpoint is the base whatever earlier syncs wrote. Every sync merges from it, so DoRA works (vLLM's own
LoRA serving has none) and decoding costs what the base model costs. A refused adapter session is not fatal:
the learner falls back to merged pushes for that server (learner/weight_sync/boundary.py).

What this module does not know: HTTP, the fence, vLLM's API (the engine loads what is staged here).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from common.weight_sync import weights as W
from common.weight_sync.messages import AdapterSpec, TensorSpec
from rollout_server.engines.adapter_base import AdapterStage, adapter_key, base_weights, layer_shapes
from rollout_server.engines.adapter_merge import AdapterMerger
from rollout_server.engines.base import SessionTerms, WeightUpdateError

log = logging.getLogger(__name__)

#: Why an NCCL session's frozen names are sent anyway (``SyncInitResponse.skip_refused``).
NCCL_SKIP_REFUSED = ("over transport nccl the vllm engine takes full pushes only (vLLM's layerwise reload of a "
                     "partial stream is untested): frozen parameters are sent; weight_sync.transport: http or ipc "
                     "leaves them out")
#: What a refused adapter session says (a 400 naming ``adapter``).
ADAPTER_TRANSPORT_FIX = ("the vllm engine merges a pushed adapter over transport http only (its tensors must reach "
                         "the server's CPU). Fix: set weight_sync.transport: http for model.adapter.sync: adapter "
                         "on vLLM, or model.adapter.sync: merged (merged weights over any transport)")


class AdapterReceiver:
    """``open_session``, adapter staging and the merge at commit for :class:`VLLMEngine` (module docstring)."""

    model_path: str
    merges_adapters = True
    _manifest: dict[str, TensorSpec]
    _alias: dict[str, str]
    _dtype: str
    last_update_info: dict | None
    #: the open session's adapter stage (None: no adapter session)
    _adapter: AdapterStage | None = None
    _nccl_pending = False  # init_nccl ran for the /sync/init in progress
    _session_nccl = False  # the open session's transport is nccl
    _inplace = False  # this session loaded into the served weights as it went (NCCL or IPC)
    # Engine.__init__ sets both; immutable defaults keep an engine built without it (tests) working
    _skip: frozenset[str] | set[str] = frozenset()
    _written: frozenset[str] | set[str] = frozenset()

    @property
    def skip_refused_reason(self) -> str | None:  # type: ignore[override]
        return NCCL_SKIP_REFUSED if self._session_nccl else None

    @property
    def updates_in_place(self) -> bool:
        """A session that fails now leaves the served weights partly new (rollout_server/weight_sync/session.py
        then refuses to serve): only once an NCCL or IPC load has begun, not when a bucket was refused before."""
        return self._inplace

    def open_session(self, skip: list[str], adapter: AdapterSpec | None) -> SessionTerms:
        self._session_nccl, self._nccl_pending, self._inplace = self._nccl_pending, False, False
        if adapter is not None and self._session_nccl:
            raise WeightUpdateError(ADAPTER_TRANSPORT_FIX, "adapter")
        return super().open_session(skip, adapter)  # type: ignore[misc]

    def _open_adapter(self, adapter: AdapterSpec) -> list[TensorSpec]:
        """The adapter tensors this session sends; the first session of an adapter shape reads its base (CPU,
        seconds: /sync/init runs it off the event loop)."""
        shapes = layer_shapes(adapter, self._manifest, self._alias)
        mergers: dict[str, AdapterMerger] = self.__dict__.setdefault("_mergers", {})
        key = adapter_key(adapter)
        if key not in mergers:
            mergers[key] = AdapterMerger(adapter, base_weights(self.model_path, adapter, shapes))
            log.info("adapter sync: %s rank %d on %d layer(s): base copies kept for server-side merges",
                     adapter.type, adapter.rank, len(adapter.layers))
        self._adapter = AdapterStage(mergers[key], shapes)
        return list(self._adapter.specs.values())

    def _take_adapter(self, tensors: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """An HTTP bucket split: its adapter tensors kept by the session (bytes counted), the served rest returned.
        An adapted layer's own weight is refused: the server merges it."""
        if self._adapter is None:
            return tensors, 0
        rest, nbytes = {}, 0
        for name, t in tensors.items():
            if self._adapter.owns(name):
                nbytes += self._adapter.take(name, t)
            elif self._alias.get(name, name) in self._adapter.adapted:
                raise WeightUpdateError(f"{name!r} is an adapted layer's weight: in an adapter sync the server merges "
                                        "it from the adapter's tensors, send those instead", name)
            else:
                rest[name] = t
        return rest, nbytes

    def _refuse_adapter_ipc(self) -> None:
        """``receive_ipc`` in an adapter session: refused before anything is loaded (old weights kept)."""
        if self._adapter is not None:
            raise WeightUpdateError(ADAPTER_TRANSPORT_FIX, "adapter")

    async def _stage_merged(self) -> bool:
        """Commit of an adapter session: the merged ``<layer>.weight`` tensors (serving dtype; CPU, off the event
        loop) staged like an HTTP bucket, so the workers load them with the rest; False outside one."""
        if self._adapter is None:
            return False
        merged = await asyncio.to_thread(self._adapter.merged, W.torch_dtype(self._dtype))
        self._stage_host(merged)  # type: ignore[attr-defined]
        return True

    def _merge_loaded(self, n_loaded: int) -> None:
        """After the workers loaded an adapter session's buckets: the merge time logged and in ``last_update_info``."""
        if self._adapter is None or self._adapter.merge_s is None:
            return
        info = self.last_update_info or {}
        info["merge_s"] = self._adapter.merge_s
        self.last_update_info = info
        log.info("adapter sync: %d layer(s) merged on CPU in %.3fs; %d tensors loaded by the workers in %.3fs",
                 len(self._adapter.adapted), self._adapter.merge_s or 0.0, n_loaded, info.get("load_s", 0.0))

    def _end_session(self, committed: set[str] | None = None) -> None:
        super()._end_session(committed)  # type: ignore[misc]
        self._adapter, self._session_nccl = None, False


__all__ = ["AdapterReceiver", "ADAPTER_TRANSPORT_FIX", "NCCL_SKIP_REFUSED"]
