"""The versioned mission guidance: experiences the rollout prompt shows, changed only by reflection.

Lives on rank 0 only. ``step`` starts at 0 and increases by one for every reflection cycle that
applies at least one operation. Each change rewrites ``guidance.json`` (atomically) and adds
``guidance_snapshots/step_NNNNNN.json``; the newest ``snapshot_retention`` snapshots are kept.

Other ranks never see this object: once per global batch rank 0 broadcasts :meth:`snapshot`
(an immutable :class:`GuidanceSnapshot`) and every rank builds that whole batch's prompts from it,
so a reflection in the middle of a batch is visible from the next batch on, everywhere at once.

Operations (see :mod:`stage_b.prompts` for the JSON) are validated one by one; an invalid one is
skipped with its reason, the others still apply:

  - every op needs ``evidence``: ticket keys of the reflected batch (keys outside it are ignored;
    none left = invalid ``no_evidence_in_batch``);
  - ``upsert``: non-empty ``text``; an existing ``id`` is rewritten, otherwise a new id is assigned;
  - ``remove``: an existing ``id``;
  - ``merge``: ``ids`` = two or more existing ids and a ``text``; they are replaced by one new id.

What this module does not know: models, prompts, ranks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection

SNAPSHOT_DIR = "guidance_snapshots"


@dataclass(frozen=True)
class GuidanceSnapshot:
    """What every rank uses for one global batch (broadcast by rank 0)."""

    step: int
    experiences: tuple[tuple[str, str], ...]  # (id, text) in id order


@dataclass
class Experience:
    text: str
    evidence: list[str]
    added_step: int
    updated_step: int


@dataclass
class ApplyResult:
    step_before: int
    step_after: int
    applied: list[dict[str, Any]] = field(default_factory=list)
    invalid: list[dict[str, Any]] = field(default_factory=list)  # {"op": ..., "why": ...}
    dropped_over_cap: int = 0

    @property
    def evidence(self) -> set[str]:
        return {k for op in self.applied for k in op["evidence"]}


def load_seed(path: str | Path | None) -> list[str]:
    """Initial experience texts from a guidance JSON (dict of id→text, list, or {"experiences": ...})."""
    if path is None:
        return []
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if isinstance(data, dict) and "experiences" in data:
        data = data["experiences"]
    if isinstance(data, dict):
        return [str(v) for _, v in sorted(data.items())]
    if isinstance(data, list):
        return [str(x["text"] if isinstance(x, dict) else x) for x in data]
    raise ValueError(f"{path}: guidance JSON must hold experiences as a list or an id→text mapping")


class GuidanceRepo:
    """Rank 0's guidance store; ``write`` persists (None = in memory, for tests)."""

    def __init__(self, mission: str, run_dir: Path | None, seed_texts: list[str], retention: int,
                 on_write: Callable[[Path], None] | None = None) -> None:
        self.mission, self.run_dir, self.retention = mission, run_dir, retention
        self.step = 0
        self._next_id = 0
        self._on_write = on_write or (lambda p: None)
        self.experiences: dict[str, Experience] = {}
        for text in seed_texts:
            self.experiences[self._new_id()] = Experience(text, [], 0, 0)
        self._persist()

    def _new_id(self) -> str:
        eid = f"G{self._next_id}"
        self._next_id += 1
        return eid

    def snapshot(self) -> GuidanceSnapshot:
        items = sorted(self.experiences.items(), key=lambda kv: int(kv[0][1:]) if kv[0][1:].isdigit() else 1 << 30)
        return GuidanceSnapshot(self.step, tuple((eid, e.text) for eid, e in items))

    def apply(self, ops: list[Any], batch_keys: Collection[str], max_ops: int) -> ApplyResult:
        """Validate and apply ``ops`` in order; step += 1 once if anything applied."""
        res = ApplyResult(self.step, self.step)
        next_step = self.step + 1
        for op in ops:
            why = self._apply_one(op, set(batch_keys), next_step) if len(res.applied) < max_ops else "over_cap"
            if why == "over_cap":
                res.dropped_over_cap += 1
            elif why:
                res.invalid.append({"op": op, "why": why})
            else:
                res.applied.append(op)
        if res.applied:
            self.step = next_step
            res.step_after = self.step
            self._persist()
        return res

    def _apply_one(self, op: Any, batch_keys: set[str], step: int) -> str | None:
        if not isinstance(op, dict) or op.get("op") not in ("upsert", "remove", "merge"):
            return "unknown_op"
        ev = op.get("evidence")
        if not isinstance(ev, list):
            return "evidence_not_a_list"
        ev = [k for k in ev if isinstance(k, str) and k in batch_keys]
        if not ev:
            return "no_evidence_in_batch"
        op["evidence"] = ev
        kind, text = op["op"], op.get("text")
        if kind in ("upsert", "merge") and not (isinstance(text, str) and text.strip()):
            return "missing_text"
        if kind == "upsert":
            eid = op.get("id")
            if isinstance(eid, str) and eid in self.experiences:
                e = self.experiences[eid]
                e.text, e.updated_step, e.evidence = text.strip(), step, sorted(set(e.evidence) | set(ev))
            else:
                op["id"] = self._new_id()
                self.experiences[op["id"]] = Experience(text.strip(), ev, step, step)
            return None
        if kind == "remove":
            if op.get("id") not in self.experiences:
                return "unknown_id"
            del self.experiences[op["id"]]
            return None
        ids = op.get("ids")
        if not isinstance(ids, list) or len(set(map(str, ids))) < 2 or any(i not in self.experiences for i in ids):
            return "merge_needs_two_existing_ids"
        merged_ev = sorted({k for i in ids for k in self.experiences[i].evidence} | set(ev))
        for i in ids:
            del self.experiences[i]
        op["new_id"] = self._new_id()
        self.experiences[op["new_id"]] = Experience(text.strip(), merged_ev, step, step)
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "mission": self.mission,
            "step": self.step,
            "experiences": [{"id": eid, **vars(e)} for eid, e in self.experiences.items()],
        }

    def _persist(self) -> None:
        if self.run_dir is None:
            return
        body = json.dumps(self.to_json(), indent=2, ensure_ascii=False)
        path = self.run_dir / "guidance.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(body, encoding="utf-8")
        os.replace(tmp, path)
        self._on_write(path)
        snaps = self.run_dir / SNAPSHOT_DIR
        snaps.mkdir(exist_ok=True)
        snap = snaps / f"step_{self.step:06d}.json"
        snap.write_text(body, encoding="utf-8")
        self._on_write(snap)
        for old in sorted(snaps.glob("step_*.json"))[: -self.retention]:
            old.unlink()
