"""The Channel-B sample stream of one actor: its shard, its seed, infinite epochs, resumable.

Sharding: with ``W`` learner ranks and ``A`` actors per rank, actor ``i`` of rank ``r`` owns the
lines ``j`` of the training JSONL with ``j % (W·A) == r·A + i``. The shards of all actors partition
the file, so a sample belongs to exactly one actor, and rank ``r``'s share is the union of its
actors' shards.

Order: each epoch is a fresh permutation of the shard drawn from a generator seeded by
``(training.seed, "channel-b", rank, index, epoch)`` — deterministic, different per epoch, and
independent of the learner's Channel-A sampler (which uses its own seed path).

Keys: every item carries ``key = "<sample_id>@<epoch>"``. The key is the Channel-B segment's
``sample_id``, so it is what the learner writes to its checkpoint's B ledger
(``common/runs/checkpoints.py`` names the file and reads it back).
On resume the stream walks its deterministic order from the start and skips exactly the keys in
that ledger: nothing trained is trained again, and anything produced but not trained (still
queued, dropped stale, lost with the learner) is produced again.

What this module does not know: rollouts, targets, or packs.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamItem:
    key: str  # "<sample_id>@<epoch>": unique over the infinite stream; the segment's sample_id
    sample_id: str  # the record's "id" field, else its 0-based line number in the JSONL
    epoch: int
    line: int  # 0-based line number in the JSONL
    record: dict[str, Any]


def stream_seed(seed: int, rank: int, index: int, epoch: int) -> int:
    """A 64-bit seed for one epoch of one actor's stream (stable across Python versions)."""
    digest = hashlib.sha256(f"tandem/channel-b/{seed}/{rank}/{index}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


class SampleStream:
    """Iterates one actor's shard forever, reshuffled each epoch, skipping keys already trained."""

    def __init__(
        self,
        jsonl_path: str | Path,
        *,
        rank: int,
        world_size: int,
        index: int = 0,
        num_actors_per_rank: int = 1,
        seed: int = 0,
        skip_keys: Iterable[str] = (),
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside the learner world of size {world_size}")
        if not 0 <= index < num_actors_per_rank:
            raise ValueError(f"actor index {index} outside 0..{num_actors_per_rank - 1} (actor.num_actors_per_rank)")
        self.path = Path(jsonl_path)
        self.rank, self.index, self.seed = rank, index, seed
        slots = world_size * num_actors_per_rank
        slot = rank * num_actors_per_rank + index
        self._lines: list[tuple[int, str]] = []
        with self.path.open(encoding="utf-8") as f:
            for j, text in enumerate(f):
                if j % slots == slot and text.strip():
                    self._lines.append((j, text))
        if not self._lines:
            raise ValueError(
                f"{self.path}: no records for learner rank {rank}, actor {index} ({slots} shards over the file); "
                "use a larger data.train_jsonl or fewer ranks/actors"
            )
        self.skip_keys = set(skip_keys)
        self.skipped = 0
        self.epoch = 0

    def __len__(self) -> int:
        """Records in this actor's shard (one epoch)."""
        return len(self._lines)

    def __iter__(self) -> Iterator[StreamItem]:
        epoch = 0
        while True:
            self.epoch = epoch
            order = np.random.default_rng(stream_seed(self.seed, self.rank, self.index, epoch)).permutation(len(self._lines))
            for k in order:
                line, text = self._lines[int(k)]
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as exc:
                    log.error("%s line %d is not JSON (%s); skipped", self.path, line + 1, exc)
                    continue
                sample_id = str(record.get("id", line)) if isinstance(record, dict) else str(line)
                key = f"{sample_id}@{epoch}"
                if key in self.skip_keys:
                    self.skipped += 1
                    continue
                yield StreamItem(key=key, sample_id=sample_id, epoch=epoch, line=line, record=record)
            epoch += 1


# --------------------------------------------------------------------------------------------- ledgers


class PackLedger:
    """The actor's own append-only record of which stream keys went into which sent pack.

    One JSON line per pack: ``{"seq": 12, "ver": 3, "keys": ["17@0", "4@0"]}``, and one marker line
    ``{"event": "learner", "from_seq": 12}`` whenever the actor meets a learner incarnation that had not
    heard from it yet (at start, or after a learner restart): packs of ``seq >= from_seq`` went to that
    incarnation. Seqs grow over the whole file, across actor restarts (:meth:`rejoin_state`).

    A restarted actor reads it back (:meth:`rejoin_state`) to tell, together with the learner's credits,
    which of its predecessor's packs the live learner already holds.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torn = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open("rb") as f:
                f.seek(-1, 2)
                torn = f.read(1) != b"\n"
        self._f = self.path.open("a", encoding="utf-8")
        if torn:  # a predecessor killed mid-line: end that line so ours stay readable
            self._f.write("\n")

    def record(self, seq: int, ver: int, keys: list[str]) -> None:
        self._f.write(json.dumps({"seq": seq, "ver": ver, "keys": keys}) + "\n")
        self._f.flush()

    def mark_learner(self, from_seq: int) -> None:
        """A learner incarnation new to this actor id starts receiving at ``from_seq``."""
        self._f.write(json.dumps({"event": "learner", "from_seq": from_seq}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    @staticmethod
    def read(path: str | Path) -> list[dict[str, Any]]:
        """Every readable line (packs and markers); a torn line is skipped."""
        p = Path(path)
        if not p.exists():
            return []
        out = []
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return [x for x in out if isinstance(x, dict)]

    @staticmethod
    def rejoin_state(path: str | Path) -> tuple[int, dict[str, int]]:
        """``(next seq, {key: seq})``: the seq after every one in the file, and the keys of the packs sent
        to the newest learner incarnation (those after its marker), each with its pack's seq."""
        next_seq, keys = 0, {}
        for line in PackLedger.read(path):
            if line.get("event") == "learner":
                start = int(line.get("from_seq", 0))
                keys = {k: q for k, q in keys.items() if q >= start}
                next_seq = max(next_seq, start)
            elif "seq" in line:
                seq = int(line["seq"])
                next_seq = max(next_seq, seq + 1)
                keys.update({str(k): seq for k in line.get("keys", [])})
        return next_seq, keys
