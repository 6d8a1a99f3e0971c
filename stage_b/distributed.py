"""Ticket-parallel distribution: batch/shard arithmetic, placement, and fail-fast collectives.

Pure functions (no process group needed, unit-tested directly):

  - :func:`global_batches` cuts an epoch's order into global batches of ``P × W`` tickets; only the
    last may be shorter.
  - :func:`shard_bounds` gives rank ``r`` its contiguous slice of one global batch: the first
    ``B % W`` ranks get ``B // W + 1`` tickets, the others ``B // W``. For a full batch that is
    exactly P each; the union is the batch, nothing twice.
  - :func:`resolve_placement` forces ``device_map: auto`` to the local rank's device under
    WORLD_SIZE > 1, so every rank holds the whole model (no accidental model parallelism).

:class:`Dist` wraps the process group. Every collective runs on gloo (objects are small: guidance,
shard results) with the group's ``timeout``, so a dead or stuck peer turns into an error on the
waiting ranks instead of a hang. Failures are propagated two ways:

  - a rank-local step (setup, rollout) runs under :meth:`Dist.guarded`: the exception is caught
    and every rank learns of it through an ``all_gather_object`` of an ok/error status, then every
    rank raises :class:`RankFailure` naming the failed rank(s) and their error;
  - rank 0's own work (selection, reflection, writing) is followed by a broadcast command; a failure
    there is broadcast as ``abort`` so the other ranks, waiting for the next batch, raise too.

With WORLD_SIZE unset or 1 there is no process group and every collective is the identity, so
single-process runs take the same code path.
"""

from __future__ import annotations

import datetime
import logging
import random
import traceback
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch.distributed as torch_dist

from common.distributed.ranks import RankGroup

log = logging.getLogger(__name__)
T = TypeVar("T")


# ----------------------------------------------------------------------------------- pure arithmetic


def global_batches(num_items: int, global_batch_size: int) -> list[tuple[int, int]]:
    """[start, end) of each global batch over ``num_items``; only the last may be shorter."""
    if global_batch_size < 1:
        raise ValueError(f"global batch size must be ≥ 1, got {global_batch_size}")
    return [(s, min(s + global_batch_size, num_items)) for s in range(0, num_items, global_batch_size)]


def shard_bounds(batch_len: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of ``rank``'s contiguous shard of a global batch of ``batch_len`` tickets.

    Example: batch_len 7, world 3 → rank 0 [0, 3), rank 1 [3, 5), rank 2 [5, 7).
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world {world}")
    if batch_len < 0:
        raise ValueError(f"batch length must be ≥ 0, got {batch_len}")
    base, extra = divmod(batch_len, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def epoch_order(num_items: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The ticket order of one epoch; a pure function, so every rank computes the same one."""
    order = list(range(num_items))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order


@dataclass(frozen=True)
class Placement:
    """Where a rank's model lives. ``device_map`` is passed to from_pretrained only when set."""

    device: str  # where inputs go: "cpu" or "cuda:N"
    device_map: Any = None  # None = load then .to(device); "auto" = transformers spreads one process over GPUs


def resolve_placement(device_map: str, world: int, local_rank: int, num_gpus: int) -> Placement:
    """Map ``model.device_map`` to a placement; ``auto`` under WORLD_SIZE > 1 means the local rank's GPU.

    ``num_gpus`` = visible CUDA devices. A single process with one GPU loads onto it directly
    (transformers' ``device_map`` would need accelerate for the same result); with several GPUs it
    keeps ``auto`` so transformers spreads a model too big for one.
    """
    if device_map == "auto":
        if num_gpus == 0:
            return Placement("cpu")
        if world > 1:
            return Placement(f"cuda:{local_rank}")  # forced: each rank replicates the full model
        return Placement("cuda:0", "auto" if num_gpus > 1 else None)
    if device_map.startswith("cuda") and world > 1:
        return Placement(f"cuda:{local_rank}")  # an explicit single GPU cannot be shared by every rank
    return Placement(device_map)


# ----------------------------------------------------------------------------------- the group


#: Seconds every rank waits at the end for the others before leaving the group (Dist.close).
CLOSE_BARRIER_S = 10.0


class RankFailure(RuntimeError):
    """Some rank failed; raised on every rank so the whole run exits non-zero."""


@dataclass
class Status:
    """One rank's outcome of a guarded step."""

    rank: int
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class Command:
    """Rank 0 → all, once per global batch: go with this guidance snapshot, or abort, or done."""

    kind: str  # "rollout" | "abort" | "done"
    payload: Any = None  # the guidance snapshot for "rollout"; the reason for "abort"


class Dist(RankGroup):
    """The run's process group (or its single-process stand-in): object collectives on gloo.

    The same job, and name, as the learner's ``learner.distributed.Dist`` (both a
    ``common.distributed.ranks.RankGroup``: rank facts, joining, deadlines, failure messages); Stage-B's
    collectives carry Python objects (guidance, shard results), the learner's short tensors on gloo or NCCL.
    """

    _dist: Any = None  # torch.distributed once joined; None = a world of one (collectives are the identity)

    def __init__(self, timeout_s: float) -> None:
        super().__init__(timeout_s, knob="runner.collective_timeout_s")
        self.world = self.world_size

    @classmethod
    def from_env(cls, timeout_s: float) -> "Dist":
        """Join the torchrun group (env://, gloo, ``timeout_s`` on every collective), or run alone."""
        group = cls(timeout_s)
        group.join("gloo")
        if group.initialized:
            group._dist = torch_dist
            log.info("stage-b rank %d/%d joined (gloo, collective timeout %.0fs)", group.rank, group.world, timeout_s)
        return group

    def close(self) -> None:
        """Leave the group. First a monitored barrier (gloo, at most :data:`CLOSE_BARRIER_S`): a rank that
        tore its connections down while a peer was still inside the last collective (rank 0 right after
        broadcasting "done") made that peer's receive abort the process (CI: "terminate called without an
        active exception"). A peer that is gone or stuck only costs this deadline, logged."""
        if self._dist is not None and self._dist.is_initialized():
            try:
                self._dist.monitored_barrier(timeout=datetime.timedelta(seconds=CLOSE_BARRIER_S))
            except Exception as exc:  # noqa: BLE001 - leaving anyway; the run's own outcome is already decided
                log.warning("rank %d: not every rank reached the end of the run within %.0fs (%s); leaving the group",
                            self.rank, CLOSE_BARRIER_S, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        super().close()
        self._dist = None

    # --- collectives (identity for world 1); each names what it waits for in its error
    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as exc:  # gloo raises RuntimeError on timeout or a closed peer
            raise RankFailure(self.failure(f"collective '{what}' with the other {self.world - 1} rank(s)", exc,
                                           "Restart the Stage-B run (make stage-b)")) from exc

    def broadcast(self, obj: Any, what: str) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self._dist is None:
            return obj
        box = [obj if self.rank == 0 else None]
        self._call(what, lambda: self._dist.broadcast_object_list(box, src=0))
        return box[0]

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        if self._dist is None:
            return [obj]
        out: list[Any] = [None] * self.world
        self._call(what, lambda: self._dist.all_gather_object(out, obj))
        return out

    def gather(self, obj: Any, what: str) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (rank order); None elsewhere."""
        if self._dist is None:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._call(what, lambda: self._dist.gather_object(obj, out, dst=0))
        return out

    def guarded(self, what: str, fn: Callable[[], T]) -> T:
        """Run a rank-local step; if it raised on ANY rank, raise RankFailure on every rank."""
        result: Any = None
        try:
            result = fn()
            status = Status(self.rank, True)
        except Exception as exc:
            log.error("rank %d failed during %s:\n%s", self.rank, what, traceback.format_exc())
            status = Status(self.rank, False, f"{type(exc).__name__}: {exc}")
        statuses = self.all_gather(status, f"{what} status")
        failed = [s for s in statuses if not s.ok]
        if failed:
            names = "; ".join(f"rank {s.rank}: {s.error}" for s in failed)
            raise RankFailure(f"{what} failed on {len(failed)} of {self.world} rank(s): {names}")
        return result

    def agree(self, value: Any, what: str) -> None:
        """Every rank must hold the same ``value`` (e.g. the ticket fingerprint)."""
        values = self.all_gather(value, what)
        if len(set(map(repr, values))) > 1:
            raise RankFailure(f"ranks disagree on {what}: {dict(enumerate(values))}. Fix: give every rank the same input")
