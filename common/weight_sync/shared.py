"""Buffers one process fills and another on the same host reads in place: the ``ipc`` weight-sync transport.

    buf = SendBuffer(nbytes, device)         # learner: CUDA memory shared by CUDA IPC, or a /dev/shm file
    pack_into(buf.tensor[:n], ...)           # fill one bucket (common/weight_sync/packed.py)
    source = buf.describe()                  # a SharedBuffer message: plain values, no pickle
    ...
    with open_shared(source, device) as src:  # server: a uint8 tensor viewing the learner's bytes
        target.copy_(src[a:b])

CUDA: the learner's buffer is one allocation of its own caching allocator; ``_share_cuda_()`` gives
the IPC handle torch.multiprocessing would pickle, sent here as base64 fields instead, so the server
never unpickles anything a client sent. The server opens it only on a GPU with the same UUID (IPC
handles do not cross GPUs) and releases it when the ``with`` block ends. CPU: a file under /dev/shm
named ``tandem-sync-<pid>-<random>``, removed by :meth:`SendBuffer.close` (or when the buffer is
collected, or at exit).

What this module does not know: HTTP, sessions, engines.
"""

from __future__ import annotations

import base64
import contextlib
import mmap
import os
import secrets
import weakref
from collections.abc import Iterator

import torch

from common.weight_sync.messages import SharedBuffer

SHM_DIR = "/dev/shm"


def gpu_uuid(device: torch.device | int) -> str:
    """The UUID of a CUDA device as ``torch.cuda.get_device_properties`` gives it (same on both ends)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _b64(raw: bytes | None) -> str:
    return base64.b64encode(raw or b"").decode()


class SendBuffer:
    """A flat uint8 buffer the server can read in place: on ``device`` (CUDA) or in a /dev/shm file (CPU)."""

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.nbytes = int(nbytes)
        self._path: str | None = None
        self._map: mmap.mmap | None = None
        if self.device.type == "cuda":
            self.tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        elif self.device.type == "cpu":
            if not os.path.isdir(SHM_DIR):
                raise RuntimeError(f"sync transport 'ipc' on CPU needs {SHM_DIR} (Linux shared memory); "
                                   "set weight_sync.transport: http")
            name = f"tandem-sync-{os.getpid()}-{secrets.token_hex(4)}"
            self._path = os.path.join(SHM_DIR, name)
            fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, max(self.nbytes, 1))
                self._map = mmap.mmap(fd, max(self.nbytes, 1))
            finally:
                os.close(fd)
            # removed at close(), or when this object goes or the process exits (no atexit entry per buffer:
            # the vLLM engine makes one per staged bucket)
            self._unlink = weakref.finalize(self, _remove, self._path)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)[:self.nbytes]
        else:
            raise ValueError(f"sync transport 'ipc' cannot share {self.device.type} memory (cuda or cpu)")

    def describe(self, offset: int = 0) -> SharedBuffer:
        """The message that lets the server open this buffer (a fresh CUDA IPC reference each call)."""
        if self.device.type == "cuda":
            (_dev, handle, size, storage_offset, rc_handle, rc_offset, ev_handle,
             ev_sync) = self.tensor.untyped_storage()._share_cuda_()
            return SharedBuffer(kind="cuda", offset=offset, size=int(size), device_uuid=gpu_uuid(self.device),
                                handle=_b64(handle), storage_offset=int(storage_offset),
                                ref_counter_handle=_b64(rc_handle), ref_counter_offset=int(rc_offset),
                                event_handle=_b64(ev_handle), event_sync_required=bool(ev_sync))
        assert self._path is not None
        return SharedBuffer(kind="shm", offset=offset, size=self.nbytes, path=os.path.basename(self._path))

    def close(self) -> None:
        """Free the buffer (CPU: unmap and remove the file). Idempotent."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still alive: the file is removed anyway
                self._map.close()
            self._map = None
        if self._path is not None:
            self._unlink()
            self._path = None


@contextlib.contextmanager
def open_shared(src: SharedBuffer, device: torch.device | None = None) -> Iterator[torch.Tensor]:
    """A uint8 tensor viewing the bytes ``src`` describes (``[offset, size)``), valid inside the block.

    ``device``: the CUDA device this process serves on (``cuda`` sources only). Raises ValueError
    with the fix when the buffer cannot be opened here (another GPU, no such file, too small).
    """
    if src.kind == "shm":
        path = os.path.join(SHM_DIR, src.path or "")
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ValueError(f"source.path: no shared-memory file {path} on this host; transport 'ipc' needs the "
                             "learner and the server on one host (else set sync.transport: http)") from None
        try:
            if os.fstat(fd).st_size < src.size:
                raise ValueError(f"source.size: {path} has {os.fstat(fd).st_size} bytes, the request says {src.size}")
            mapped = mmap.mmap(fd, max(src.size, 1), access=mmap.ACCESS_COPY)  # copy-on-write: read only in effect
        finally:
            os.close(fd)
        try:
            yield torch.frombuffer(mapped, dtype=torch.uint8)[src.offset:src.size]
        finally:
            with contextlib.suppress(BufferError):
                mapped.close()
        return
    if device is None or torch.device(device).type != "cuda":
        raise ValueError("source.kind: a CUDA IPC buffer, but this server's weights are not on a GPU; "
                         "set sync.transport: http (or nccl)")
    device = torch.device(device)
    if gpu_uuid(device) != src.device_uuid:
        raise ValueError(f"source.device_uuid: the learner's buffer is on GPU {src.device_uuid}, this server "
                         f"serves on {gpu_uuid(device)}; CUDA IPC needs both on one GPU (else sync.transport: nccl)")
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index if device.index is not None else torch.cuda.current_device(),
        base64.b64decode(src.handle or ""), src.size, src.storage_offset,
        base64.b64decode(src.ref_counter_handle or ""), src.ref_counter_offset,
        base64.b64decode(src.event_handle or ""), src.event_sync_required)
    whole = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (src.size,), (1,))
    try:
        yield whole[src.offset:]
    finally:
        del whole
        del storage  # drops the IPC reference (the learner's ref counter) once nothing views it


__all__ = ["SendBuffer", "gpu_uuid", "open_shared"]
