"""The launcher's console progress: one line every few seconds from the run's ``metrics.jsonl``.

The learner, servers and actors log to files (``{output_dir}/logs/``); without this the console of
``tandem launch`` shows nothing between start-up and the summary. The supervisor's loop calls
:meth:`ConsoleProgress.tick` every 0.2 s; the tick reads the lines appended since the last one (rank 0
writes whole, flushed lines) and prints, at most every ``every_s`` seconds and only when something new
arrived::

    step 12/100  A 8 B 4  loss 1.234  val F1 0.452 @10  2.10 s/step  ETA 3m05s

A/B count the run's step records (a resumed run's earlier steps too); ``val F1`` is the latest evaluation
(``@`` its step); s/step and ETA come from the steps this launcher has seen arrive (wall clock, waits
included), so they settle after a few steps. A metrics file replaced under it (``training.overwrite``
moved the old run aside) is read again from its start.

What this module does not know: processes, or what the numbers mean beyond their keys.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO

KIND_B = "stage2_ab/async/step_kind_b"


class ConsoleProgress:
    """Follows one run's ``metrics.jsonl`` (module docstring); ``out`` None = stdout, ``clock`` seconds."""

    def __init__(self, run_dir: str | Path, max_steps: int, *, every_s: float = 10.0, out: TextIO | None = None,
                 clock: Any = time.monotonic) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.max_steps, self.every_s, self.out, self.clock = max_steps, every_s, out, clock
        self._inode: int | None = None
        self._offset = 0
        self._partial = ""
        self._reset()
        self._printed_at: float | None = None
        self._new = False

    def _reset(self) -> None:
        self.steps_a = self.steps_b = 0
        self.done = 0  # optimizer steps completed (the last step record's step + 1)
        self.loss: float | None = None
        self.val_f1: tuple[float, int] | None = None  # (F1, step)
        self._first: tuple[float, int] | None = None  # (time, done) when this launcher saw its first step record

    def tick(self) -> str | None:
        """Read what arrived; print and return a line when one is due, else None."""
        self._read()
        now = self.clock()
        if not self._new or (self._printed_at is not None and now - self._printed_at < self.every_s):
            return None
        line = self.line(now)
        self._printed_at, self._new = now, False
        print(line, file=self.out, flush=True)
        return line

    def line(self, now: float) -> str:
        parts = [f"step {self.done}/{self.max_steps}", f"A {self.steps_a} B {self.steps_b}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.3f}")
        if self.val_f1 is not None:
            parts.append(f"val F1 {self.val_f1[0]:.3f} @{self.val_f1[1]}")
        if self._first is not None and self.done > self._first[1]:
            per_step = (now - self._first[0]) / (self.done - self._first[1])
            parts += [f"{per_step:.2f} s/step", f"ETA {_duration(per_step * max(0, self.max_steps - self.done))}"]
        return "  ".join(parts)

    def _read(self) -> None:
        try:
            st = self.path.stat()
        except OSError:
            return
        if self._inode != st.st_ino or st.st_size < self._offset:  # a new file: start over
            self._inode, self._offset, self._partial = st.st_ino, 0, ""
            self._reset()
        if st.st_size == self._offset:
            return
        with self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read(st.st_size - self._offset)
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk.decode("utf-8", errors="replace")).split("\n")
        for text in lines:
            try:
                rec = json.loads(text)
            except ValueError:
                continue
            if isinstance(rec, dict):
                self._take(rec)
        if self._first is None and self.done:  # after the whole read: a resume's earlier steps are not timed
            self._first = (self.clock(), self.done)

    def _take(self, rec: dict[str, Any]) -> None:
        kind = rec.get("record", "step")
        step = rec.get("step")
        if kind == "eval" and isinstance(rec.get("eval/f1"), (int, float)) and isinstance(step, int):
            self.val_f1, self._new = (float(rec["eval/f1"]), step), True
        elif kind == "step" and isinstance(step, int):
            self.steps_b += bool(rec.get(KIND_B))
            self.steps_a += not rec.get(KIND_B)
            self.done = step + 1
            if isinstance(rec.get("loss/total"), (int, float)):
                self.loss = float(rec["loss/total"])
            self._new = True


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def console_progress(cfg: Any) -> ConsoleProgress:
    """The run's console progress. Always on under the launcher: ``training.progress`` is the tqdm bar in the
    learner's log, which a run may turn off (the demo does) without losing this line."""
    return ConsoleProgress(cfg.training.output_dir, cfg.training.max_steps)
