"""Learner → rollout server weight sync: when to push, and how the bytes travel.

    boundary.py   WeightSync: the step-boundary protocols (blocking: barrier → rank-0 push → barrier →
                  broadcast ver; overlap: snapshot + push thread), cadence, counters
    overlap.py    rank 0's overlap machinery (WeightSnapshot, BackgroundPush)
    base.py       WeightSender (the interface boundary.py holds) and PushSender (the one push protocol:
                  open → plan → fingerprint → begin → send → commit, abort on failure)
    control.py    SyncClient: the HTTP control calls of a session, each with a deadline
    http.py       HttpWeightSender: packed buckets over HTTP (portable: CPU, any engine)
    ipc.py        IpcWeightSender: the server copies from the learner's shared buffer (same GPU: CUDA IPC)
    nccl.py       NcclWeightSender: packed broadcasts on a dedicated NCCL group (GPU, vLLM or hf engine)
    sharded.py    FSDP2 weights: the bucket plan every rank follows, gathers just in time, the running fingerprint

:func:`make_sender` picks the transport for one server. A new transport is a ``PushSender`` subclass
with its ``_send`` (and the hooks it needs) plus one branch here.
"""

from __future__ import annotations

from typing import Any

from learner.sync.base import AdapterPush, PushSender, Sent, SyncReport, WeightSender, cast_stream, plan
from learner.sync.control import SyncClient, SyncError, SyncSession

__all__ = ["AdapterPush", "PushSender", "auto_transport", "Sent", "SyncClient", "SyncError", "SyncReport", "SyncSession", "WeightSender",
           "cast_stream", "make_sender", "plan"]

TRANSPORTS = ("auto", "http", "nccl", "ipc")


def make_sender(base_url: str, transport: str = "auto", *, master_addr: str = "127.0.0.1", **kw: Any) -> WeightSender:
    """The sender for one server; ``auto`` asks the server's ``/health`` (:func:`auto_transport`).

    ``kw``: ``auth_token``, ``timeout_s``, ``client_id``, ``connect_timeout_s`` (every sender takes them).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"sync transport {transport!r}: expected one of {TRANSPORTS} (rollout_matching.vllm.sync.transport)")
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
            from common.tensors.shared import gpu_uuid

            transport = auto_transport(health.engine, health.engine_info.get("gpu_uuids") or [],
                                       gpu_uuid(torch.cuda.current_device()))
    if transport == "nccl":
        from learner.sync.nccl import NcclWeightSender  # GPU path: dedicated NCCL group, packed broadcasts

        return NcclWeightSender(base_url, master_addr=master_addr, **kw)
    if transport == "ipc":
        from learner.sync.ipc import IpcWeightSender

        return IpcWeightSender(base_url, **kw)
    from learner.sync.http import HttpWeightSender

    return HttpWeightSender(base_url, **kw)


def auto_transport(engine: str, server_gpus: list[str], learner_gpu: str | None) -> str:
    """``auto`` for a CUDA learner: ``ipc`` when the server serves only on the learner's GPU (NCCL cannot
    put two ranks of a group on one device), else ``nccl`` to a vLLM server, else ``http``."""
    if learner_gpu is not None and server_gpus and set(server_gpus) == {learner_gpu}:
        return "ipc"
    return "nccl" if engine == "vllm" else "http"
