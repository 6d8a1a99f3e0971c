"""Whose run a ``training.output_dir`` holds, and what a new start may do to it: resume it, refuse, or move it aside.

A run never overwrites or deletes another run's output. Before anything is written, learner rank 0
(``learner/main.py``) and the launcher (before it starts any process, so a refused run starts
nothing) call :func:`prepare_start`::

    output_dir holds           training.resume finds           training.overwrite  outcome
    no run (absent, logs/...)  -                               -                   fresh start
    a run                      a checkpoint of that run        -                   resume it
    a run                      nothing (resume null, or auto   false               refused, exit 2: the message names
                               without a checkpoint of it)                         the directory, what is there, 3 fixes
    a run                      nothing                         true                the run moves, whole, to
                                                                                   <output_dir>.old-<its start, UTC>;
                                                                                   then a fresh start

"Holds a run" = a non-empty ``metrics.jsonl`` or a ``checkpoints/<step>/`` (``run_info.json`` alone does not:
see :func:`run_contents`).
``resume`` naming a checkpoint path of another run (another run id) into a directory holding a
run is refused too: the two runs' metrics and checkpoints would mix. The run id (uuid4 hex) is
made at a fresh start and kept by every resume (``common/runs/checkpoints.py`` says where it is written).

The same call refuses keys only other commands read (:func:`learner_key_problems`), so that a
refused start writes nothing either.

What this module does not know: torch, ranks, or what a checkpoint holds beyond its run id.
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common.runs.checkpoints import (RUN_INFO, checkpoint_run_id, latest_checkpoint, read_json_object,
                                     resolve_resume_checkpoint, run_id_of, step_checkpoints)

log = logging.getLogger(__name__)


class StartRefused(Exception):
    """A start that would mix with or overwrite another run, or keys this start cannot honour; the text says the fix."""


def run_contents(output_dir: str | Path) -> list[str]:
    """What in ``output_dir`` makes it hold a run, in words (empty: it holds none).

    A ``run_info.json`` alone (a start that failed before its first step: bad model path, a run-time
    config error) is no run: nothing was trained, and refusing the corrected start would only be a
    chore. It is named alongside metrics or checkpoints, whose run it tells.
    """
    out = Path(output_dir)
    found = []
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(f"metrics.jsonl ({sum(1 for _ in metrics.open('rb'))} records)")
    steps = step_checkpoints(out)
    if steps:
        found.append("checkpoints/ " + ", ".join(p.name for p in steps))
    if found and (out / RUN_INFO).is_file():
        info = read_json_object(out / RUN_INFO)
        run = f"run id {info['run_id']}" if info.get("run_id") else "no run id: written before run ids"
        found.append(f"{RUN_INFO} ({run}, started {info.get('started_utc')})")
    return found


def learner_key_problems(cfg: Any) -> list[str]:
    """Keys the Stage-2 learner refuses although the schema takes them (another command reads them)."""
    every = cfg.training.log_every_steps
    if every == 1:
        return []
    return [f"training.log_every_steps = {every!r}: only the warm start reads it; the Stage-2 learner writes a "
            "metrics record every optimizer step (the summary and the plot count records as steps). "
            "Fix: remove it from this config (or set 1)"]


def prepare_start(cfg: Any, *, move: bool = True) -> Path | None:
    """Check the start against ``training.output_dir`` (the table of the module docstring).

    Raises :class:`StartRefused` with every problem; with ``training.overwrite`` and ``move``, moves the
    old run aside and returns where it went (None when nothing moved). ``move=False``: check only
    (``--dry-run``).
    """
    problems = learner_key_problems(cfg)
    t = cfg.training
    out = Path(t.output_dir)
    there = run_contents(out)
    resume_from = _resume_target(t.resume, out, problems)
    if there and resume_from is not None and t.resume != "auto" and checkpoint_run_id(resume_from) != run_id_of(out):
        problems.append(f"training.resume = {t.resume!r} is a checkpoint of run {checkpoint_run_id(resume_from)}, but "
                        f"training.output_dir = {out} holds run {run_id_of(out)}: {'; '.join(there)}. The two runs "
                        f"would mix. Fix: resume into a new training.output_dir (e.g. {_sibling(out, 'resumed')})")
    elif there and resume_from is None and not t.overwrite:
        problems.append(_refusal(out, there, t.resume))
    if problems:
        raise StartRefused("refusing to start:\n" + "\n".join(f"  - {p}" for p in problems))
    if there and resume_from is None and move:  # training.overwrite
        return move_aside(out)
    return None


def move_aside(output_dir: str | Path) -> Path:
    """Rename ``output_dir`` to ``<output_dir>.old-<its run's start, UTC>`` (``-2``, ``-3``... if taken)."""
    out = Path(output_dir)
    started = str(read_json_object(out / RUN_INFO).get("started_utc") or "")
    stamp = started.replace("-", "").replace(":", "").split("+")[0]  # 2026-12-01T10:15:00+00:00 -> 20261201T101500
    stamp = stamp or datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    target, n = _sibling(out, f"old-{stamp}"), 1
    while target.exists():
        n += 1
        target = _sibling(out, f"old-{stamp}-{n}")
    os.rename(out, target)  # same parent directory: atomic, nothing copied, nothing deleted
    log.warning("training.overwrite: the run that was in %s is now in %s (nothing deleted)", out, target)
    return target


def _resume_target(resume: str | None, out: Path, problems: list[str]) -> Path | None:
    try:
        return resolve_resume_checkpoint(resume, out)
    except FileNotFoundError as exc:
        problems.append(str(exc))
        return None


def _refusal(out: Path, there: list[str], resume: str | None) -> str:
    own = latest_checkpoint(out)
    fixes = [f"continue it with training.resume=auto (from checkpoints/{own.name})"] if own is not None else []
    fixes += [f"move it aside with training.overwrite=true (to {out}.old-<its start time>; nothing is deleted)",
              f"start in another directory, e.g. training.output_dir={_sibling(out, '2')}"]
    why = ("training.resume = auto found no checkpoint of that run to continue. " if resume == "auto" and own is None
           else "")
    return (f"training.output_dir = {out} holds a run: {'; '.join(there)}. {why}A new run there would mix with it "
            f"(its metrics.jsonl, its checkpoints). Fix, one of: {'; '.join(fixes)}")


def _sibling(out: Path, suffix: str) -> Path:
    return out.with_name(f"{out.name}.{suffix}" if suffix.startswith("old-") else f"{out.name}-{suffix}")
