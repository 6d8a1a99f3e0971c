"""The overlap snapshot of FSDP2-sharded weights, taken without a gather on the training path.

Under ``weight_sync.mode: overlap`` rank 0 pushes from a host copy of the full weights while every rank trains
on. Gathering that copy with FSDP2's all-gathers at the boundary stalls every rank for the whole gather (0.4-0.8
s a push at 7b on 2 H200s: docs/benchmarks.md section 22). Here each rank copies only its OWN shards at the
boundary, on a side stream, and the shards travel to rank 0 over a gloo group of their own, from threads, while
the ranks train::

    training thread, every rank: the boundary before step s (after the broadcast said a push starts)
      ShardSnapshot.take(entries)    an event on the training stream; a side stream waits for it and copies each
                                     local shard into pinned host memory (rank 0: straight into its rows of the
                                     full tensor; a tensor every rank holds whole: rank 0 copies it); returns at
                                     once                                                     time/sync_snapshot
      guard_writes() before the next optimizer step: the training stream waits for those copies (device side)
    ranks > 0, thread "wsync-shards" ─── waits for its copies, then sends every non-empty shard to rank 0 ──┐
    rank 0, push thread "wsync-overlap": assemble() posts a receive for each (tensor, rank) into the rows    │
      that rank holds, waits for them (deadline: weight_sync.timeout_s) ◄──────────────────────────────────┘
      then merges the Derived entries (an adapter's W + ΔW, on the learner's GPU), and pushes the host copy as
      an unsharded snapshot (learner/weight_sync/overlap.py)                                  time/sync_gather

Why it is exact: FSDP2 shards each parameter on dim 0 in rank order (``torch.chunk``), so rank r's shard is a
contiguous run of rows of the full tensor, at the row offset of the ranks before it. The ranks tell each
other their shard lengths once (an all-gather on the side group at the first snapshot); a parameter that is
not a DTensor of one ``Shard(0)`` placement on a 1-D mesh (HSDP's 2-D mesh, say) makes the layout
``unsupported`` on every rank alike, and the caller gathers the old way (learner/weight_sync/boundary.py).

Why gloo on host memory: the shards are in pinned host memory anyway (the push reads a host copy), the copies
use the GPU's copy engines only, and a second NCCL communicator running beside FSDP2's could interleave with
its collectives. Messages carry the tensor's index as their tag.

Failure: a receive that misses its deadline fails the push (rank 0's outcome, as any failed push) and marks
this snapshot ``broken``; the caller's next boundary broadcast tells every rank, and from then on every rank
gathers the old way (the side group's message order can no longer be trusted). A rank whose send fails logs
it; rank 0's receive then misses its deadline.

Memory: rank 0 holds the full weights in pinned host memory (as the gathered snapshot did); every other rank
its own shards (1/W of them). Nothing on the GPU.

What this module does not know: servers, versions, when to push, or which names are served.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from learner.distributed import Dist
from learner.torch_threads import pin_this_thread, start_pinned
from learner.weight_sync.sharded import Derived

log = logging.getLogger(__name__)

Named = list[tuple[str, torch.Tensor]]
SENDER_JOIN_S = 30.0  # how long a new snapshot waits for the last one's sender (training waits meanwhile)
UNSUPPORTED = -1  # a piece's shard length when its placement is not one dim-0 shard on a 1-D mesh


class ShardSnapshotError(RuntimeError):
    """Rank 0 did not receive every rank's shards within the deadline (the push fails; the side group is spent)."""


def local_shard(t: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """``(this rank's rows, their count)`` of a dim-0-sharded DTensor; ``(None, 0)`` for a tensor every rank holds
    whole; ``(None, UNSUPPORTED)`` for any other placement."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return None, 0
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        return None, UNSUPPORTED
    local = t.to_local()
    return local, int(local.shape[0]) if local.dim() else UNSUPPORTED


def _pieces(entries: Sequence[tuple[str, Any]]) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor | None, int]]]:
    """Every entry's tensor(s) in order (a Derived entry's parts flattened) and each one's :func:`local_shard`."""
    pieces = [p for _, t in entries for p in (t.parts if isinstance(t, Derived) else [t])]
    return pieces, [local_shard(p) for p in pieces]


class ShardSnapshot:
    """One rank's side of the overlap snapshot of sharded weights (module docstring); reused by every push."""

    def __init__(self, dist_: Dist, timeout_s: float) -> None:
        """``timeout_s``: how long rank 0 waits for the shards (and a sender for rank 0), per push."""
        self.dist, self.timeout_s = dist_, float(timeout_s)
        self.broken = False
        self.moved = 0  # shards received (rank 0) or sent (ranks > 0), all pushes
        self._group: Any = None
        self._layout: tuple | None = None  # (the entries' signature, lengths [rank][piece]) once agreed
        self._entries: list[tuple[str, Any]] = []
        self._allocated_for: tuple | None = None  # the layout the host buffers were made for
        self._full: list[torch.Tensor | None] = []  # rank 0: each piece's full host tensor
        self._staging: list[torch.Tensor | None] = []  # ranks > 0: each piece's local rows on the host
        self._stream: Any = None  # the training thread's copy stream
        self._merge_stream: Any = None  # rank 0's push thread: Derived merges
        self._copied: Any = None  # CUDA event: this take's copies are done
        self._guard_pending = False
        self._sender: threading.Thread | None = None
        self._gather_device = torch.device("cpu")
        self._supported = False

    # ------------------------------------------------------------------ training thread, every rank

    @property
    def ready(self) -> bool:
        """The layout is agreed and the host buffers exist (:meth:`prepare` ran)."""
        return self._allocated_for is not None

    def prepare(self, entries: Sequence[tuple[str, Any]]) -> bool:
        """Agree on the layout with the other ranks and allocate the host buffers, copying nothing: the start-up
        sync calls it, when every rank waits anyway, so the first overlap push does not pin ~GBs of host memory
        on the training path. False (on every rank alike) when the layout is unsupported. Collective when the
        layout is new (the lengths)."""
        return self._prepared(entries, *_pieces(entries))

    def take(self, entries: Sequence[tuple[str, Any]]) -> bool:
        """Copy this rank's shards of ``entries`` (``ShardedWeights.named``: DTensors, whole tensors, Derived) to the
        host and, on ranks > 0, start sending them; False (on every rank alike) when the layout is unsupported or
        the snapshot is broken: the caller gathers instead. Collective when the layout is new (:meth:`prepare`)."""
        if self.broken:
            return False
        pieces, shards = _pieces(entries)
        if not self._prepared(entries, pieces, shards):
            return False
        if not self._sender_idle():
            return True  # this rank sends nothing this time; rank 0's receive misses its deadline (module docstring)
        self._entries = list(entries)
        copies = []
        for i, (p, (local, _)) in enumerate(zip(pieces, shards)):
            if self.dist.is_main:
                rows = self._full[i] if local is None else self._full[i].narrow(0, 0, local.shape[0])
                copies.append((rows, p.detach() if local is None else local))
            elif local is not None and local.numel():
                copies.append((self._staging[i], local))
        self._copy(copies)
        if not self.dist.is_main:
            self._start_sender()
        return True

    def guard_writes(self) -> None:
        """Before the optimizer step: on a GPU the training stream waits for the copies (no host wait)."""
        if self._guard_pending:
            torch.cuda.current_stream().wait_event(self._copied)
            self._guard_pending = False

    def close(self) -> None:
        """Wait briefly for a send in flight (no collective: runs on error paths too)."""
        if self._sender is not None:
            self._sender.join(timeout=5.0)

    # ------------------------------------------------------------------ rank 0's push thread

    def assemble(self) -> Named:
        """Rank 0: receive every other rank's shards into the full host tensors, merge the Derived entries, and
        return ``(name, full host tensor)`` in the entries' order. Raises :class:`ShardSnapshotError` (and marks
        the snapshot broken) when a rank's shards miss the deadline."""
        self._wait_copied()
        lengths = self._layout[1]
        works = []
        for i, full in enumerate(self._full):
            offset = lengths[0][i]
            for r in range(1, self.dist.world_size):
                n = lengths[r][i]
                if n > 0:
                    works.append((i, r, dist.irecv(full.narrow(0, offset, n), src=r, group=self._group, tag=i)))
                offset += max(n, 0)
        end = time.monotonic() + self.timeout_s
        for i, r, work in works:
            try:
                work.wait(timeout=datetime.timedelta(seconds=max(0.001, end - time.monotonic())))
            except RuntimeError as exc:
                self.broken = True
                raise ShardSnapshotError(
                    f"{self.dist.where}: rank {r}'s shard of {self._name_of(i)!r} did not arrive within "
                    f"weight_sync.timeout_s={self.timeout_s:.0f}s ({exc}); this push fails and later overlap pushes "
                    "gather the sharded weights on the training path. Read rank "
                    f"{r}'s log for 'wsync-shards'") from exc
            self.moved += 1
        return self._named()

    # ------------------------------------------------------------------ internals

    def _prepared(self, entries: Sequence[tuple[str, Any]], pieces: list[torch.Tensor],
                  shards: list[tuple[torch.Tensor | None, int]]) -> bool:
        if not self._agree(entries, pieces, [n for _, n in shards]):
            return False
        if self._allocated_for != self._layout[0]:
            self._allocate(pieces)
            self._allocated_for = self._layout[0]
        return True

    def _agree(self, entries: Sequence[tuple[str, Any]], pieces: list[torch.Tensor], mine: list[int]) -> bool:
        """Every rank's shard lengths, exchanged once per layout (an all-gather on the side group): the same
        answer on every rank."""
        signature = (tuple(n for n, _ in entries), tuple(tuple(p.shape) for p in pieces))
        if self._layout is None or self._layout[0] != signature:
            if self.dist.world_size > 1 and self._group is None:
                self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
            lengths = [mine]
            if self.dist.world_size > 1:
                t = torch.tensor(mine, dtype=torch.int64)
                out = [torch.empty_like(t) for _ in range(self.dist.world_size)]
                dist.all_gather(out, t, group=self._group)
                lengths = [o.tolist() for o in out]
            self._layout = (signature, lengths)
            ok = True
            for i, p in enumerate(pieces):  # every rank's rows of a sharded piece add up to it; a whole one: all 0
                rows = [n[i] for n in lengths]
                ok = ok and UNSUPPORTED not in rows and sum(rows) in (0, p.shape[0] if p.dim() else 0)
            self._supported = ok
            log.info("overlap sync of sharded weights: %s", "each rank copies its own shards, rank 0 receives them "
                     "beside training (gloo side group)" if ok else "a placement other than one dim-0 shard on a "
                     "1-D mesh: every push gathers on the training path")
        return self._supported

    def _allocate(self, pieces: list[torch.Tensor]) -> None:
        pin = torch.cuda.is_available()
        lengths = self._layout[1][self.dist.rank]
        if self.dist.is_main:
            self._full = [torch.empty(tuple(p.shape), dtype=p.dtype, pin_memory=pin) for p in pieces]
            log.info("overlap sync: host snapshot of the sharded weights, %.1f MB%s (reused by every push)",
                     sum(t.numel() * t.element_size() for t in self._full) / 1e6, " pinned" if pin else "")
        else:
            self._full = [None] * len(pieces)
            self._staging = [torch.empty((n, *p.shape[1:]), dtype=p.dtype, pin_memory=pin) if n > 0 else None
                             for p, n in zip(pieces, lengths)]
        if any(p.is_cuda for p in pieces):
            self._gather_device = torch.device("cuda", torch.cuda.current_device())

    def _copy(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cuda = [src.is_cuda for _, src in copies]
        with torch.no_grad():
            if any(cuda):
                if self._stream is None:
                    self._stream = torch.cuda.Stream()
                params_ready = torch.cuda.Event()
                params_ready.record(torch.cuda.current_stream())  # after the optimizer step's kernels
                self._stream.wait_event(params_ready)
                with torch.cuda.stream(self._stream):
                    for dst, src in copies:
                        dst.copy_(src, non_blocking=src.is_cuda)
                self._copied = torch.cuda.Event()
                self._copied.record(self._stream)
                self._guard_pending = True
            else:
                for dst, src in copies:
                    dst.copy_(src)
                self._copied = None

    def _wait_copied(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def _sender_idle(self) -> bool:
        if self._sender is None or not self._sender.is_alive():
            return True
        self._sender.join(timeout=SENDER_JOIN_S)  # done long ago in practice: rank 0 received them all
        if self._sender.is_alive():
            log.error("%s: the previous push's shards are still being sent %.0fs later; this push sends none (rank 0 "
                      "then fails it and later pushes gather on the training path)", self.dist.where, SENDER_JOIN_S)
            return False
        return True

    def _start_sender(self) -> None:
        ready = threading.Event()
        self._sender = threading.Thread(target=self._send, args=(ready,), name="wsync-shards", daemon=True)
        start_pinned(self._sender, ready, 30.0)

    def _send(self, ready: threading.Event) -> None:
        try:
            pin_this_thread()
        finally:
            ready.set()
        try:
            self._wait_copied()
            works = [(i, dist.isend(t, dst=0, group=self._group, tag=i)) for i, t in enumerate(self._staging)
                     if t is not None]
            end = time.monotonic() + self.timeout_s
            for i, work in works:
                work.wait(timeout=datetime.timedelta(seconds=max(0.001, end - time.monotonic())))
                self.moved += 1
        except Exception as exc:  # noqa: BLE001 - this thread must not die silently: rank 0 fails the push
            log.error("%s: sending this rank's shards to rank 0 for the overlap push failed (%s: %s); rank 0's "
                      "receive misses its deadline and later pushes gather on the training path",
                      self.dist.where, type(exc).__name__, exc)

    def _named(self) -> Named:
        """The entries whole on the host; a Derived entry combined on the learner's GPU, on a stream of this thread's
        own (the default stream would queue each merge behind the training step's kernels)."""
        out, k = [], 0
        on_gpu = self._gather_device.type == "cuda"
        if on_gpu and self._merge_stream is None:
            self._merge_stream = torch.cuda.Stream(device=self._gather_device)
        place = (torch.cuda.stream(self._merge_stream) if on_gpu else contextlib.nullcontext())
        with torch.no_grad(), place:
            for name, t in self._entries:
                if not isinstance(t, Derived):
                    out.append((name, self._full[k]))
                    k += 1
                    continue
                parts = [self._full[k + j].to(self._gather_device, non_blocking=True) for j in range(len(t.parts))]
                k += len(t.parts)
                out.append((name, t.combine(parts).to(dtype=t.dtype).to("cpu")))
        return out

    def _name_of(self, piece: int) -> str:
        k = 0
        for name, t in self._entries:
            k += len(t.parts) if isinstance(t, Derived) else 1
            if piece < k:
                return name
        return f"piece {piece}"


__all__ = ["ShardSnapshot", "ShardSnapshotError", "local_shard"]
