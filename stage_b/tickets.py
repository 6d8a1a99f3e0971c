"""Tickets: one image group to judge pass/fail against the run's single mission.

A ticket JSONL line::

    {"group_id": "pkg-0007", "label": "fail", "mission": "Every package is sealed and labelled",
     "summaries": ["sealed box, label visible", "box with torn tape"], "uid": null}

``summaries`` are the per-image Stage-A texts, in image order (a ``{"image_1": text, ...}`` mapping
is accepted and read in key order). The ticket key is ``uid or f"{group_id}::{label}"`` and must be
unique in a run. A run judges exactly one mission; a file with several is an error naming them.

:func:`make_demo_tickets` builds the deterministic CPU demo set (same arguments, same tickets,
on every rank, so nothing has to be written or shared before a distributed run).

What this module does not know: prompts, models, ranks.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from common.data.jsonl import iter_json_lines

LABELS = ("pass", "fail")


class TicketError(ValueError):
    """A ticket file that cannot be used; the message names the line and the fix."""


@dataclass(frozen=True)
class Ticket:
    """One group to judge. ``summaries[i]`` describes image ``i + 1``."""

    group_id: str
    label: str  # "pass" | "fail" (the ground truth)
    mission: str
    summaries: tuple[str, ...]
    uid: str | None = None

    @property
    def key(self) -> str:
        """Stable identity across ranks, artifacts and reflection evidence."""
        return self.uid or f"{self.group_id}::{self.label}"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["summaries"] = list(self.summaries)
        return d


def _summaries(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, dict):
        value = [value[k] for k in sorted(value, key=_natural_key)]
    if not isinstance(value, list) or not value or not all(isinstance(s, str) for s in value):
        raise TicketError(f"{where}: 'summaries' must be a non-empty list of strings (one per image)")
    return tuple(s.strip() for s in value)


def _natural_key(k: str) -> tuple:
    digits = "".join(ch for ch in k if ch.isdigit())
    return (int(digits) if digits else 0, k)


def parse_ticket(obj: Any, where: str) -> Ticket:
    """One JSON object → a Ticket, or a TicketError naming ``where`` and the field."""
    if not isinstance(obj, dict):
        raise TicketError(f"{where}: expected a JSON object")
    missing = [k for k in ("group_id", "label", "mission", "summaries") if k not in obj]
    if missing:
        raise TicketError(f"{where}: missing {missing}. Fix: every line needs group_id, label, mission, summaries")
    label = str(obj["label"]).strip().lower()
    if label not in LABELS:
        raise TicketError(f"{where}: label {obj['label']!r} is not pass|fail")
    uid = obj.get("uid")
    return Ticket(
        group_id=str(obj["group_id"]),
        label=label,
        mission=str(obj["mission"]).strip(),
        summaries=_summaries(obj["summaries"], where),
        uid=str(uid) if uid not in (None, "") else None,
    )


def check_tickets(tickets: list[Ticket], expected_mission: str | None = None, source: str = "tickets") -> str:
    """Enforce one mission and unique keys; returns the mission."""
    if not tickets:
        raise TicketError(f"{source}: no tickets")
    missions = sorted({t.mission for t in tickets})
    if len(missions) > 1:
        raise TicketError(
            f"{source}: {len(missions)} missions {missions}; Stage-B judges exactly one mission per run. "
            "Fix: split the file by mission and run once per mission"
        )
    if expected_mission is not None and missions[0] != expected_mission:
        raise TicketError(f"{source}: mission {missions[0]!r} is not tickets.mission {expected_mission!r}")
    seen: dict[str, int] = {}
    for i, t in enumerate(tickets):
        if t.key in seen:
            raise TicketError(f"{source}: ticket key {t.key!r} appears at tickets {seen[t.key]} and {i}. "
                              "Fix: give the groups distinct group_id or uid")
        seen[t.key] = i
    return missions[0]


def load_tickets(path: str | Path, expected_mission: str | None = None) -> tuple[list[Ticket], str]:
    """Read a ticket JSONL; returns (tickets in file order, the mission)."""
    tickets = []
    for line in iter_json_lines(path, full_path=True):
        if line.error is not None:
            raise TicketError(f"{line.where}: {line.error}")
        tickets.append(parse_ticket(line.value, line.where))
    return tickets, check_tickets(tickets, expected_mission, str(path))


def fingerprint(tickets: Iterable[Ticket]) -> str:
    """Short digest of the ticket set in order; every rank must hold the same one."""
    h = hashlib.sha256()
    for t in tickets:
        h.update(json.dumps(t.to_json(), sort_keys=True).encode())
    return h.hexdigest()[:16]


def mission_slug(mission: str) -> str:
    """A directory name for a mission: readable prefix + digest (missions are free text)."""
    plain = "".join(ch if ch.isalnum() else "_" for ch in mission.lower()).strip("_")
    plain = "_".join(p for p in plain.split("_") if p)[:40] or "mission"
    return f"{plain}-{hashlib.sha1(mission.encode()).hexdigest()[:6]}"


# --------------------------------------------------------------------------------------- demo set

DEMO_MISSION = "Every package in the group is sealed, labelled and undamaged"
_GOOD = [
    "a cardboard box with intact tape and a printed shipping label",
    "a sealed parcel, label readable, corners straight",
    "a closed box on a pallet, barcode label visible",
    "a wrapped package with the address label attached",
]
_BAD = [
    "a box with the tape torn open along the top",
    "a parcel without any shipping label",
    "a box with a crushed corner and a hole in the side",
    "a package with a water stain and a peeling label",
]


def make_demo_tickets(num_groups: int = 16, images_per_group: int = 2, fail_share: float = 0.5,
                      seed: int = 0) -> list[Ticket]:
    """The CPU demo set: a fail group has one damaged/unlabelled package among good ones."""
    rng = random.Random(seed)
    n_fail = round(num_groups * fail_share)
    labels = ["fail"] * n_fail + ["pass"] * (num_groups - n_fail)
    rng.shuffle(labels)
    tickets = []
    for i, label in enumerate(labels):
        summaries = [rng.choice(_GOOD) for _ in range(images_per_group)]
        if label == "fail":
            summaries[rng.randrange(images_per_group)] = rng.choice(_BAD)
        tickets.append(Ticket(group_id=f"demo-{i:04d}", label=label, mission=DEMO_MISSION,
                              summaries=tuple(summaries)))
    return tickets


def write_tickets(tickets: Iterable[Ticket], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for t in tickets:
            f.write(json.dumps(t.to_json(), ensure_ascii=False) + "\n")
    return path
