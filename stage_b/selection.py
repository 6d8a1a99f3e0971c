"""Per-ticket selection on rank 0: failure handling, majority vote, agreement, learnability.

For each ticket, in global batch order, its candidates (every grid entry × sample, from whichever
rank rolled it out) go through::

    no candidates ─────────────────────────────► failure "no_candidates"
    no candidate has a recognisable verdict ───► failure "format_error"
    verdicts, but none well-formed (2 lines) ──► failure "no_valid_candidates"
    else majority vote over the well-formed ───► Selection (tie-break on equal votes)

A failure goes to ``failure_malformed.jsonl`` and is neither scored nor reflected on. A selection
is *learnable* (queued for reflection) when its verdict misses the label, the candidates hold both
verdicts, or the vote strength is below ``selection.min_verdict_agreement``.

What this module does not know: models, prompts, ranks, files.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

FAILURE_REASONS = ("no_candidates", "format_error", "no_valid_candidates")


@dataclass
class Candidate:
    """One sampled answer for one ticket (crosses ranks via gather_object)."""

    ticket_key: str
    rank: int  # the rank that generated it
    guidance_step: int  # the guidance snapshot step the prompt was built from
    decode_index: int  # entry of sampler.grid
    sample_index: int  # 0..samples_per_decode-1
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int | None
    text: str
    finish_reason: str
    verdict: str | None
    reason: str
    format_ok: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Selection:
    """The chosen verdict of one ticket and why it is (not) learnable."""

    ticket_key: str
    verdict: str
    label: str
    label_match: bool
    vote_strength: float
    votes: dict[str, int]
    tied: bool
    mixed: bool
    low_agreement: bool
    reasons: list[str] = field(default_factory=list)  # reasons of the candidates with the chosen verdict

    @property
    def learnable(self) -> bool:
        return (not self.label_match) or self.mixed or self.low_agreement

    @property
    def learnable_because(self) -> list[str]:
        why = [("label_mismatch", not self.label_match), ("mixed_verdicts", self.mixed),
               ("low_agreement", self.low_agreement)]
        return [name for name, hit in why if hit]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["learnable"] = self.learnable
        d["learnable_because"] = self.learnable_because
        return d


def failure_reason(candidates: list[Candidate]) -> str | None:
    """Which failure (if any) a ticket's candidates are; None = selectable."""
    if not candidates:
        return "no_candidates"
    if all(c.verdict is None for c in candidates):
        return "format_error"
    if not any(c.format_ok for c in candidates):
        return "no_valid_candidates"
    return None


def _tie_break(tied: list[str], valid: list[Candidate], policy: str) -> str:
    if policy == "prefer_fail":
        return "fail" if "fail" in tied else tied[0]
    if policy == "prefer_pass":
        return "pass" if "pass" in tied else tied[0]
    # lowest_temperature: the most conservative sample decides; candidate order breaks equal temperatures
    best = min((c for c in valid if c.verdict in tied), key=lambda c: c.temperature)
    return best.verdict  # type: ignore[return-value]


def select(candidates: list[Candidate], label: str, tie_break: str, min_agreement: float) -> Selection:
    """Majority vote over the well-formed candidates (call only when failure_reason is None)."""
    valid = [c for c in candidates if c.format_ok]
    if not valid:
        raise ValueError("select() needs at least one well-formed candidate; check failure_reason first")
    votes = Counter(c.verdict for c in valid)
    top = max(votes.values())
    tied = sorted(v for v, n in votes.items() if n == top)
    verdict = tied[0] if len(tied) == 1 else _tie_break(tied, valid, tie_break)
    strength = votes[verdict] / len(valid)
    return Selection(
        ticket_key=candidates[0].ticket_key,
        verdict=verdict,
        label=label,
        label_match=verdict == label,
        vote_strength=strength,
        votes=dict(sorted(votes.items())),
        tied=len(tied) > 1,
        mixed=len(votes) > 1,
        low_agreement=strength < min_agreement,
        reasons=[c.reason for c in valid if c.verdict == verdict],
    )
