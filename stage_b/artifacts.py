"""Rank 0's artifact directory, ``{output.root}/{run_name}/{mission_slug}/``.

Only rank 0 ever constructs an :class:`ArtifactWriter`; the other ranks hold ``None`` and have no
code path that opens a file under the output root. Every path written is recorded in
:attr:`ArtifactWriter.written`, so a test can compare it with what is on disk.

Files (JSONL = one record per line, appended in global batch order):

  ===========================  ==============================================================
  trajectories.jsonl           every candidate: ticket, rank, guidance_step, decode, text, parse
  selections.jsonl             one per selected ticket: verdict, votes, vote_strength, learnable
  failure_malformed.jsonl      tickets without a usable candidate, with the failure reason
  reflection.jsonl             one per reflection cycle: trigger, attempts, operations, steps
  need_review_queue.jsonl      learnable tickets reflection could not use, with the reason
  metrics.jsonl                one per global batch (``kind: batch``) and per epoch
  guidance.json                the current guidance (``step``, experiences)
  guidance_snapshots/          step_NNNNNN.json, the newest ``guidance.snapshot_retention``
  need_review.json             end of run: need-review keys grouped by reason
  run_summary.json             end of run: status (ok | failed + error), counts, world size, rank 0's
                               timing (runner.RunTiming), every file written here (``files``)
  ===========================  ==============================================================
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import IO, Any

JSONL = ("trajectories", "selections", "failure_malformed", "reflection", "need_review_queue", "metrics")


class ArtifactWriter:
    def __init__(self, run_dir: Path, overwrite: bool) -> None:
        self.run_dir = run_dir
        if run_dir.exists() and any(run_dir.iterdir()):
            if not overwrite:
                raise FileExistsError(f"{run_dir} already holds artifacts. Fix: set output.overwrite=true "
                                      "or choose another run_name")
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.written: set[Path] = set()
        self._files: dict[str, IO[str]] = {}
        for name in JSONL:  # every JSONL exists from the start (empty = nothing of that kind happened)
            path = run_dir / f"{name}.jsonl"
            self._files[name] = open(path, "a", encoding="utf-8")
            self.written.add(path)

    def note(self, path: Path) -> None:
        """Record a file written by someone else on rank 0 (the guidance repo)."""
        self.written.add(path)

    def append(self, name: str, record: dict[str, Any]) -> None:
        if name not in JSONL:
            raise KeyError(f"unknown artifact {name!r}; known: {JSONL}")
        self._files[name].write(json.dumps(record, ensure_ascii=False, default=str) + "\n")

    def write_json(self, name: str, obj: Any) -> Path:
        path = self.run_dir / name
        path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, default=str), encoding="utf-8")
        self.written.add(path)
        return path

    def flush(self) -> None:
        for f in self._files.values():
            f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
