"""Where checkpoints live and what every process reads from them: the run, the latest, the one to resume, the B ledger.

The learner writes checkpoints (``learner/checkpoint.py``); the actors read them on resume (the B
ledger tells each actor's stream which keys were trained) and so does the run record. This module is
the one place that knows the layout both sides share::

    {output_dir}/checkpoints/<step>/            a finished checkpoint (an integer directory name)
    {output_dir}/checkpoints/.tmp-<step>/       one being written (ignored here)
    {output_dir}/checkpoints/.deleting-<step>/  one being deleted by retention (ignored here; common/runs/retention.py)
    <checkpoint>/b_ledger_rank<r>.json          {"rank": r, "trained_ids": [B keys rank r trained]}
    <checkpoint>/trainer_state.json             {"run_id": ..., "global_step": ..., "parallel": ..., ...}
    <checkpoint>/model/                         ddp: the HF model directory (weights in safetensors)
    <checkpoint>/dcp/.metadata                  fsdp: the sharded weights + AdamW state (torch.distributed.checkpoint)
    {output_dir}/run_info.json                  {"run_id": ..., ...}: the directory's run (learner/run_record.py)

A run id (uuid4 hex) is made at a run's fresh start and kept by its resumes. ``auto`` resume picks only
checkpoints of the directory's run: trainer_state.json's ``run_id`` equal to run_info.json's (a
directory written before run ids: both absent). So a checkpoint another run left behind is never resumed.

No torch: reading a ledger must not need the learner's dependencies.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

RUN_INFO = "run_info.json"


def checkpoints_root(output_dir: str | Path) -> Path:
    """``{output_dir}/checkpoints``."""
    return Path(output_dir) / "checkpoints"


def ledger_path(checkpoint_dir: str | Path, rank: int) -> Path:
    """The B-ledger file learner rank ``rank`` writes into a checkpoint."""
    return Path(checkpoint_dir) / f"b_ledger_rank{rank}.json"


def write_b_ledger(checkpoint_dir: str | Path, rank: int, trained_ids: set[str]) -> None:
    """Rank ``rank``'s ledger: every B key it trained before this checkpoint (sorted: stable bytes)."""
    ledger_path(checkpoint_dir, rank).write_text(json.dumps({"rank": rank, "trained_ids": sorted(trained_ids)}))


def read_json_object(path: Path) -> dict:
    """A JSON object file (run_info.json, trainer_state.json); {} when it is missing, torn or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def run_id_of(output_dir: str | Path) -> str | None:
    """The run id of the run that owns ``output_dir`` (run_info.json's ``run_id``); None if none is recorded."""
    return read_json_object(Path(output_dir) / RUN_INFO).get("run_id")


def checkpoint_run_id(checkpoint_dir: str | Path) -> str | None:
    """The run id a checkpoint was written by (its trainer_state.json's ``run_id``; None before run ids)."""
    return read_json_object(Path(checkpoint_dir) / "trainer_state.json").get("run_id")


def step_checkpoints(output_dir: str | Path) -> list[Path]:
    """Every finished checkpoint directory under ``output_dir``, by step, whatever run wrote it."""
    root = checkpoints_root(output_dir)
    steps = [p for p in root.glob("*") if p.is_dir() and p.name.isdigit()] if root.is_dir() else []
    return sorted(steps, key=lambda p: int(p.name))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """``{output_dir}/checkpoints/<step>`` of the directory's own run (:func:`run_id_of`) with the largest step."""
    run_id = run_id_of(output_dir)
    own = [p for p in step_checkpoints(output_dir) if checkpoint_run_id(p) == run_id]
    others = len(step_checkpoints(output_dir)) - len(own)
    if others:
        log.warning("%s: %d checkpoint(s) of another run (not run id %s) are never resumed", output_dir, others, run_id)
    return own[-1] if own else None


def resolve_resume_checkpoint(resume: str | None, output_dir: str | Path) -> Path | None:
    """``training.resume`` -> the checkpoint directory to read (None = fresh start)."""
    if not resume:
        return None
    if resume == "auto":
        return latest_checkpoint(output_dir)
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"training.resume={resume!r} is not a checkpoint directory; use auto or a path "
                                f"such as {Path(output_dir) / 'checkpoints' / '<step>'}")
    return path


class NotACheckpoint(ValueError):
    """A path given as a checkpoint that is none (or an unfinished one); the text says what is missing and the fix."""


def checkpoint_parallel(path: str | Path) -> str:
    """``"ddp"`` (a ``model/`` directory) or ``"fsdp"`` (a ``dcp/`` directory) for a finished checkpoint;
    raises :class:`NotACheckpoint` naming what ``path`` is instead."""
    path = Path(path)
    example = "OUTPUT_DIR/checkpoints/<step>"
    if not path.is_dir():
        raise NotACheckpoint(f"{path} is not a directory. Fix: pass a checkpoint directory, {example}")
    if path.name.startswith(".tmp-"):
        raise NotACheckpoint(f"{path} is a checkpoint being written, or left half-written by a crash. Fix: pass a "
                             f"finished one ({path.parent}/<step>)")
    if not (path / "trainer_state.json").is_file():
        steps = step_checkpoints(path)
        if steps:
            raise NotACheckpoint(f"{path} is a run's output directory, not a checkpoint. Fix: pass one of its "
                                 f"checkpoints, e.g. the latest: {steps[-1]}")
        raise NotACheckpoint(f"{path} is not a checkpoint directory (no trainer_state.json). Fix: pass {example}")
    if (path / "dcp").is_dir():
        if not (path / "dcp" / ".metadata").is_file():
            raise NotACheckpoint(f"{path / 'dcp'} has no .metadata: the sharded checkpoint is incomplete (copied in "
                                 "part?). Fix: copy the whole checkpoint directory, or pass another checkpoint")
        return "fsdp"
    if (path / "model").is_dir():
        return "ddp"
    raise NotACheckpoint(f"{path} has neither model/ (a ddp checkpoint) nor dcp/ (an fsdp checkpoint): copied in "
                         "part? Fix: copy the whole checkpoint directory, or pass another checkpoint")


def read_b_ledger(checkpoint_dir: str | Path | None, rank: int) -> set[str]:
    """Keys learner rank ``rank`` trained before ``checkpoint_dir`` was written (empty set if none).

    Accepts ``b_ledger.json`` holding ``{"rank": r, "trained_ids": [...]}`` or a list of such maps
    (one per rank), and per-rank files ``b_ledger_rank<r>.json`` of the same shape.
    """
    if checkpoint_dir is None:
        return set()
    keys: set[str] = set()
    found = False
    for path in sorted(Path(checkpoint_dir).glob("b_ledger*.json")):
        found = True
        data = json.loads(path.read_text(encoding="utf-8"))
        entries = data if isinstance(data, list) else [data]
        for entry in entries:
            if isinstance(entry, dict) and int(entry.get("rank", -1)) == rank:
                keys.update(str(k) for k in entry.get("trained_ids", []))
    if not found:
        log.warning("resume from %s: no b_ledger*.json there; the B stream restarts from its beginning", checkpoint_dir)
    return keys
