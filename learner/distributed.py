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
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from common.tensors.ranks import RankGroup

log = logging.getLogger(__name__)

LAUNCH_HINT = "torchrun --nproc_per_node=W learner/main.py --config CONFIG"


class CollectiveTimeout(RuntimeError):
    """A collective did not complete on this rank within the deadline."""


def env_world_size() -> int:
    """The world size torchrun announced (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class Dist(RankGroup):
    """Rank facts plus the collectives the learner uses, each with a deadline and a named purpose."""

    def __init__(self, backend: str = "auto", timeout_s: float = 600.0) -> None:
        super().__init__(timeout_s, knob="learner.collective_timeout_s")
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.backend = backend
        if backend == "nccl":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.join(backend, self.device if backend == "nccl" else None)
        # Collective tensors live where the backend can reach them (NCCL: the GPU; gloo: CPU).
        self._cdev = self.device if backend == "nccl" else torch.device("cpu")

    def _wait(self, work: Any, what: str) -> None:
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # gloo/NCCL report timeouts and dead peers as RuntimeError subclasses
            raise CollectiveTimeout(self._message(what, exc)) from exc
        if ok is False:
            raise CollectiveTimeout(self._message(what, "wait returned False"))

    def _message(self, what: str, cause: Any) -> str:
        return self.failure(what, cause, f"Restart with: {LAUNCH_HINT}")

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
