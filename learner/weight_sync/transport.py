"""Which sender a rollout server gets: :func:`make_sender` builds it, :func:`auto_transport` decides ``auto``.

    sender = make_sender("http://127.0.0.1:8310", "auto", auth_token=None, timeout_s=300)

A new transport is a :class:`learner.weight_sync.base.PushSender` subclass with its ``_send`` (and the hooks it
needs) plus one branch here, and its receiving half on the server (common/weight_sync/__init__.py draws both).

What this module does not know: the push protocol, or when a push is due.
"""

from __future__ import annotations

from typing import Any

from learner.weight_sync.base import WeightSender
from learner.weight_sync.session import SyncClient

TRANSPORTS = ("auto", "http", "nccl", "ipc")


def make_sender(base_url: str, transport: str = "auto", *, master_addr: str = "127.0.0.1", **kw: Any) -> WeightSender:
    """The sender for one server; ``auto`` asks the server's ``/health`` (:func:`auto_transport`).

    ``kw``: ``auth_token``, ``timeout_s``, ``client_id``, ``connect_timeout_s`` (every sender takes them).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"sync transport {transport!r}: expected one of {TRANSPORTS} (weight_sync.transport)")
    if transport == "auto":
        import torch

        transport = "http"
        if torch.cuda.is_available():
            probe = SyncClient(base_url, timeout_s=kw.get("timeout_s", 300.0), auth_token=kw.get("auth_token"),
                               connect_timeout_s=kw.get("connect_timeout_s", 10.0))
            try:
                health = probe.health()
            finally:
                probe.close()
            from common.weight_sync.shared import gpu_uuid

            transport = auto_transport(health.engine, health.engine_info.get("gpu_uuids") or [],
                                       gpu_uuid(torch.cuda.current_device()))
    if transport == "nccl":
        from learner.weight_sync.nccl import NcclWeightSender  # GPU path: dedicated NCCL group, packed broadcasts

        return NcclWeightSender(base_url, master_addr=master_addr, **kw)
    if transport == "ipc":
        from learner.weight_sync.ipc import IpcWeightSender

        return IpcWeightSender(base_url, **kw)
    from learner.weight_sync.http import HttpWeightSender

    return HttpWeightSender(base_url, **kw)


def auto_transport(engine: str, server_gpus: list[str], learner_gpu: str | None) -> str:
    """``auto`` for a CUDA learner: ``ipc`` when the server serves only on the learner's GPU (NCCL cannot
    put two ranks of a group on one device), else ``nccl`` to a vLLM server, else ``http``."""
    if learner_gpu is not None and server_gpus and set(server_gpus) == {learner_gpu}:
        return "ipc"
    return "nccl" if engine == "vllm" else "http"
