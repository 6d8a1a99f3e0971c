"""The ``weight_sync`` config section: how and when learner rank 0 pushes its weights to the rollout servers.

Every key the learner's push reads is here (the whole concept: common/weight_sync/__init__.py). The server's
side of a sync is configured with the server: ``rollout_server.sync_idle_timeout_s`` (an idle session is
aborted), ``rollout_server.max_bucket_mb`` (the largest bucket it takes), ``rollout_server.weight_load``
(vLLM's NCCL receive path) and ``rollout_server.auth_token`` (who may push). What travels for an adapter is
``model.adapter.sync`` (merged weights or the adapter alone).

:func:`check_weight_sync_rules` is called by :func:`common.config.load._check_rules` with the whole config and
the problem collector (every problem names the dotted key, the value and the fix).

Example::

    weight_sync:
      transport: auto        # ipc on a shared GPU, nccl to a vLLM server, else http
      mode: overlap          # rank 0 pushes from a thread while every rank trains on
      every_steps: 4         # ver += 1 every 4 optimizer steps
      fence: abort           # in-flight rollouts are cut and re-run under the new ver

What this module does not know: how a push runs (learner/weight_sync/), or how a server takes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from common.config.fields import doc


@dataclass
class WeightSyncConfig:
    """Weight sync: learner rank 0 pushes its weights to every rollout server (docs/learner.md, Weight sync)."""

    transport: Literal["auto", "http", "nccl", "ipc"] = doc(
        "http = packed buckets over HTTP (any host); nccl = NCCL broadcast (GPU to other GPUs); ipc = the server "
        "copies from the learner's memory (same GPU: CUDA IPC; CPU: /dev/shm); auto = ipc when the server "
        "serves on the learner's GPU, else nccl to a vLLM server from a CUDA learner, else http.", "auto"
    )
    mode: Literal["blocking", "overlap"] = doc(
        "blocking = barrier → rank 0 push → barrier (every rank stalls for the push); overlap = rank 0 pushes a "
        "snapshot from a background thread while every rank trains on, the new ver adopted at the first step "
        "boundary after the commit (stage2_ab.channel_b.mode async only; docs/learner.md).",
        "blocking",
    )
    every_steps: int = doc("Push weights to the servers (ver += 1) every N optimizer steps, and once at start.", 1)
    bucket_mb: int = doc("Bucket size for weight transfer (≤ rollout_server.max_bucket_mb).", 512)
    timeout_s: float = doc("Deadline for a whole sync (fence + wire + commit).", 300.0)
    fence: Literal["drain", "abort"] = doc("Server fence: drain in-flight /infer, or abort them (clients retry).", "drain")
    master_addr: str = doc(
        "nccl: address of learner rank 0 that the server workers reach for the weight-transfer rendezvous "
        "(a free port is picked per group).", "127.0.0.1"
    )


def check_weight_sync_rules(cfg: Any, problems: Any) -> None:
    """Overlap only where rollouts run beside training; counts positive; buckets the server takes.
    ``problems.add(key, value, why, fix)``."""
    ws, mode = cfg.weight_sync, cfg.stage2_ab.channel_b.mode
    if ws.mode == "overlap" and mode != "async":
        problems.add("weight_sync.mode", ws.mode,
                     f"overlap is for stage2_ab.channel_b.mode async; {mode} mode rolls out against the server inside "
                     "its own B steps, so they would wait at the server's sync fence for the push anyway (and step is "
                     "the synchronous baseline)", "use weight_sync.mode: blocking, or stage2_ab.channel_b.mode: async")
    for key in ("every_steps", "bucket_mb"):
        value = getattr(ws, key)
        if isinstance(value, int) and value < 1:
            problems.add(f"weight_sync.{key}", value, "must be ≥ 1", f"set weight_sync.{key} to at least 1")
    srv = cfg.rollout_server
    if isinstance(srv.max_bucket_mb, int) and isinstance(ws.bucket_mb, int) and srv.max_bucket_mb < ws.bucket_mb:
        problems.add("rollout_server.max_bucket_mb", srv.max_bucket_mb,
                     f"below weight_sync.bucket_mb {ws.bucket_mb}: every bucket would be refused",
                     "raise rollout_server.max_bucket_mb or lower weight_sync.bucket_mb")
