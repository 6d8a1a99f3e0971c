"""Sequential reflection on rank 0: learnable tickets in, guidance operations out.

Only rank 0 builds a :class:`ReflectionEngine`; other ranks have none, so they cannot trigger one.
The runner feeds it every learnable selection in global batch order (after the gather), so the
trigger is the GLOBAL pending count::

    add(record) ─► pending ──len ≥ reflection.batch_size──► cycle("batch_full")   (possibly mid-batch)
    flush()     ─► pending ──non-empty (epoch end)───────► cycle("epoch_flush") until empty

One cycle, attempt a = 0 .. max_attempts-1 (shrinking batch on malformed output)::

    records = pending[: max(1, batch_size // 2**a)]
    answer  = model(reflection prompt(guidance snapshot, records))
    ops     = parse_operations(answer)  ── None ─► malformed (counted), next attempt
    repo.apply(ops, evidence ⊆ keys of records) ─► guidance.step += 1 if anything applied

The records of the successful attempt leave the queue; those no applied operation cites as
evidence go to the need-review queue (``reflection_no_evidence``). If every attempt is malformed,
the first attempt's records leave the queue to need-review (``reflection_malformed``), so a model
that never answers in JSON costs ``max_attempts`` calls per ``batch_size`` records, not more.

A cycle changes the repo at once, but rollout prompts only ever see the snapshot rank 0 broadcast
at the start of a global batch: the change is used from the next global batch on.

What this module does not know: ranks, files (results go to the ``emit`` callback), the model
(``complete`` maps chat messages to one answer text).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from stage_b.config import ReflectionConfig
from stage_b.guidance import GuidanceRepo
from stage_b.prompts import parse_operations, reflection_messages

log = logging.getLogger(__name__)

Complete = Callable[[list[dict[str, str]]], str]
Emit = Callable[[str, dict[str, Any]], None]  # (artifact name, record)


@dataclass
class ReflectionCounters:
    cycles: int = 0
    attempts: int = 0
    malformed: int = 0
    ops_applied: int = 0
    ops_invalid: int = 0
    ops_over_cap: int = 0
    need_review: int = 0


class ReflectionEngine:
    def __init__(self, complete: Complete, repo: GuidanceRepo, cfg: ReflectionConfig, mission: str,
                 emit: Emit) -> None:
        self.complete, self.repo, self.cfg, self.mission, self.emit = complete, repo, cfg, mission, emit
        self.pending: list[dict[str, Any]] = []
        self.counters = ReflectionCounters()

    def add(self, record: dict[str, Any], where: dict[str, Any]) -> int:
        """Queue one learnable record; run cycles while the global queue is full. Returns cycles run."""
        self.pending.append(record)
        ran = 0
        while len(self.pending) >= self.cfg.batch_size:
            self._cycle("batch_full", where)
            ran += 1
        return ran

    def flush(self, where: dict[str, Any]) -> int:
        """Reflect on whatever is pending (epoch end). Returns cycles run."""
        ran = 0
        while self.pending:
            self._cycle("epoch_flush", where)
            ran += 1
        return ran

    def _cycle(self, trigger: str, where: dict[str, Any]) -> None:
        c = self.counters
        c.cycles += 1
        pending_before = len(self.pending)
        step_before = self.repo.step
        attempts: list[dict[str, Any]] = []
        result = None
        first_n = min(len(self.pending), self.cfg.batch_size)
        n = first_n
        for a in range(self.cfg.max_attempts):
            n = min(len(self.pending), max(1, self.cfg.batch_size // 2**a))
            records = self.pending[:n]
            snap = self.repo.snapshot()
            answer = self.complete(reflection_messages(self.mission, snap.step, snap.experiences, records))
            ops = parse_operations(answer)
            c.attempts += 1
            attempts.append({"attempt": a, "records": n, "malformed": ops is None, "answer": answer[:400]})
            if ops is None:
                c.malformed += 1
                continue
            result = self.repo.apply(ops, [r["ticket_key"] for r in records], self.cfg.max_operations_per_cycle)
            break
        if result is None:
            consumed, why, cited = self.pending[:first_n], "reflection_malformed", set()
        else:
            consumed, why, cited = self.pending[:n], "reflection_no_evidence", result.evidence
            c.ops_applied += len(result.applied)
            c.ops_invalid += len(result.invalid)
            c.ops_over_cap += result.dropped_over_cap
        del self.pending[: len(consumed)]
        review = [r for r in consumed if r["ticket_key"] not in cited]
        for r in review:
            self.emit("need_review_queue", {**_brief(r), "reason": why, "step": self.repo.step})
        c.need_review += len(review)
        self.emit("reflection", {
            **where,
            "cycle": c.cycles,
            "trigger": trigger,
            "pending_before": pending_before,
            "records": [r["ticket_key"] for r in consumed],
            "attempts": attempts,
            "step_before": step_before,
            "step_after": self.repo.step,
            "applied": result.applied if result else [],
            "invalid": result.invalid if result else [],
            "dropped_over_cap": result.dropped_over_cap if result else 0,
            "need_review": [r["ticket_key"] for r in review],
        })
        log.info("reflection cycle %d (%s at %s): %d records, %d attempt(s), guidance step %d -> %d",
                 c.cycles, trigger, where, len(consumed), len(attempts), step_before, self.repo.step)


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    keep = ("ticket_key", "group_id", "label", "verdict", "vote_strength", "epoch", "batch")
    return {k: r[k] for k in keep if k in r}
