"""The vLLM engine's side of ``transport: ipc``: a bucket loaded by the GPU worker straight from the learner's memory.

For the one-GPU topology (learner and vLLM on one device). ``/sync/ipc`` names a bucket in the
learner's shared buffer (:class:`common.weight_sync.messages.SyncIpcRequest`); :meth:`IpcReceiver.receive_ipc`
checks it against the manifest and the GPU, then one ``collective_rpc("tandem_load_shared")`` has the
worker open the buffer (CUDA IPC: no host round trip) and run the model's own weight loaders on views
of it (:meth:`rollout_server.engines.vllm.extension.TandemWorkerExtension.tandem_load_shared`). The
loaders copy into the served parameters in place, so captured CUDA graphs stay valid; like the NCCL
path, a session that fails after its first bucket leaves the weights partly new and
``rollout_server/weight_sync/session.py`` then refuses to serve (``updates_in_place``).

HTTP buckets take the same worker call at commit: :meth:`IpcReceiver._stage_host` copies each received
bucket into a /dev/shm file of this host (the engine-core workers are other processes) and
:meth:`IpcReceiver._load_staged` has the workers load them in place once every bucket has arrived (a
session that fails before commit drops the files and keeps the old weights; vLLM's ``reload_weights``
from a safetensors temp dir took 1.35-1.9 s for 0.5b on an H100).

A mixin of :class:`rollout_server.engines.vllm.engine.VLLMEngine` (uses its ``llm``, ``_check``,
``_received``, ``_staged`` and session timeout); kept apart so the engine module stays one screenful
per concern.
"""

from __future__ import annotations

import time
from typing import Any

from common.weight_sync import packed as P
from common.weight_sync.shared import SendBuffer
from rollout_server.engines.base import WeightUpdateError


class IpcReceiver:
    """``receive_ipc`` and the workers' GPU identities for :class:`VLLMEngine`."""

    llm: Any
    _gpu_uuids: list[str]
    _received: set[str]
    _nccl_updating: bool
    _fast_updated: bool
    _inplace: bool
    _session_timeout_s: float
    last_update_info: dict | None
    _staged: dict[str, Any]
    _host_buckets: list[tuple[list[P.Entry], SendBuffer]]

    async def _read_gpu_uuids(self) -> None:
        """Each worker's GPU UUID (``/health`` ``engine_info.gpu_uuids``: the learner picks ``ipc`` by it)."""
        self._gpu_uuids = [str(u) for u in await self.llm.collective_rpc("tandem_gpu_uuid")]

    async def receive_ipc(self, req: Any) -> int:
        self._refuse_adapter_ipc()  # type: ignore[attr-defined]  # before anything loads: old weights kept
        names = [self._check(n, d, s) for n, d, s in zip(req.names, req.dtypes, req.shapes)]  # type: ignore[attr-defined]
        src = req.source
        if src.kind != "cuda":
            raise ValueError("the vLLM engine takes CUDA IPC buffers only (its weights are on a GPU): keep the "
                             "learner's weights on the server's GPU, or set sync.transport: http")
        if set(self._gpu_uuids) != {src.device_uuid}:
            raise ValueError(f"the learner's buffer is on GPU {src.device_uuid}, this server's workers are on "
                             f"{self._gpu_uuids}; CUDA IPC needs one GPU for both (else sync.transport: nccl)")
        if self._nccl_updating:
            raise WeightUpdateError("a native NCCL update is open in this session")
        layout = {"names": list(req.names), "dtypes": list(req.dtypes), "shapes": [list(s) for s in req.shapes],
                  "offsets": [list(o) for o in req.offsets]}
        t0 = time.monotonic()
        self._fast_updated = self._inplace = True  # from here the served weights are being overwritten in place
        outs = await self.llm.collective_rpc("tandem_load_shared", timeout=self._session_timeout_s,
                                             kwargs={"layout": layout, "source": src.model_dump()})
        self._received.update(names)
        self.last_update_info = {"path": "ipc", "rpc_s": time.monotonic() - t0,
                                 "worker_s": max(float(o["worker_s"]) for o in outs)}
        return sum(end - begin for begin, end in req.offsets)


    def _stage_host(self, tensors: dict[str, Any]) -> int:
        """One HTTP bucket (views of its body) into a /dev/shm file the workers can open; names recorded as staged."""
        layout = P.packed_layout(list(tensors.items()), {n: str(t.dtype).removeprefix("torch.") for n, t in tensors.items()})
        buf = SendBuffer(P.nbytes_of(layout), "cpu")
        P.pack_into(buf.tensor, list(tensors.values()), layout)
        self._host_buckets.append((layout, buf))
        self._staged.update({name: len(self._host_buckets) - 1 for name, *_ in layout})
        return P.nbytes_of(layout)

    async def _load_staged(self) -> None:
        """Every staged HTTP bucket into the served weights, in place, by the workers (commit)."""
        t0 = time.monotonic()
        try:
            for layout, buf in self._host_buckets:
                spec = {"names": [e[0] for e in layout], "dtypes": [e[1] for e in layout],
                        "shapes": [e[2] for e in layout], "offsets": [list(e[3]) for e in layout]}
                await self.llm.collective_rpc("tandem_load_shared", timeout=self._session_timeout_s,
                                              kwargs={"layout": spec, "source": buf.describe().model_dump()})
        finally:
            self._drop_staged()
        self.last_update_info = {"path": "host", "load_s": time.monotonic() - t0}

    def _drop_staged(self) -> None:
        for _, buf in self._host_buckets:
            buf.close()
        self._host_buckets = []
        self._staged = {}


__all__ = ["IpcReceiver"]
