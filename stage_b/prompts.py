"""Prompt texts and answer parsers: the only place that knows Stage-B's text formats.

Rollout (one prompt per ticket): the mission, the batch's guidance snapshot, the per-image
summaries; the judge answers in exactly two lines::

    fail
    image 2 shows a box with torn tape

:func:`parse_verdict` reads that into (verdict, reason, format_ok). It never raises: anything
else is a malformed answer with ``format_ok = False`` (``verdict`` is still filled when the first
line alone is recognisable, which separates "format error" from "no verdict at all").

Reflection (rank 0): a batch of learnable tickets with their GT and the votes; the model answers
with JSON operations on the guidance::

    {"operations": [
      {"op": "upsert", "id": null, "text": "A torn tape on any box fails the group", "evidence": ["pkg-7::fail"]},
      {"op": "remove", "id": "G2", "evidence": ["pkg-3::pass"]},
      {"op": "merge", "ids": ["G0", "G4"], "text": "...", "evidence": ["pkg-1::fail"]}]}

:func:`parse_operations` returns the list or None when the answer is malformed (no JSON object
with an ``operations`` list); checking each operation against the guidance is the guidance's job.

What this module does not know: models, tokenizers, ranks, files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

VERDICTS = ("pass", "fail")

ROLLOUT_SYSTEM = (
    "You are a quality inspector. Decide whether a group of images satisfies the mission.\n"
    "Answer in exactly two lines:\n"
    "line 1: pass or fail\n"
    "line 2: the reason, in one sentence."
)

REFLECTION_SYSTEM = (
    "You maintain the guidance a quality inspector follows. You see tickets the inspector got wrong "
    "or was unsure about, with the ground-truth label. Propose changes to the guidance as JSON only:\n"
    '{"operations": [{"op": "upsert", "id": null or an existing id, "text": "...", "evidence": [ticket keys]}, '
    '{"op": "remove", "id": "...", "evidence": [...]}, '
    '{"op": "merge", "ids": ["...", "..."], "text": "...", "evidence": [...]}]}\n'
    "Every operation cites the ticket keys it is based on. Answer {\"operations\": []} if nothing should change."
)

#: marks each ticket in the reflection prompt (the scripted peer reads the keys back from it)
REFLECTION_TICKET_PREFIX = "ticket "


def guidance_lines(experiences: Sequence[tuple[str, str]]) -> str:
    if not experiences:
        return "(no guidance yet)"
    return "\n".join(f"- [{eid}] {text}" for eid, text in experiences)


def rollout_messages(mission: str, summaries: Sequence[str], step: int,
                     experiences: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    """Chat messages for one ticket under one guidance snapshot."""
    images = "\n".join(f"image {i + 1}: {s}" for i, s in enumerate(summaries))
    user = (
        f"Mission: {mission}\n"
        f"Guidance (step {step}):\n{guidance_lines(experiences)}\n"
        f"Image summaries:\n{images}\n"
        "Verdict (pass or fail) and reason, two lines:"
    )
    return [{"role": "system", "content": ROLLOUT_SYSTEM}, {"role": "user", "content": user}]


@dataclass(frozen=True)
class Verdict:
    verdict: str | None  # "pass" | "fail" | None (no recognisable first line)
    reason: str
    format_ok: bool  # exactly two non-empty lines: a verdict, then a reason


_PREFIX = re.compile(r"^(?:line\s*1\s*:|verdict\s*:|answer\s*:)\s*", re.IGNORECASE)
_REASON_PREFIX = re.compile(r"^(?:line\s*2\s*:|reason\s*:)\s*", re.IGNORECASE)


def _verdict_word(line: str) -> str | None:
    word = _PREFIX.sub("", line.strip()).strip().strip(".!*`'\"").strip().lower()
    return word if word in VERDICTS else None


def parse_verdict(text: str) -> Verdict:
    """Two lines → (verdict, reason, format_ok); never raises."""
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    if not lines:
        return Verdict(None, "", False)
    verdict = _verdict_word(lines[0])
    reason = _REASON_PREFIX.sub("", lines[1]).strip() if len(lines) > 1 else ""
    return Verdict(verdict, reason, verdict is not None and len(lines) == 2 and bool(reason))


def reflection_messages(mission: str, step: int, experiences: Sequence[tuple[str, str]],
                        records: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """Chat messages asking for guidance operations on ``records`` (learnable selections)."""
    blocks = []
    for r in records:
        images = "; ".join(f"image {i + 1}: {s}" for i, s in enumerate(r["summaries"]))
        reasons = " | ".join(r.get("reasons", [])[:2]) or "(none)"
        blocks.append(
            f"{REFLECTION_TICKET_PREFIX}{r['ticket_key']}: label={r['label']} predicted={r['verdict']} "
            f"votes={r['votes']} agreement={r['vote_strength']:.2f}\n  {images}\n  judge said: {reasons}"
        )
    user = (
        f"Mission: {mission}\n"
        f"Current guidance (step {step}):\n{guidance_lines(experiences)}\n"
        f"Tickets:\n" + "\n".join(blocks) + "\nOperations JSON:"
    )
    return [{"role": "system", "content": REFLECTION_SYSTEM}, {"role": "user", "content": user}]


def parse_operations(text: str) -> list[dict[str, Any]] | None:
    """The ``operations`` list of the first JSON object in ``text``; None if there is none."""
    text = text or ""
    decoder = json.JSONDecoder()
    for start in (m.start() for m in re.finditer(r"\{", text)):
        try:
            obj, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("operations"), list):
            return [op for op in obj["operations"]]
    return None
