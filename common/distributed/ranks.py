"""A torchrun process group seen from one rank: who it is, joining and leaving, and naming a failed wait.

The learner (``learner/distributed.py``: tensor collectives on gloo or NCCL) and Stage-B
(``stage_b/distributed.py``: object collectives on gloo) run under ``torchrun`` and share the same
facts: the rank, world size and local rank come from the environment torchrun sets; without it the
world is one process and every collective is the identity, so a single-process run takes the same
code path. Both wait on peers with a deadline, and a failed wait must say which rank waited for
what, for how long, under which config key, and what probably happened.

What this module does not know: which collectives a process runs, or what their values mean.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch.distributed as dist


class RankGroup:
    """Rank facts from the torchrun environment, plus the process group when the world is larger than one."""

    def __init__(self, timeout_s: float, *, knob: str) -> None:
        """``knob``: the config key that sets ``timeout_s`` (named in every failure message)."""
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", str(self.rank)))
        self.timeout_s = float(timeout_s)
        self.knob = knob
        self.where = f"rank {self.rank}/{self.world_size} on {socket.gethostname()} pid {os.getpid()}"
        self.initialized = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def join(self, backend: str, device_id: Any = None) -> None:
        """``init_process_group`` from torchrun's env with this group's deadline (a world of one joins nothing)."""
        if self.world_size > 1:
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=self.timeout_s),
                                    device_id=device_id)
            self.initialized = True

    def failure(self, what: str, cause: Any, hint: str) -> str:
        """The message for a wait on the other ranks that failed: who, what, the deadline and its key, why."""
        return (f"{self.where}: {what} did not complete within {self.knob}={self.timeout_s:.0f}s ({cause}). "
                f"Likely cause: another rank died or is stuck elsewhere (see its log; every rank must run the same "
                f"steps). {hint}")

    def close(self) -> None:
        """Leave the process group (idempotent)."""
        if self.initialized and dist.is_initialized():
            dist.destroy_process_group()
        self.initialized = False
