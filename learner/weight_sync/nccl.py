"""Learner rank 0 -> rollout server weight push over NCCL (the GPU path; docs/learner.md, Weight sync).

    sender = NcclWeightSender("http://127.0.0.1:8000", master_addr="10.0.0.5", timeout_s=300)
    report = sender.push(model.named_parameters(), bucket_bytes=512 << 20, fence="drain")

One push, with what each wait is unblocked by::

    GET /health                          engine (vllm | hf) and its worker count W, once per group
    /sync/init (transport nccl)  ─┐      first push only: the server joins a new group of 1 + W ranks
      ∥ join the group as rank 0 ─┘      both block until every rank joined (deadline: timeout_s)
    plan + fingerprint                   names mapped to the server's manifest, cast to its dtype
    /sync/begin                          the server's fence: admission closed, in-flight drained/aborted
    /sync/update (ONE call)      ─┐      announces every tensor (names, dtypes, shapes, offsets);
      ∥ packed broadcasts        ─┘      rank 0 broadcasts chunks of ~bucket_bytes on 2 side streams;
                                         the call returns once every worker received and loaded them
    /sync/commit                         finish the update, caches reset, ver += 1, fence reopens

Packing is vLLM's (``common.weight_sync.weights.packed_chunks``): tensors in manifest order are
concatenated as bytes until a chunk exceeds ``bucket_bytes``, so the vLLM engine's native consumer
(``update_weights(packed=True)``) and the hf engine's receiver cut the stream the same way.

The group is dedicated (never the DDP group) and kept across pushes. Its flavour follows the
server's engine: vLLM workers rendezvous through vLLM's ``StatelessProcessGroup`` +
``PyNcclCommunicator`` (so that side needs vLLM importable on the learner), the hf engine through a
plain ``torch.distributed`` ``TCPStore`` + ``ProcessGroupNCCL``.

Watchdog: the broadcasts run on a daemon thread that polls each chunk's completion with the push's
deadline, while the HTTP call (with its own timeout) runs on the calling thread. A dead or frozen
server becomes a :class:`~learner.weight_sync.session.SyncError` within ``timeout_s``, never a hang;
the group is then dropped (aborted where the backend can) and the next push builds a new one on a
fresh port. Any failure after ``/sync/init`` sends a best-effort ``/sync/abort``.

The push protocol around the transfer (plan, fingerprint, fence, commit, abort) is
:class:`learner.weight_sync.base.PushSender`'s; this module adds the group and the broadcasts. Sharded
weights (FSDP2): the broadcast thread gathers each chunk just before casting it (every learner rank
takes part; learner/weight_sync/sharded.py), so one chunk, not the model, is whole on rank 0's GPU at a time.

What this module does not know: when to sync (``learner/weight_sync/boundary.py``) or how the server stages weights.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from common.weight_sync.messages import SyncBucketHeader
from common.weight_sync import weights as W
from learner.weight_sync.base import PushSender, Sent
from learner.weight_sync.session import SyncError, SyncSession

log = logging.getLogger(__name__)

NUM_BUFFERS = 2  # chunks in flight on the sender (double buffering, as vLLM's producer)


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the rendezvous store binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("localhost",) else "127.0.0.1", 0))
        return s.getsockname()[1]


class _VllmGroup:
    """vLLM's trainer side of its native NCCL weight transfer: rank 0 of a ``PyNcclCommunicator``."""

    flavour = "vllm"

    def __init__(self, master_addr: str, master_port: int, world_size: int, timeout_s: float, device: Any) -> None:
        torch.cuda.set_device(device)  # trainer_init uses the current device, which is per thread
        # NOTE: vLLM 0.28 removed NCCLWeightTransferEngine.trainer_init (vllm-project/vllm#50902); the
        # module-level helper below exists from 0.20 through 0.26, the range pyproject pins.
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.comm = trainer_init({"master_address": master_addr, "master_port": master_port, "world_size": world_size})
        self.timeout_s = timeout_s

    def broadcast(self, tensor: torch.Tensor) -> Callable[[], bool]:
        stream = torch.cuda.current_stream()
        self.comm.broadcast(tensor, src=0, stream=stream)
        event = torch.cuda.Event()
        event.record(stream)
        return event.query

    def abort(self) -> None:
        self.comm = None  # PyNcclCommunicator has no abort: a stuck kernel stays on its side stream


class _TorchGroup:
    """Plain ``torch.distributed`` group (the hf engine's receiver; gloo when the tensors are on CPU)."""

    flavour = "torch"

    def __init__(self, master_addr: str, master_port: int, world_size: int, timeout_s: float, backend: str,
                 device: Any) -> None:
        if backend == "nccl":
            torch.cuda.set_device(device)
        self.group = W.TorchTransferGroup(master_addr, master_port, 0, world_size, backend=backend, timeout_s=timeout_s)
        warm = torch.zeros(1, device=device if backend == "nccl" else "cpu")  # matches the receiver's first broadcast
        W.wait_work(self.group.broadcast(warm), timeout_s, "the weight-transfer group's first broadcast")

    def broadcast(self, tensor: torch.Tensor) -> Callable[[], bool]:
        return self.group.broadcast(tensor).is_completed

    def abort(self) -> None:
        self.group.abort()


class NcclWeightSender(PushSender):
    """Pushes full weights to one rollout server over a dedicated NCCL group (module docstring)."""

    transport = "nccl"

    def __init__(self, base_url: str, *, master_addr: str = "127.0.0.1", **kw: Any) -> None:
        super().__init__(base_url, **kw)
        self.master_addr = master_addr
        self._group: Any = None
        self._rendezvous: dict[str, Any] | None = None
        self.groups_created = 0

    def close(self) -> None:
        self._drop_group(None)
        super().close()

    def _drop_group(self, why: str | None) -> None:
        """Abort the group; ``why``: the failure that broke it (a warning: the next push builds a new one), or None
        when the sender closes at the run's end (nothing went wrong: info)."""
        group, self._group, self._rendezvous = self._group, None, None
        if group is not None:
            if why is None:
                log.info("closing the weight-transfer group with %s (the sender closed)", self.base_url)
            else:
                log.warning("dropping the weight-transfer group with %s (%s); the next push builds a new one",
                            self.base_url, why)
            try:
                group.abort()
            except Exception as exc:  # noqa: BLE001 - best effort on a broken communicator
                log.warning("could not abort the weight-transfer communicator: %s", exc)

    # ------------------------------------------------------------------ transport hooks

    def _open(self, bucket_bytes: int, named: list[tuple[str, torch.Tensor]], deadline: float,
              weight_load: str | None) -> SyncSession:
        """``/sync/init``; the first time (or after a drop) also builds the group, concurrently with it."""
        device = self._device(named)  # sharded (FSDP2): the gather device, even when the shards live on the host
        had_group = self._group is not None
        try:
            return self._open_group(bucket_bytes, device, deadline, weight_load)
        except BaseException:
            if had_group:  # e.g. the server restarted and lost the group: build a new one next time
                self._drop_group("/sync/init failed")
            raise

    def _open_group(self, bucket_bytes: int, device: torch.device, deadline: float,
                    weight_load: str | None) -> SyncSession:
        if self._group is not None:
            return self.control.open(bucket_bytes, nccl=self._rendezvous, weight_load=weight_load,
                                     **self._declared)
        health = self.control.health()
        world = 1 + health.world_size
        backend = "nccl" if device.type == "cuda" else "gloo"
        rdv = {"master_addr": self.master_addr, "master_port": free_port(self.master_addr), "world_size": world,
               "rank_offset": 1, "backend": backend}
        box: dict[str, Any] = {}

        def init() -> None:
            try:
                box["session"] = self.control.open(bucket_bytes, nccl=rdv, weight_load=weight_load,
                                                   **self._declared)
            except BaseException as exc:  # noqa: BLE001 - handed to the joining thread
                box["error"] = exc

        http = threading.Thread(target=init, name="wsync-init", daemon=True)
        http.start()  # the server joins while we do: vLLM's init blocks until every rank is in
        remaining = max(1.0, deadline - time.monotonic())
        try:
            if health.engine == "vllm":
                group: Any = _run_with_deadline(lambda: _VllmGroup(rdv["master_addr"], rdv["master_port"], world,
                                                                   self.timeout_s, device), remaining,
                                                f"vLLM workers of {self.base_url} to join the weight-transfer group",
                                                lambda: box.get("error"))
            else:
                group = _run_with_deadline(lambda: _TorchGroup(rdv["master_addr"], rdv["master_port"], world,
                                                               self.timeout_s, backend, device), remaining,
                                           f"the {health.engine} engine of {self.base_url} to join the group",
                                           lambda: box.get("error"))
        except BaseException:
            http.join(timeout=1.0)
            if "error" in box:
                raise box["error"] from None
            raise
        http.join(timeout=max(1.0, deadline - time.monotonic()))
        if "error" in box:
            raise box["error"]
        if "session" not in box:
            raise SyncError("init", f"/sync/init on {self.base_url} did not answer within {self.timeout_s:.0f}s")
        self._group, self._rendezvous = group, rdv
        self.groups_created += 1
        log.info("weight-transfer group with %s (%s engine, %d ranks) on %s:%d", self.base_url, health.engine, world,
                 rdv["master_addr"], rdv["master_port"])
        return box["session"]

    def _prepare(self, session: SyncSession, planned: list[tuple[str, torch.Tensor]], dtypes: dict[str, str],
                 bucket_bytes: int) -> tuple[SyncBucketHeader, list[list[int]], list, Any]:
        """The packing header (every tensor announced in one /sync/update), its chunks, and the ready event."""
        specs = [(dtypes[n], list(t.shape)) for n, t in planned]
        header = SyncBucketHeader(session=session.id, index=0, names=[n for n, _ in planned],
                                  dtypes=[d for d, _ in specs], shapes=[s for _, s in specs],
                                  offsets=W.packed_offsets(specs))  # type: ignore[arg-type]
        chunks = W.packed_chunks([end - begin for begin, end in header.offsets], bucket_bytes)
        tensors = [(t.detach(), W.torch_dtype(dtypes[n])) for n, t in planned]  # cast chunk by chunk
        ready = None
        device = self._device(planned)
        # The side streams must see what the caller's stream wrote: the optimizer step (blocking mode), or in
        # overlap mode the snapshot copy (the push thread calls us inside WeightSnapshot.reading(), whose
        # stream waits for the copy's event: learner/weight_sync/overlap.py).
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        return header, chunks, tensors, ready

    def _send(self, session: SyncSession, planned: list[tuple[str, torch.Tensor]], prepared: Any,
              bucket_bytes: int, deadline: float) -> Sent:
        header, chunks, tensors, ready = prepared
        gathered = self._gathered  # sharded: the broadcast thread gathers each chunk just in time (on every rank)
        sender = _Broadcaster(self._group, tensors, chunks, deadline, ready, device=self._device(planned),
                              fetch=gathered.get if gathered is not None else None)
        sender.start()
        try:
            update = session.update(header)  # returns once the server received and loaded every chunk
        except BaseException:
            # The server refused or is gone: stop broadcasting now and wait for the thread, so nothing holds the
            # group when _failed drops it (a transfer group torn down later, at a random garbage collection while
            # other collectives run, once aborted a gloo rank: tests/test_sync_fsdp.py's failing push).
            sender.cancel()
            raise
        sender.join(deadline)
        return Sent(bytes=header.offsets[-1][1] if header.offsets else 0, n_buckets=len(chunks),
                    server_update_s=update.elapsed_s, server_load=update.load)

    def _failed(self, exc: BaseException) -> None:
        if not isinstance(exc, SyncError) or exc.phase in ("update", "wire"):
            self._drop_group(f"{type(exc).__name__} during the push")


class _Broadcaster(threading.Thread):
    """Rank 0's packed broadcasts on ``NUM_BUFFERS`` side streams; every wait polls with the deadline.

    Each chunk is cast to the serving dtype and concatenated on its side stream (after ``ready``, the
    caller's stream at push time), then broadcast; a buffer slot is reused only once its previous
    broadcast completed, so at most ``NUM_BUFFERS`` chunks of ~bucket_bytes exist at a time.
    ``fetch(k, idx)`` (a sharded push) gathers chunk ``k``'s tensors on every learner rank first, on
    that side stream; the chunk is then staged on ``device`` (host weights to the GPU the group uses).
    """

    def __init__(self, group: Any, tensors: list[tuple[torch.Tensor, torch.dtype]], chunks: list[list[int]],
                 deadline: float, ready: Any, device: torch.device | None = None,
                 fetch: Callable[[int, list[int]], list[torch.Tensor]] | None = None) -> None:
        super().__init__(name="wsync-broadcast", daemon=True)
        self.group, self.tensors, self.chunks, self.deadline, self.ready = group, tensors, chunks, deadline, ready
        self.device = device if device is not None else tensors[0][0].device
        self.fetch = fetch
        self.error: str | None = None  # a message, not the exception: its traceback would hold this thread (a cycle)
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop after the chunk in hand (its broadcast is not awaited) and wait for the thread, up to the deadline."""
        self._cancelled.set()
        super().join(timeout=max(0.0, self.deadline - time.monotonic()) + 1.0)
        if self.is_alive():
            log.warning("the weight broadcast thread is still running after the sync deadline (a stuck collective)")

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        while not done():
            if self._cancelled.is_set():
                raise SyncError("wire", f"cancelled while waiting for {what}: the push failed on the HTTP side")
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"{what} not received by the server before the sync deadline")
            time.sleep(0.0002)

    def _flat(self, k: int, idx: list[int]) -> torch.Tensor:
        parts = self.fetch(k, idx) if self.fetch is not None else [self.tensors[i][0] for i in idx]
        flat = torch.cat([t.to(self.tensors[i][1]).contiguous().reshape(-1).view(torch.uint8)
                          for i, t in zip(idx, parts)])
        return flat.to(self.device)  # a no-op unless host weights go out through the GPU's group

    def run(self) -> None:
        try:
            device = self.device
            cuda = device.type == "cuda"
            if cuda:
                torch.cuda.set_device(device)  # the current device is per thread
            streams = [torch.cuda.Stream(device=device) if cuda else None for _ in range(NUM_BUFFERS)]
            in_flight: list[tuple[torch.Tensor, Callable[[], bool]] | None] = [None] * NUM_BUFFERS
            for k, idx in enumerate(self.chunks):
                if self._cancelled.is_set():
                    return  # the gathers not driven here run in ShardedWeights.finish()
                b = k % NUM_BUFFERS
                if in_flight[b] is not None:
                    self._wait(in_flight[b][1], f"chunk {k - NUM_BUFFERS}")
                    in_flight[b] = None
                if cuda:
                    with torch.cuda.stream(streams[b]):
                        if self.ready is not None:
                            streams[b].wait_event(self.ready)
                        flat = self._flat(k, idx)
                        in_flight[b] = (flat, self.group.broadcast(flat))
                else:
                    flat = self._flat(k, idx)
                    in_flight[b] = (flat, self.group.broadcast(flat))
            for item in in_flight:
                if item is not None:
                    self._wait(item[1], "the last chunks")
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = f"{type(exc).__name__}: {exc}"

    def join(self, deadline: float) -> None:  # type: ignore[override]
        super().join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        if self.is_alive():
            raise SyncError("wire", "the NCCL broadcast thread is still running after the sync deadline")
        if self.error is not None:
            raise SyncError("wire", f"NCCL broadcast failed: {self.error}")


def _run_with_deadline(fn: Callable[[], Any], timeout_s: float, awaited: str,
                       early_error: Callable[[], BaseException | None]) -> Any:
    """Run a blocking join on a daemon thread; SyncError after ``timeout_s`` or as soon as the HTTP side failed."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=target, name="wsync-join", daemon=True)
    t.start()
    end = time.monotonic() + timeout_s
    while t.is_alive():
        if early_error() is not None:
            raise SyncError("init", f"/sync/init failed while waiting for {awaited}: {early_error()}")
        if time.monotonic() > end:
            raise SyncError("init", f"waited {timeout_s:.0f}s for {awaited}")
        t.join(timeout=0.05)
    if "error" in box:
        raise SyncError("init", f"joining the weight-transfer group failed: {type(box['error']).__name__}: "
                        f"{box['error']}") from box["error"]
    return box["value"]
