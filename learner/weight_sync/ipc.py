"""Weight push through shared memory on one host: the server copies each bucket out of the learner's buffer.

    with IpcWeightSender("http://127.0.0.1:8410", timeout_s=120) as sender:
        report = sender.push(model.named_parameters(), bucket_bytes=512 << 20, fence="drain")

For a learner rank and a rollout server on the SAME GPU (the one-GPU topology), where NCCL cannot
put both ends of a group on one device and HTTP would take every byte through the host twice. The
learner packs each bucket (:mod:`common.weight_sync.packed`: cast to the serving dtype, laid end to end)
into one persistent buffer on its own device and posts ``/sync/ipc`` with a description of it
(:mod:`common.weight_sync.shared`: a CUDA IPC handle, or a /dev/shm file when the weights are on the
CPU); the server copies the bytes straight into its weights (vLLM: in the GPU worker, device to
device) and answers, and the next bucket reuses the buffer. The protocol (fence, ver, fingerprint,
commit, abort on failure) is :class:`learner.weight_sync.base.PushSender`'s, as for every transport.

The buffer holds one bucket (``bucket_bytes`` or the largest tensor): it is the learner's extra memory.
Sharded weights (FSDP2) are gathered one bucket at a time just before it is packed (``PushSender._bucket``).
"""

from __future__ import annotations

import torch

from common.weight_sync import packed as P
from common.weight_sync.shared import SendBuffer
from learner.weight_sync.base import PushSender, Sent, session_dtypes
from learner.weight_sync.session import SyncSession


class IpcWeightSender(PushSender):
    """Pushes full weights to a server on the same host (same GPU for CUDA weights) by shared memory."""

    transport = "ipc"
    _buf: SendBuffer | None = None

    def _open(self, bucket_bytes: int, named: list[tuple[str, torch.Tensor]], deadline: float,
              weight_load: str | None) -> SyncSession:
        return self.control.open(bucket_bytes, transport="ipc", **self._declared)

    def _buffer(self, nbytes: int, device: torch.device) -> SendBuffer:
        """The shared buffer, kept between pushes (the server opens the same memory every time)."""
        buf = self._buf
        if buf is None or buf.nbytes < nbytes or buf.device != device:
            if buf is not None:
                buf.close()
            self._buf = buf = SendBuffer(nbytes, device)
        return buf

    def _send(self, session: SyncSession, planned: list[tuple[str, torch.Tensor]], prepared: object,
              bucket_bytes: int, deadline: float) -> Sent:
        dtypes = session_dtypes(session.info)
        buckets = P.bucket_plan(planned, dtypes, bucket_bytes)
        pos = {name: i for i, (name, _) in enumerate(planned)}
        device = self._device(planned)  # sharded: the gather device
        buf = self._buffer(max(P.nbytes_of(b) for b in buckets), device)
        for k, layout in enumerate(buckets):
            P.pack_into(buf.tensor[:P.nbytes_of(layout)], self._bucket(k, [pos[e[0]] for e in layout], planned), layout)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the server reads the bytes from another process
            session.send_ipc(layout, buf.describe())
        return Sent(bytes=session.bytes, n_buckets=session.n_buckets)

    def close(self) -> None:
        if self._buf is not None:
            self._buf.close()
            self._buf = None
        super().close()
