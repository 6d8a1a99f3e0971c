"""Weight push over HTTP: packed buckets as ``/sync/bucket`` bodies (the CPU / no-NCCL path; docs/learner.md, Weight sync).

    with HttpWeightSender("http://127.0.0.1:8310", auth_token=None, timeout_s=300) as sender:
        report = sender.push(model.named_parameters(), bucket_bytes=512 << 20, fence="drain")

The protocol (open, plan, fingerprint, begin, send, commit, abort on failure) is
:class:`learner.weight_sync.base.PushSender`'s; this transport sends the planned tensors, cast to the
serving dtype straight into one reusable host buffer (pinned when the weights are on a GPU), as
``/sync/bucket`` calls cut by the shared packing rule (:mod:`common.weight_sync.packed`): raw bytes, the
layout in the header, no per-tensor framing. It is the portable path: any host, any engine, no
collective library. ``bench/bench_http_sync.py`` measures it against a raw loopback socket.
Sharded weights (FSDP2) are gathered one bucket at a time just before it is packed (``PushSender._bucket``).
"""

from __future__ import annotations

import torch

from common.weight_sync import packed as P
from learner.weight_sync.base import PushSender, Sent, session_dtypes
from learner.weight_sync.session import SyncSession


class HttpWeightSender(PushSender):
    """Pushes full weights to one rollout server in HTTP buckets (module docstring)."""

    transport = "http"

    def open(self, bucket_bytes: int = 512 << 20) -> SyncSession:
        """A session opened by hand (``/sync/init``), for callers that drive its steps one by one."""
        return self.control.open(bucket_bytes)

    _buf: torch.Tensor | None = None

    def _buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """The host buffer buckets are packed into, kept between pushes (pinning 512 MB costs ~0.1 s)."""
        if self._buf is None or self._buf.numel() < nbytes or self._buf.is_pinned() != pinned:
            self._buf = None
            self._buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        return self._buf

    def _send(self, session: SyncSession, planned: list[tuple[str, torch.Tensor]], prepared: object,
              bucket_bytes: int, deadline: float) -> Sent:
        dtypes = session_dtypes(session.info)
        buckets = P.bucket_plan(planned, dtypes, bucket_bytes)
        pos = {name: i for i, (name, _) in enumerate(planned)}
        on_gpu = self._device(planned).type == "cuda"
        buf = self._buffer(max(P.nbytes_of(b) for b in buckets), pinned=on_gpu)
        for k, layout in enumerate(buckets):
            n = P.nbytes_of(layout)
            P.pack_into(buf[:n], self._bucket(k, [pos[e[0]] for e in layout], planned), layout)
            if on_gpu:
                torch.cuda.synchronize()  # the pinned copies ran on the device's stream
            session.send_packed(layout, memoryview(buf[:n].numpy()))
        return Sent(bytes=session.bytes, n_buckets=session.n_buckets)
