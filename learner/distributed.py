"""torch.distributed for the learner: process-group setup and collectives with deadlines.

Every collective here is a tensor collective issued with ``async_op=True`` and waited on with
``learner.collective_timeout_s``; a timeout raises :class:`CollectiveTimeout` naming what was
awaited, where, for how long, and the likely cause (a rank that died or is stuck in a different
collective). Every rank must call the same collectives in the same order: callers never branch on
the rank around one of these (rank-dependent *values* are fine).

Without ``torchrun`` (no ``WORLD_SIZE`` in the environment) :class:`Dist` is a world of one and
every collective is the identity, so ``python learner/main.py`` works with W = 1.

Several nodes (``learner.nnodes``): ``rank`` is the global rank (``RANK``: rank-0 duties such as the run
record, metrics, checkpoint files and the weight push belong to global rank 0, on node 0), the device is
chosen by ``LOCAL_RANK`` (``cuda:LOCAL_RANK`` on every node), and a failed wait names this node
(``GROUP_RANK``, which torchrun's static rendezvous sets to ``--node_rank``) and the command that restarts the
nodes. Every rank writes into ``training.output_dir`` (checkpoint files per rank) and reads ``run_info.json``
there, so the nodes must share it: :meth:`Dist.check_shared_dir` refuses a start where they do not.

What this module does not know: models, queues, or what the values mean.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from common.distributed.ranks import RankGroup

log = logging.getLogger(__name__)

LAUNCH_HINT = "torchrun --nproc_per_node=W learner/main.py --config CONFIG"
NODES_HINT = ("A learner node that died (machine, launcher or torchrun) fails every collective: read the logs of "
              "every node (training.output_dir/logs/node<k>/). Restart every node: python -m launcher --config CONFIG "
              "launcher.node_rank=<k>")


class SharedDirError(RuntimeError):
    """The learner nodes do not see the same ``training.output_dir``."""


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

    @property
    def node(self) -> tuple[int, int]:
        """(this node, learner nodes) from torchrun's ``GROUP_RANK`` and ``LOCAL_WORLD_SIZE``; (0, 1) on one node."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world_size)))
        return int(os.environ.get("GROUP_RANK", "0")), max(1, self.world_size // max(1, local))

    def _message(self, what: str, cause: Any) -> str:
        node, nodes = self.node
        if nodes > 1:
            return self.failure(what, cause, f"This is learner node {node} of {nodes}. {NODES_HINT}")
        return self.failure(what, cause, f"Restart with: {LAUNCH_HINT}")

    @contextlib.contextmanager
    def peer_failures_named(self) -> Iterator[None]:
        """Around the training loop: a collective that fails outside :meth:`_wait` because a peer rank died (DDP's
        gradient all-reduce: gloo says "Connection closed/reset by peer" at once; NCCL's watchdog acts after
        ``learner.collective_timeout_s``) is re-raised as :class:`CollectiveTimeout` naming this rank, its node
        and the restart command, so a dead learner node ends the run with that message on every other node."""
        try:
            yield
        except RuntimeError as exc:
            text = str(exc)
            if self.world_size == 1 or isinstance(exc, CollectiveTimeout) or not (
                    isinstance(exc, dist.DistError) or any(k in text for k in ("by peer", "gloo", "NCCL"))):
                raise
            raise CollectiveTimeout(self._message("a collective with the other ranks (a step's gradient all-reduce)",
                                                  text.splitlines()[0] if text else type(exc).__name__)) from exc

    def check_shared_dir(self, output_dir: str) -> None:
        """Every rank reads the same run id from ``output_dir/run_info.json`` (global rank 0 wrote it before
        joining), or :class:`SharedDirError` on every rank: a node with its own local copy of output_dir would
        write its checkpoint files where node 0 never looks. Every rank calls it (two collectives)."""
        from common.runs.checkpoints import run_id_of

        run_id = run_id_of(output_dir)
        mine = int(run_id[:15], 16) if run_id and all(c in "0123456789abcdef" for c in run_id[:15]) else -1
        root = self.broadcast([mine], "shared output_dir check: rank 0's run id")[0]
        bad = self.all_reduce([float(mine != root)], "max", "shared output_dir check: any rank differs")[0]
        if bad:
            seen = ("the same run" if mine == root else "no run_info.json" if mine == -1
                    else "another run's run_info.json")
            node, nodes = self.node
            raise SharedDirError(
                f"{self.where} (learner node {node} of {nodes}): training.output_dir = {output_dir} is not the same "
                f"directory on every learner node (here: {seen}; rank 0 wrote run_info.json there before joining). "
                "Fix: put training.output_dir on a filesystem every learner node mounts at the same path (NFS, "
                "Lustre, ...): checkpoints and the run record are written there by every rank")

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
