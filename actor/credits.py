"""The actor's reading of its learner rank's credits: how many more packs it may have outstanding.

Capacity rule: actor ``i`` of ``A`` actors on a rank whose credits say ``target = T`` keeps

    outstanding_i = in_transit_i + queued_i  <=  share_i = max(1, T // A + (1 if i < T % A else 0))

where ``queued_i`` is how many of its packs sit in the rank's ready queue (credits ``actors[id][1]``)
and ``in_transit_i`` is how many it sent that the rank has not reported yet
(``next_seq - 1 - actors[id][0]``). Example: T = 5, A = 2 -> shares 3 and 2; actor 0 sent seq 0..6,
the rank reports ``[4, 2]`` -> in transit 2 (seq 5, 6) + queued 2 = 4 > 3: actor 0 sends nothing until
the learner consumes.

Credits are read late, so the estimate is an upper bound: consumption since the snapshot only lowers
the truth, and packs sent since are counted as in transit by our own ``next_seq``. Hence
"never more than the share unconsumed" holds even with old credits.

A learner that does not fill ``actors`` (empty map) gets the aggregate estimate: of the rank's
``received_total`` (since our baseline), ``1/A`` are taken as ours, and ``ceil(depth / A)`` as our
queued packs — exact for one actor per rank, fair-share approximate otherwise.

Learner restarts (no session id on the wire): a restart shows up as ``received_total`` going down, or
our entry vanishing after the rank had reported us. Packs sent before the previous credits message
died with the old learner; packs sent after it may have reached the new one, so they stay counted
until the new rank reports them or ``lost_pack_timeout_s`` passes (counted in ``lost_packs``).

What this module does not know: sockets, packing, or rollouts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from common.wire.codec import Credits

log = logging.getLogger(__name__)


def fair_share(target: int, num_actors: int, index: int) -> int:
    """This actor's part of the rank's ``target`` (at least 1, so every actor makes progress)."""
    base, extra = divmod(max(0, target), max(1, num_actors))
    return max(1, base + (1 if index < extra else 0))


class CreditGate:
    """Tracks outstanding packs of one actor against its share of the rank's credits."""

    def __init__(self, actor_id: str, index: int, num_actors: int, *, lost_pack_timeout_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.actor_id, self.index, self.num_actors = actor_id, index, max(1, num_actors)
        self.lost_pack_timeout_s = lost_pack_timeout_s
        self.clock = clock
        self.credits: Credits | None = None
        self.next_seq = 0  # seq of the next pack to send
        self.baseline_seq = 0  # packs with seq < baseline are not outstanding (lost with an old learner)
        self.acked = 0  # packs with seq >= baseline the rank reported receiving
        self.queued = 0  # our packs in the rank's ready queue
        self.seen_me = False  # the current learner incarnation has reported us
        self.restarts = 0
        self.lost_packs = 0
        self._received_baseline = 0  # received_total at the baseline (aggregate mode)
        self._seq_at_prev_credits = 0
        self._progress_at = clock()  # last time in_transit shrank or was zero

    # -- inputs ---------------------------------------------------------------------------------

    def start_at(self, seq: int) -> None:
        """Number this process's packs from ``seq`` (before the first credits). A restarted actor continues its
        id's seqs, so the rank's ``last seq`` of an earlier process of this actor never counts as ours."""
        self.next_seq = self.baseline_seq = self._seq_at_prev_credits = seq

    def on_credits(self, credits: Credits) -> None:
        prev = self.credits
        entry = credits.actors.get(self.actor_id)
        if prev is None:
            self._received_baseline = credits.received_total if not credits.actors else 0
        elif credits.received_total < prev.received_total or (entry is None and self.seen_me):
            self.restarts += 1
            self.baseline_seq = max(self.baseline_seq, self._seq_at_prev_credits)
            self.seen_me, self.acked, self.queued, self._received_baseline = False, 0, 0, 0
            log.warning("%s: learner rank %d restarted (received_total %d -> %d); packs before seq %d are gone",
                        self.actor_id, credits.rank, prev.received_total, credits.received_total, self.baseline_seq)
        before = self.in_transit
        if entry is not None:
            self.seen_me = True
            self.acked = max(0, int(entry[0]) - self.baseline_seq + 1)
            self.queued = int(entry[1])
        elif credits.actors:  # the rank tracks actors but has not heard from us (yet)
            self.acked, self.queued = 0, 0
        else:  # aggregate mode: the learner does not report per actor
            self.acked = max(0, credits.received_total - self._received_baseline) // self.num_actors
            self.queued = -(-credits.depth // self.num_actors)
        now = self.clock()
        if self.in_transit < before or self.in_transit == 0:
            self._progress_at = now
        elif now - self._progress_at > self.lost_pack_timeout_s:
            lost = self.in_transit
            self.lost_packs += lost
            self.baseline_seq, self.acked = self.next_seq, 0
            self._received_baseline = credits.received_total
            self._progress_at = now
            log.warning("%s: %d packs sent to rank %d were never acknowledged in %.0fs; counted lost, credit returned",
                        self.actor_id, lost, credits.rank, self.lost_pack_timeout_s)
        self.credits = credits
        self._seq_at_prev_credits = self.next_seq

    def on_sent(self) -> int:
        """Record one pack sent; returns the seq it was sent with."""
        seq = self.next_seq
        if self.in_transit == 0:
            self._progress_at = self.clock()
        self.next_seq += 1
        return seq

    # -- outputs --------------------------------------------------------------------------------

    @property
    def in_transit(self) -> int:
        return max(0, self.next_seq - self.baseline_seq - self.acked)

    @property
    def outstanding(self) -> int:
        return self.in_transit + self.queued

    @property
    def share(self) -> int:
        return 0 if self.credits is None else fair_share(self.credits.target, self.num_actors, self.index)

    @property
    def room(self) -> int:
        """Packs this actor may still send now (0 before the first credits)."""
        return max(0, self.share - self.outstanding)

    def stale_below(self) -> int | None:
        """Packs of ``ver <`` this would be dropped on arrival; None before the first credits."""
        c = self.credits
        return None if c is None else c.ver_current - c.version_window
