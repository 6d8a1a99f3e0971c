"""When the learner writes a checkpoint, what of its state goes in, and taking it back on resume.

    Checkpointer(cfg, dist, output_dir)      resolves training.resume (auto | a path | null) once
      load(model, optimizer, scheduler)   ─► Restored: TrainerState, this rank's Channel-A sampler and queue
                                             counters, its B ledger (weights and AdamW state restored in place)
      due(step, last=)                    ─► training.save_every_steps, training.save_final
      save(step, ..., TrainerState, ...)  ─► checkpoints/<step>/ (every rank), then retention (rank 0)

The learner (``learner/rank.py``) decides the moment (after a step, once the push in flight has settled) and
hands over its state as a :class:`TrainerState`; ``learner/checkpoint.py`` owns the files and their layout.

Queues are not checkpointed: packs waiting at save time are re-produced by the actors after a resume (their
keys are not in the ledger), so the saved queue counters drop ``in_queue`` and ``reserved`` from
``received`` and the conservation identity still holds after a resume.

What this module does not know: the file layout (learner/checkpoint.py), the step's order, or the weight sync.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from common.runs import retention
from common.runs.checkpoints import resolve_resume_checkpoint
from learner import checkpoint
from learner.distributed import Dist


@dataclass(frozen=True)
class TrainerState:
    """The learner's part of ``trainer_state.json`` (``checkpoint.save`` adds world_size, parallel, model_path)."""

    run_id: str | None  # the run that wrote it: ``auto`` resume takes only its own run's
    global_step: int  # optimizer steps done
    ver: int  # the weights version the server holds (the push in flight settled before the save)
    totals: dict[str, int]  # learner.run_counters.Totals
    sync_counts: dict[str, int]  # learner/weight_sync's cumulative counts
    recent_kinds_b: list[bool]  # the last REALIZED_WINDOW step kinds (restore the realized ratio)
    realized_total_steps: int
    realized_total_b: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> TrainerState:
        return cls(**{f.name: state.get(f.name) if f.name == "run_id" else state[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class Restored:
    """What a checkpoint gives back to one rank besides its weights and optimizer state."""

    state: TrainerState
    data_a: dict[str, Any]  # the Channel-A sampler position and carry of the windows trained
    queue: dict[str, int]  # the ready queue's counters (waiting packs dropped from ``received``)
    ledger: set[str]  # the B sample ids this rank trained


def saved_queue_counters(counters: dict[str, int]) -> dict[str, int]:
    """The ready queue's counters as a checkpoint stores them: waiting packs (re-produced by the actors after a
    resume) leave ``received``, and ``in_queue`` / ``reserved`` are not kept."""
    c = dict(counters)
    c["received"] -= c["in_queue"] + c["reserved"]
    return {k: v for k, v in c.items() if k not in ("in_queue", "reserved")}


class Checkpointer:
    """One rank's checkpoints of one run (every rank makes one; saving and loading are collectives)."""

    def __init__(self, cfg: Any, dist: Dist, output_dir: str | Path) -> None:
        self.training, self.model_path = cfg.training, cfg.model.path
        self.dist, self.out = dist, Path(output_dir)
        self.resume_from = resolve_resume_checkpoint(cfg.training.resume, self.out)

    def due(self, step: int, *, last: bool) -> bool:
        """``training.save_every_steps`` divides ``step``, or the run's last step under ``training.save_final``."""
        every = self.training.save_every_steps
        return bool(every and step % every == 0) or (last and self.training.save_final)

    def load(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> Restored | None:
        """Restore optimizer, scheduler, RNG (and a ``dcp/`` checkpoint's weights) in place; None on a fresh start."""
        if self.resume_from is None:
            return None
        state, rank_state, ledger = checkpoint.load(self.resume_from, self.dist, model=model, optimizer=optimizer,
                                                    scheduler=scheduler)
        return Restored(TrainerState.from_json(state), rank_state["data_a"], rank_state.get("queue", {}), ledger)

    def save(self, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             state: TrainerState, data_a: dict[str, Any], queue_counters: dict[str, int] | None,
             trained_ids: set[str], final: bool) -> Path:
        """Write checkpoint ``step`` (every rank, at the same boundary), then apply retention on rank 0;
        ``final``: it is the run's last. ``queue_counters``: the ready queue's snapshot (None without a queue)."""
        path = checkpoint.save(
            self.out, step, self.dist, model=model, optimizer=optimizer, scheduler=scheduler,
            model_path=self.model_path, trainer_state=state.to_json(),
            rank_state={"data_a": data_a,  # taken windows only
                        "queue": saved_queue_counters(queue_counters) if queue_counters is not None else {}},
            trained_ids=trained_ids,
        )
        if self.dist.is_main:  # every rank has written and the checkpoint is in place (save's last barrier)
            self.retain(step, final=final)
        return path

    def retain(self, step: int, *, final: bool) -> list[int]:
        """Rank 0: delete the checkpoints ``training.save_total_limit`` / ``keep_best`` drop
        (common/runs/retention.py); ``final``: the checkpoint of ``step`` is the run's final one."""
        return retention.apply_after_save(self.training, self.out, step, final=final, resumed_from=self.resume_from)
