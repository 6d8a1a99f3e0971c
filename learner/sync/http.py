"""Weight push over HTTP: safetensors buckets in ``/sync/bucket`` bodies (the CPU / no-NCCL path of design section 4).

    with HttpWeightSender("http://127.0.0.1:8310", auth_token=None, timeout_s=300) as sender:
        report = sender.push(model.named_parameters(), bucket_bytes=512 << 20, fence="drain")

The protocol (open, plan, fingerprint, begin, send, commit, abort on failure) is
:class:`learner.sync.base.PushSender`'s; this transport sends the planned tensors, cast to the
serving dtype one at a time on the CPU, as ``/sync/bucket`` calls of at most ``bucket_bytes`` each.
It is the portable path: any host, any engine, no collective library.
"""

from __future__ import annotations

import torch

from common.tensors import weights as W
from learner.sync.base import PushSender, Sent, cast_stream
from learner.sync.control import SyncSession


class HttpWeightSender(PushSender):
    """Pushes full weights to one rollout server in HTTP buckets (module docstring)."""

    transport = "http"

    def open(self, bucket_bytes: int = 512 << 20) -> SyncSession:
        """A session opened by hand (``/sync/init``), for callers that drive its steps one by one."""
        return self.control.open(bucket_bytes)

    def _send(self, session: SyncSession, planned: list[tuple[str, torch.Tensor]], prepared: object,
              bucket_bytes: int, deadline: float) -> Sent:
        for bucket in W.iter_buckets(cast_stream(session.info, planned), bucket_bytes):
            session.send_bucket(bucket)
        return Sent(bytes=session.bytes, n_buckets=session.n_buckets)
