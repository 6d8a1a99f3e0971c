"""torch.distributed for the learner: process-group setup and collectives with deadlines.

Every collective here is a tensor collective issued with ``async_op=True`` and waited on with
``learner.collective_timeout_s``; a timeout raises :class:`CollectiveTimeout` naming what was
awaited, where, for how long, and the likely cause (a rank that died or is stuck in a different
collective). Every rank must call the same collectives in the same order: callers never branch on
the rank around one of these (rank-dependent *values* are fine).

Without ``torchrun`` (no ``WORLD_SIZE`` in the environment) :class:`Dist` is a world of one and
every collective is the identity, so ``python learner/main.py`` works with W = 1.

What this module does not know: models, queues, or what the values mean.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

LAUNCH_HINT = "torchrun --nproc_per_node=W learner/main.py --config CONFIG"


class CollectiveTimeout(RuntimeError):
    """A collective did not complete on this rank within the deadline."""


def env_world_size() -> int:
    """The world size torchrun announced (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class Dist:
    """Rank facts plus the collectives the learner uses, each with a deadline and a named purpose."""

    def __init__(self, backend: str = "auto", timeout_s: float = 600.0) -> None:
        self.world_size = env_world_size()
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.backend = backend
        self.timeout_s = float(timeout_s)
        if backend == "nccl":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.initialized = False
        if self.world_size > 1:
            dist.init_process_group(
                backend=backend, timeout=datetime.timedelta(seconds=self.timeout_s),
                device_id=self.device if backend == "nccl" else None,
            )
            self.initialized = True
        self.where = f"rank {self.rank}/{self.world_size} on {socket.gethostname()} pid {os.getpid()}"
        # Collective tensors live where the backend can reach them (NCCL: the GPU; gloo: CPU).
        self._cdev = self.device if backend == "nccl" else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _wait(self, work: Any, what: str) -> None:
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # gloo/NCCL report timeouts and dead peers as RuntimeError subclasses
            raise CollectiveTimeout(self._message(what, exc)) from exc
        if ok is False:
            raise CollectiveTimeout(self._message(what, "wait returned False"))

    def _message(self, what: str, cause: Any) -> str:
        return (
            f"{self.where}: {what} did not complete within learner.collective_timeout_s={self.timeout_s:.0f}s "
            f"({cause}). Likely cause: another rank died or is stuck elsewhere (see its log; every rank must "
            f"run the same steps). Restart with: {LAUNCH_HINT}"
        )

    def barrier(self, what: str) -> None:
        """Wait for every rank; ``what`` names the point (e.g. ``"sync barrier before push, step 12"``)."""
        if self.world_size > 1:
            self._wait(dist.barrier(async_op=True), what)

    def all_reduce(self, values: Sequence[float], op: str, what: str, dtype: torch.dtype = torch.float64) -> list[float]:
        """Element-wise ``op`` (``sum``, ``min`` or ``max``) over ranks of a short list of numbers."""
        t = torch.tensor(list(values), dtype=dtype, device=self._cdev)
        if self.world_size > 1:
            red = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
            self._wait(dist.all_reduce(t, op=red, async_op=True), what)
        return t.cpu().tolist()

    def broadcast(self, values: Sequence[int], what: str, src: int = 0) -> list[int]:
        """Rank ``src``'s list of integers on every rank (the others pass placeholders of equal length)."""
        t = torch.tensor(list(values), dtype=torch.int64, device=self._cdev)
        if self.world_size > 1:
            self._wait(dist.broadcast(t, src=src, async_op=True), what)
        return [int(v) for v in t.cpu().tolist()]

    def all_gather(self, values: Sequence[float], what: str) -> list[list[float]]:
        """Every rank's equal-length list of numbers, indexed by rank."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self._cdev)
        if self.world_size == 1:
            return [t.tolist()]
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._wait(dist.all_gather(out, t, async_op=True), what)
        return [o.cpu().tolist() for o in out]

    def close(self) -> None:
        if self.initialized and dist.is_initialized():
            dist.destroy_process_group()
            self.initialized = False
