"""Actor-side packer: whole segments in, version-pure packs of bounded length out.

Data flow and what releases a pack::

    add(segment) ──► buffer (arrival order, one clock stamp each)
                        │  pop_ready(now): per (ver, channel) group, oldest group first
                        │    selection = oldest segment + the subset of the rest of its group with the
                        │                most tokens that fits (exact subset sum; ties keep older ones)
                        │    emit if fill >= min_fill_ratio * packing_length      (normal, "ready")
                        │         or oldest segment waited >= max_wait_s          (underfilled, "wait")
                        │  advance_ver(v, "flush"): every group with ver < v -> packs now, any fill ("flush")
                        │  advance_ver(v, "drop"):  every segment with ver < v -> dropped, counted
                        ▼
                      Pack(ver, channel, segments)   n_tokens <= packing_length, never mixed

Capacity rule: a pack holds at most ``packing_length`` tokens and only segments of one ``ver`` and
one channel; a segment is never split or truncated, so one longer than ``packing_length`` is refused
at ``add`` (counted in ``too_long_dropped``; the caller logs the fix). Example: packing_length
4096, min_fill_ratio 0.8, buffer of ver 3 = [1500, 1400, 1000, 1200, 1396] (oldest first): the
selection is 1500 (oldest, always in: nothing starves) + the best subset of the rest into 2596 ->
1200 + 1396 = 2596, a full pack [1500, 1200, 1396]; FIFO-greedy and first-fit-decreasing would both
take 1400 + 1000 and stop at 3900 (0.95). Why exact: at a high ``min_fill_ratio`` a greedy pick
misses the threshold on buffers that hold a fitting subset, and the pack then leaves only at
``max_wait_s``, underfilled (bench/bench_packing.py measures both).

Fill lost, by why the pack left (tokens of empty room, ``packing_length - n_tokens`` per pack):
``fill_lost_ready_tokens`` (left at min fill), ``fill_lost_wait_tokens`` (``max_wait_s``),
``fill_lost_flush_tokens`` (``advance_ver`` flush or ``flush_all``: what version purity costs), so
``packs_emitted * packing_length == tokens_packed + fill_lost_ready_tokens + fill_lost_wait_tokens +
fill_lost_flush_tokens``.

Conservation, at every moment: ``segments_built == segments_packed + too_long_dropped +
flushed_dropped + buffered``.

What this module does not know: sockets, credits, tokenizers, or what a segment means.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from common.packing.segment import Pack, Segment

VerPolicy = Literal["flush", "drop"]
_Reason = Literal["ready", "wait", "flush"]  # why a pack left (module docstring)
_REASONS: tuple[_Reason, ...] = ("ready", "wait", "flush")


@dataclass
class _Waiting:
    segment: Segment
    arrived: float  # clock() at add


class Packer:
    """Buffers segments and releases version-pure packs by the rules of the module docstring.

    Not thread-safe: one owner (the actor's packing loop) calls every method.
    """

    def __init__(
        self,
        packing_length: int,
        min_fill_ratio: float,
        max_wait_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if packing_length < 1:
            raise ValueError(f"packing_length must be >= 1, got {packing_length}")
        if not 0.0 <= min_fill_ratio <= 1.0:
            raise ValueError(f"min_fill_ratio must be in [0, 1], got {min_fill_ratio}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.packing_length = packing_length
        self.min_fill_ratio = min_fill_ratio
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.ver: int | None = None  # latest ver passed to advance_ver; None = never advanced
        self.late_policy: VerPolicy = "flush"  # what add() does with a segment older than self.ver
        self._buffer: list[_Waiting] = []
        self.counters: dict[str, float] = {
            "segments_built": 0,  # every add() call
            "segments_packed": 0,
            "too_long_dropped": 0,
            "flushed_dropped": 0,  # old-ver segments dropped by advance_ver(..., "drop") or late arrivals
            "packs_emitted": 0,
            "underfilled_packs": 0,  # released by max_wait_s below min fill
            "flushed_packs": 0,  # released by advance_ver(..., "flush") or flush_all, any fill
            "tokens_packed": 0,
            "fill_sum": 0.0,  # sum of n_tokens / packing_length over emitted packs
            # packing_length - n_tokens summed by release reason (module docstring):
            "fill_lost_ready_tokens": 0,
            "fill_lost_wait_tokens": 0,
            "fill_lost_flush_tokens": 0,
        }

    @property
    def buffered(self) -> int:
        """Segments waiting in the buffer."""
        return len(self._buffer)

    @property
    def buffered_tokens(self) -> int:
        """Tokens of the segments waiting in the buffer."""
        return _tokens(self._buffer)

    @property
    def release_tokens(self) -> int:
        """Tokens at which a buffered group leaves as a normal (not underfilled) pack."""
        return max(1, math.ceil(self.min_fill_ratio * self.packing_length))

    @property
    def mean_fill(self) -> float:
        """Mean of n_tokens / packing_length over every pack emitted so far (0 before the first)."""
        n = self.counters["packs_emitted"]
        return self.counters["fill_sum"] / n if n else 0.0

    def fill_lost(self) -> dict[str, float]:
        """Share of the capacity of every pack emitted so far left empty, by release reason.

        ``mean_fill + ready + wait + flush == 1`` (all 0 before the first pack). Example: ``{"ready": 0.03,
        "wait": 0.0, "flush": 0.05}``: version flushes cost more fill than ``max_wait_s``.
        """
        capacity = self.counters["packs_emitted"] * self.packing_length
        return {r: (self.counters[f"fill_lost_{r}_tokens"] / capacity if capacity else 0.0) for r in _REASONS}

    def add(self, segment: Segment, now: float | None = None) -> bool:
        """Buffer one segment; False if refused (too long, or older than ``ver`` under the drop policy)."""
        self.counters["segments_built"] += 1
        if segment.length > self.packing_length:
            # The caller logs the fix: raise training.global_max_length or lower max_new_tokens.
            self.counters["too_long_dropped"] += 1
            return False
        if self.ver is not None and segment.ver < self.ver and self.late_policy == "drop":
            self.counters["flushed_dropped"] += 1
            return False
        self._buffer.append(_Waiting(segment, self.clock() if now is None else now))
        return True

    def pop_ready(self, now: float | None = None) -> list[Pack]:
        """Every pack that may leave now: filled to ``min_fill_ratio``, or its oldest segment waited too long."""
        now = self.clock() if now is None else now
        packs = []
        while True:
            for group in self._groups():
                chosen = self._select(group)
                fill = sum(w.segment.length for w in chosen) / self.packing_length
                if fill >= self.min_fill_ratio:
                    packs.append(self._emit(chosen, "ready"))
                    break
                if now - chosen[0].arrived >= self.max_wait_s:
                    packs.append(self._emit(chosen, "wait"))
                    break
            else:
                return packs

    def advance_ver(self, new_ver: int, policy: VerPolicy = "flush") -> list[Pack]:
        """Close every ``ver < new_ver``: flush its leftovers into packs of their own ver, or drop them.

        ``policy`` also decides what :meth:`add` does with a segment of ``ver < new_ver`` arriving later
        (``drop``: refused and counted; ``flush``: buffered and packed by the usual rules). Versions
        never go back: a ``new_ver`` below the last one is treated as the last one.
        """
        if policy not in ("flush", "drop"):
            raise ValueError(f"policy must be 'flush' or 'drop', got {policy!r}")
        if self.ver is not None:
            new_ver = max(new_ver, self.ver)
        self.ver, self.late_policy = new_ver, policy
        old = [w for w in self._buffer if w.segment.ver < new_ver]
        if policy == "drop":
            self._buffer = [w for w in self._buffer if w.segment.ver >= new_ver]
            self.counters["flushed_dropped"] += len(old)
            return []
        return self._drain(lambda w: w.segment.ver < new_ver)

    def flush_all(self) -> list[Pack]:
        """Everything buffered, as packs of any fill (shutdown); the buffer ends empty."""
        return self._drain(lambda w: True)

    # -- internals ------------------------------------------------------------------------------

    def _groups(self) -> list[list[_Waiting]]:
        """Buffered segments grouped by (ver, channel), each in arrival order, oldest group first."""
        groups: dict[tuple[int, str], list[_Waiting]] = {}
        for w in self._buffer:
            groups.setdefault((w.segment.ver, w.segment.channel), []).append(w)
        return list(groups.values())

    def _select(self, group: list[_Waiting]) -> list[_Waiting]:
        """The group's oldest segment plus the subset of the rest with the most tokens that fits, in arrival order."""
        oldest, rest = group[0], group[1:]
        picked = _best_subset([w.segment.length for w in rest], self.packing_length - oldest.segment.length)
        return [oldest, *(rest[i] for i in picked)]

    def _emit(self, chosen: list[_Waiting], reason: _Reason) -> Pack:
        taken = {id(w) for w in chosen}
        self._buffer = [w for w in self._buffer if id(w) not in taken]
        first = chosen[0].segment
        pack = Pack(ver=first.ver, channel=first.channel, segments=[w.segment for w in chosen])
        self.counters["segments_packed"] += len(chosen)
        self.counters["packs_emitted"] += 1
        self.counters["underfilled_packs"] += int(reason == "wait")
        self.counters["flushed_packs"] += int(reason == "flush")
        self.counters["tokens_packed"] += pack.n_tokens
        self.counters["fill_sum"] += pack.n_tokens / self.packing_length
        self.counters[f"fill_lost_{reason}_tokens"] += self.packing_length - pack.n_tokens
        return pack

    def _drain(self, closing: Callable[[_Waiting], bool]) -> list[Pack]:
        packs = []
        while True:
            group = next((g for g in self._groups() if closing(g[0])), None)
            if group is None:
                return packs
            packs.append(self._emit(self._select(group), "flush"))


def _best_subset(lengths: list[int], room: int) -> list[int]:
    """Indices (ascending) of the subset of ``lengths`` with the largest sum <= ``room``; ties keep earlier items.

    Subset sum over a bitset (a Python int, bit s set = some subset of the items so far sums to s): one
    shift-or of ``room + 1`` bits per item, so a few hundred items into 4096 tokens take well under a
    millisecond. It stops early at a perfect fill. Walking back from the last item, an item is taken only
    if the target is unreachable without it, which is what prefers earlier (older) items on ties.
    """
    mask = (1 << (room + 1)) - 1
    reach, before = 1, []  # before[i]: reachable sums of items 0..i-1
    for n in lengths:
        before.append(reach)
        reach = (reach | (reach << n)) & mask
        if reach >> room & 1:
            break
    target, picked = reach.bit_length() - 1, []
    for i in range(len(before) - 1, -1, -1):
        if not before[i] >> target & 1:
            picked.append(i)
            target -= lengths[i]
    return picked[::-1]


def _tokens(waiting: list[_Waiting]) -> int:
    return sum(w.segment.length for w in waiting)
