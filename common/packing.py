"""Actor-side packer: whole segments in, version-pure packs of bounded length out.

Data flow and what releases a pack::

    add(segment) ──► buffer (arrival order, one clock stamp each)
                        │  pop_ready(now): per (ver, channel) group, oldest group first
                        │    selection = oldest segment + best fit of the rest of its group
                        │    emit if fill >= min_fill_ratio * packing_length      (normal)
                        │         or oldest segment waited >= max_wait_s          (underfilled, counted)
                        │  advance_ver(v, "flush"): every group with ver < v -> packs now, any fill
                        │  advance_ver(v, "drop"):  every segment with ver < v -> dropped, counted
                        ▼
                      Pack(ver, channel, segments)   n_tokens <= packing_length, never mixed

Capacity rule: a pack holds at most ``packing_length`` tokens and only segments of one ``ver`` and
one channel; a segment is never split or truncated, so one longer than ``packing_length`` is refused
at ``add`` (counted in ``too_long_dropped``; the caller logs the fix). Example: packing_length
4096, min_fill_ratio 0.8, buffer of ver 3 = [1500, 900, 2100, 700] (oldest first): the selection
is 1500 (oldest) + best fit of [900, 2100, 700] into 2596 -> FIFO greedy takes 900 + 700 = 3100,
first-fit-decreasing takes 2100 -> 3600; FFD wins, the pack is [1500, 2100] with fill 0.88 >= 0.8.

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

from common.segment import Pack, Segment

VerPolicy = Literal["flush", "drop"]


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
                    packs.append(self._emit(chosen))
                    break
                if now - chosen[0].arrived >= self.max_wait_s:
                    self.counters["underfilled_packs"] += 1
                    packs.append(self._emit(chosen))
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
        """The group's oldest segment plus the better (more tokens) of FIFO-greedy and FFD over the rest."""
        oldest, rest = group[0], group[1:]
        room = self.packing_length - oldest.segment.length
        fifo = _fit(rest, room)
        ffd = _fit(sorted(rest, key=lambda w: -w.segment.length), room)  # stable: ties stay oldest-first
        best = ffd if _tokens(ffd) > _tokens(fifo) else fifo
        order = {id(w): i for i, w in enumerate(group)}
        return [oldest, *sorted(best, key=lambda w: order[id(w)])]

    def _emit(self, chosen: list[_Waiting], flushed: bool = False) -> Pack:
        taken = {id(w) for w in chosen}
        self._buffer = [w for w in self._buffer if id(w) not in taken]
        first = chosen[0].segment
        pack = Pack(ver=first.ver, channel=first.channel, segments=[w.segment for w in chosen])
        self.counters["segments_packed"] += len(chosen)
        self.counters["packs_emitted"] += 1
        self.counters["flushed_packs"] += int(flushed)
        self.counters["tokens_packed"] += pack.n_tokens
        self.counters["fill_sum"] += pack.n_tokens / self.packing_length
        return pack

    def _drain(self, closing: Callable[[_Waiting], bool]) -> list[Pack]:
        packs = []
        while True:
            group = next((g for g in self._groups() if closing(g[0])), None)
            if group is None:
                return packs
            packs.append(self._emit(self._select(group), flushed=True))


def _fit(candidates: list[_Waiting], room: int) -> list[_Waiting]:
    taken = []
    for w in candidates:
        if w.segment.length <= room:
            taken.append(w)
            room -= w.segment.length
    return taken


def _tokens(waiting: list[_Waiting]) -> int:
    return sum(w.segment.length for w in waiting)
