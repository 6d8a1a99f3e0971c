"""Where a learner rank's B packs come in: its pack PULL and credit PUB sockets, its ready queue, and the
queue's admission limits taken from the model.

    actors ─PUSH─► PackReceiver (this rank binds; hwm transport.hwm, frames over transport.max_frame_mb dropped)
                      └─► ReadyQueue (learner/pack_queue.py: admission, drops, credits) ─► the step's decision
    actors ◄─SUB── CreditPublisher (this rank binds; every transport.credit_interval_s)

:func:`open_intake` binds first, before the model loads, so actors can connect meanwhile; once the model is
loaded, :func:`admission_limits` gives the queue what a legal pack of this model may hold, and refuses a
start where the largest legal pack would not fit the frame cap (ZMQ would drop it without a word).
Delivery semantics of both sockets are written where they are made (``common/wire/transport.py``).

What this module does not know: steps, versions or training (the queue is started and read by the learner).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common.config.load import ConfigError
from common.packing.segment import PackLimits
from common.wire.transport import CreditPublisher, PackReceiver, credit_endpoint, max_frame_bytes, pack_endpoint
from learner.model import pack_limits
from learner.pack_queue import ReadyQueue
from learner.step_record import ROLLOUT_COUNTS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Intake:
    """One rank's ready queue and the two sockets that feed it (closed by :meth:`close`)."""

    queue: ReadyQueue
    sockets: tuple[PackReceiver, CreditPublisher]

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def open_intake(cfg: Any, rank: int, packing_length: int, trained_ids: set[str]) -> Intake:
    """Bind this rank's pack PULL and credit PUB; ``trained_ids``: the B-sample ledger the queue shares."""
    t, a = cfg.transport, cfg.stage2_ab.channel_b.async_
    receiver = PackReceiver(pack_endpoint(t, rank, cfg.learner), hwm=t.hwm, linger_ms=t.linger_ms,
                            max_frame_bytes=max_frame_bytes(t, packing_length))  # admission_limits checks the model
    publisher = CreditPublisher(credit_endpoint(t, rank, cfg.learner))
    queue = ReadyQueue(
        rank=rank, queue_limit=a.queue_limit, version_window=a.version_window, target=a.prefetch_target_packs,
        recv=receiver.recv, publish=publisher.publish, credit_interval_s=t.credit_interval_s, trained_ids=trained_ids,
    )
    log.info("rank %d: packs at %s, credits at %s", rank, receiver.endpoint, publisher.endpoint)
    return Intake(queue, (receiver, publisher))


def admission_limits(model: torch.nn.Module, encoder: Any, transport: Any, packing_length: int) -> PackLimits:
    """The ready queue's admission limits from the model, its largest pack checked against the receiver's frame
    cap (the same config as :func:`open_intake`'s)."""
    one = np.zeros(1, np.int64)
    rows = int(encoder.position_ids(one, one, np.zeros((0, 3), np.int64)).shape[0])
    limits = pack_limits(model, packing_length, rows, ROLLOUT_COUNTS)
    if limits.largest_frame_bytes() > (cap := max_frame_bytes(transport, packing_length)):
        raise ConfigError([
            f"transport.max_frame_mb = {transport.max_frame_mb}: a legal pack of this model can send a "
            f"{limits.largest_frame_bytes() / 2**20:.0f} MiB frame (pixel_values of {packing_length} tokens), "
            f"above the {cap / 2**20:.0f} MiB cap: ZMQ would drop it. Fix: set transport.max_frame_mb: "
            f"{math.ceil(2 * limits.largest_frame_bytes() / 2**20)}"
        ])
    return limits
