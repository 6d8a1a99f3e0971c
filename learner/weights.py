"""Weight sync from the learner to the rollout servers, blocking mode (design section 4).

At a step boundary every ``stage2_ab.channel_b.async.sync_every_steps`` optimizer steps, and once
at start (fresh or resumed)::

    every rank: barrier("before the push")                     all ranks stop at the boundary
    rank 0:     WeightSyncClient.push(full weights, bucketed)  init → begin (server fence) → buckets → commit
                per server, bounded by rollout_matching.vllm.sync.timeout_s
    every rank: barrier("after the push")                      unblocked when rank 0 returns (or fails)
    every rank: broadcast [ver, ok] from rank 0                every rank adopts the same ver before the next decision

Only rank 0 constructs a client or opens a connection; the other ranks only take part in the
collectives (no rank-dependent branch around a collective: the three collectives run on every rank
whatever happens on rank 0).

A failed or timed-out push (server down, 409, 5xx, deadline) is **not fatal**: rank 0 logs the
error naming the server URL and the command that starts it, counts ``sync/failures``, and every
rank keeps the old ``ver``. Training goes on with A steps and with B packs that are still within
the version window of the old ``ver``; the next due boundary tries again. The server keeps its old
weights and ``ver`` on any failed sync (its fence guarantees it), so learner and server still agree
on what ``ver`` means.

What this module does not know: queues, the schedule, or how the server stages weights.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.distributed import Dist

log = logging.getLogger(__name__)

SERVER_START_HINT = "python -m rollout_server --config CONFIG"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The HF module under DDP / torch.compile wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """HF parameter names and tensors, tied parameters once (under the name ``named_parameters`` keeps)."""
    for name, p in unwrap(model).named_parameters():
        yield name, p.detach()


@dataclass
class SyncResult:
    """What every rank learns from one sync (identical on every rank after the broadcast)."""

    ok: bool
    ver: int
    metrics: dict[str, float] = field(default_factory=dict)  # rank 0's timings; empty on other ranks


class WeightSync:
    """The blocking sync protocol of the module docstring, with its cadence and counters."""

    def __init__(self, cfg: Any, dist: Dist) -> None:
        self.dist = dist
        vcfg = cfg.rollout_matching.vllm
        self.servers = [s.base_url for s in vcfg.servers]
        self.bucket_bytes = int(vcfg.sync.bucket_mb) * 2**20
        self.timeout_s = float(vcfg.sync.timeout_s)
        self.fence = vcfg.sync.fence
        self.transport = vcfg.sync.transport  # auto: nccl when this rank has CUDA and the server runs vLLM
        self.master_addr = vcfg.sync.master_addr
        self.connect_timeout_s = float(vcfg.connect_timeout_s)
        self.every = int(cfg.stage2_ab.channel_b.async_.sync_every_steps)
        self.auth_token = cfg.rollout_server.auth_token
        self._clients: dict[str, Any] = {}
        self.last_sync_step: int | None = None
        self.counts = {"sync/attempts": 0, "sync/successes": 0, "sync/failures": 0}
        self.client_calls = 0  # pushes this rank issued (stays 0 on every rank but 0)

    def due(self, step: int) -> bool:
        """First boundary of this process, then every ``sync_every_steps`` (same answer on every rank)."""
        return self.last_sync_step is None or step - self.last_sync_step >= self.every

    def _client(self, base_url: str) -> Any:
        if base_url not in self._clients:
            from rollout_server.sync_client import WeightSyncClient  # deferred: rank 0 only

            kw = dict(auth_token=self.auth_token, timeout_s=self.timeout_s, connect_timeout_s=self.connect_timeout_s,
                      client_id=f"learner-rank{self.dist.rank}@{socket.gethostname()}:{os.getpid()}")
            client = WeightSyncClient(base_url, **kw)
            nccl = self.transport == "nccl" or (
                self.transport == "auto" and torch.cuda.is_available() and client.health().engine == "vllm")
            if nccl:
                from learner.nccl_sync import NcclWeightSender  # GPU path: dedicated NCCL group, packed broadcasts

                client.close()
                client = NcclWeightSender(base_url, master_addr=self.master_addr, **kw)
            log.info("weight sync to %s over %s", base_url, "nccl" if nccl else "http")
            self._clients[base_url] = client
        return self._clients[base_url]

    def run(self, model: torch.nn.Module, step: int, ver: int) -> SyncResult:
        """One sync at the boundary before optimizer step ``step``; returns the ver every rank adopts."""
        self.last_sync_step = step
        self.counts["sync/attempts"] += 1
        t0 = time.monotonic()
        self.dist.barrier(f"weight-sync barrier before rank 0's push (step {step})")
        new_ver, ok, metrics = ver, 0, {}
        if self.dist.is_main:
            new_ver, ok, metrics = self._push_all(model, step, ver)
        self.dist.barrier(f"weight-sync barrier after rank 0's push (step {step}; rank 0 talks to {self.servers})")
        new_ver, ok = self.dist.broadcast([new_ver, ok], f"ver broadcast after the weight sync (step {step})")
        self.counts["sync/successes" if ok else "sync/failures"] += 1
        metrics["time/sync_total"] = time.monotonic() - t0
        return SyncResult(ok=bool(ok), ver=new_ver, metrics=metrics)

    def _push_all(self, model: torch.nn.Module, step: int, ver: int) -> tuple[int, int, dict[str, float]]:
        metrics = {"time/sync_fence": 0.0, "time/sync_wire": 0.0, "time/sync_commit": 0.0}
        vers: list[int] = []
        floor = ver + 1  # ver continues from max(server ver, learner/checkpoint ver) + 1; servers converge
        for url in self.servers:
            self.client_calls += 1
            t_push = time.monotonic()
            try:
                report = self._client(url).push(named_weights(model), bucket_bytes=self.bucket_bytes, fence=self.fence,
                                                min_ver=floor)
            except Exception as exc:  # noqa: BLE001 - any failure of the sync keeps training alive (module docstring)
                stale = self._clients.pop(url, None)  # a fresh client (and connection) next time
                if stale is not None and hasattr(stale, "close"):
                    stale.close()
                hint = "" if "rollout_server" in str(exc) else f" Is the rollout server up? Start it with: {SERVER_START_HINT}"
                log.error(
                    "weight sync to %s failed at step %d after %.1fs (deadline rollout_matching.vllm.sync.timeout_s=%.0fs): "
                    "%s: %s. Training continues on the old ver %d (A steps; B packs of vers still in the window).%s",
                    url, step, time.monotonic() - t_push, self.timeout_s, type(exc).__name__, exc, ver, hint,
                )
                return ver, 0, metrics
            vers.append(int(report.ver))  # the client logged the phases and both fingerprints
            floor = max(floor, int(report.ver))
            metrics["time/sync_fence"] += report.fence_s
            metrics["time/sync_wire"] += report.wire_s
            metrics["time/sync_commit"] += report.commit_s
        if len(set(vers)) > 1:
            log.warning("rollout servers report different vers after one sync: %s; using the highest", dict(zip(self.servers, vers)))
        return max(vers), 1, metrics
