"""Weights sharded by FSDP2 (``learner.parallel: fsdp``), gathered one bucket at a time on every rank for a push.

Under FSDP2 every parameter is a DTensor sharded over the learner ranks (dim 0; in host memory with
``learner.fsdp.cpu_offload``), and ``DTensor.full_tensor()`` is a collective: every rank gathers the
same tensors in the same order. So a sharded push runs on EVERY rank (``learner/weight_sync/boundary.py``),
rank 0 inside :meth:`learner.weight_sync.base.PushSender.push`, the others in :meth:`ShardedWeights.follow`::

    rank 0 (PushSender.push with a ShardedWeights)            ranks > 0 (ShardedWeights.follow)
    /sync/init, plan (names, global shapes: no gather),
      what travels (skip, adapter: the server's answer)
    the aside gathers (Fingerprint, below)               ◄──► the same broadcast and all-gathers
    /sync/begin (the fence)
    announce: broadcast the plan  ─────────────────────────►  the plan: which tensors, which bucket, which dtype
      (a failure before this point announces "nothing":                (nothing: return at once)
      no bucket is gathered)
    per bucket k, per tensor: cast the local shard to the ◄──► the same all-gathers, results dropped
      serving dtype, all-gather (full_tensor), then send
      bucket k (HTTP body, shared buffer, NCCL chunk) and
      sample it for the fingerprint
    a send failed (5xx, timeout, server gone): sending
      stops, GATHERING DOES NOT — finish() drives the
      remaining buckets' gathers, then /sync/abort
    /sync/commit with the fingerprint accumulated while sending

Failure can never desynchronise the ranks: once a plan of K buckets is announced, every rank issues
exactly K buckets of all-gathers whatever happens on rank 0 (no per-bucket continue/abort message);
before the announcement, rank 0 announces an empty plan. Per push and server the collective sequence
is fixed: the aside plan's broadcast and its gathers (below), then the bucket plan's broadcast and one
all-gather per tensor it sends. The push's outcome still reaches the other ranks only through the
boundary's ``[ver, ok]`` broadcast. A failed gather is not a failed push: it means the learner's process
group is broken, and :class:`GatherError` ends the run.

Memory: rank 0 holds one bucket of gathered tensors (in the serving dtype) plus what its transport
holds (one packed bucket; NCCL: two chunks in flight); the other ranks hold one gathered tensor at a
time. Nothing holds the whole model. Cast before the gather: a cast is elementwise, so the result is
bit-identical to casting the full tensor, and a float32 master moves half the bytes as bfloat16.

Fingerprint: the server checks it at ``/sync/commit``, after the buckets, so :class:`RunningFingerprint`
samples each tensor while its gathered copy exists: no second gather. It is the hash of
``common.weight_sync.weights.fingerprint`` fed one tensor at a time (``tests/test_sync_fsdp.py`` pins the two
equal). It covers the complete served model, so the served tensors that do not travel (frozen names the server
kept, an adapter session's merged layers) are gathered *aside*, before the fence, on every rank: rank 0
broadcasts which, samples each and drops it (:meth:`ShardedWeights.announce_aside`). A frozen tensor never
changes, so rank 0 keeps its samples (``samples``, owned by the caller across pushes) and later pushes gather
it no more; an adapted layer's merge changes with every step, so its parts are gathered aside at every push
of an adapter session (not sent: the server merges its own base)::

    rank 0                                                      ranks > 0
    /sync/init (skip, adapter) -> plan, what travels
    announce aside: the unsent served tensors whose  ─────────► the aside plan (nothing: an empty one)
      samples it lacks
    per aside tensor: all-gather, sample, drop       ◄────────► the same all-gathers, dropped
    /sync/begin, announce the buckets, gather + send ... as above

Derived weights: a served weight that no single parameter holds (an adapted layer's W + ΔW under
``model.adapter.sync: merged``) is a :class:`Derived` entry: its parts (the base weight and the adapter's
tensors, each a DTensor) are gathered whole in their own dtype, in order, on every rank, and rank 0 alone
combines them (learner/recipe_sharded.py merges with peft) and casts the result to the serving dtype. Such
an entry costs one all-gather per part: ``gathers`` counts each.

What this module does not know: servers, transports, peft, or when to sync.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from common.weight_sync.messages import SYNC_DTYPE_BYTES
from common.weight_sync import weights as W
from learner.distributed import Dist

DTYPES = sorted(SYNC_DTYPE_BYTES)  # dtype codes in the plan broadcast


class GatherError(RuntimeError):
    """An all-gather of the sharded weights failed: the learner's process group is broken (fatal, not a failed push)."""


def gather_device(named: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    """Where the shards are gathered: the device mesh's type (cuda: this thread's current GPU), else the CPU."""
    from torch.distributed.tensor import DTensor

    mesh = next((t.device_mesh for _, t in named if isinstance(t, DTensor)), None)
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Derived:
    """A served weight computed from several (sharded) tensors: ``combine(parts gathered whole)`` on rank 0.

    ``shape`` / ``dtype``: the served tensor's, before the cast to the serving dtype (plans and snapshots
    read them as they read a DTensor's). ``combine`` runs on rank 0 only and must not call a collective.
    """

    def __init__(self, parts: Sequence[torch.Tensor], combine: Callable[[list[torch.Tensor]], torch.Tensor],
                 shape: torch.Size, dtype: torch.dtype) -> None:
        self.parts, self.combine, self.shape, self.dtype = list(parts), combine, torch.Size(shape), dtype

    def numel(self) -> int:
        return self.shape.numel()


class ShardedWeights:
    """One push's walk over the sharded weights, identical on every rank (module docstring).

    Iterating it yields ``(HF name, DTensor)`` without gathering (plans use the global shapes). Not
    reusable: one object per push and server (``finish`` closes it).
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], dist: Dist,
                 device: torch.device | None = None, *, extra: Sequence[tuple[str, torch.Tensor]] = (),
                 samples: dict[tuple[str, str], tuple[bytes, torch.Tensor]] | None = None) -> None:
        """``named``: the served weights (what iterating yields); ``extra``: tensors that may travel beside them
        but are not served (an adapter session's ``lora_*``); ``samples``: rank 0's fingerprint samples of frozen
        tensors by (name, serving dtype), kept by the caller across pushes (module docstring)."""
        self.n_served = len(named)
        self.named = list(named) + list(extra)
        self.dist = dist
        self.device = device if device is not None else gather_device(self.named)
        self.index = {id(t): i for i, (_, t) in enumerate(self.named)}
        self.samples = samples if samples is not None else {}
        self.aside: list[tuple[int, torch.dtype]] | None = None  # None until announced
        self.buckets: list[list[tuple[int, torch.dtype]]] | None = None  # None until announced
        self.gathers = 0  # all-gathers this rank issued
        self._aside_next = 0
        self._next = 0
        self._closed = False
        self._broken = False  # a gather failed: the process group is gone, no further collective can complete
        self._lock = threading.Lock()  # NCCL: rank 0 gathers on the broadcast thread, finish() on the caller's

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.named[:self.n_served])

    def __len__(self) -> int:
        return self.n_served

    @property
    def extra(self) -> list[tuple[str, torch.Tensor]]:
        return self.named[self.n_served:]

    # ------------------------------------------------------------------ the aside plan (one broadcast)

    def announce_aside(self, planned: Sequence[tuple[str, torch.Tensor]] | None = None,
                       dtypes: dict[str, str] | None = None) -> None:
        """Rank 0: broadcast which tensors are gathered aside (``planned``, each in its ``dtypes`` entry; None:
        nothing). Other ranks: receive it (their arguments are ignored). Collective; then :meth:`gather_aside`."""
        n = len(self.named)
        values = [0] * (1 + 2 * n)  # [count, then per tensor: param index, dtype code]
        if self.dist.is_main and planned is not None:
            values[0] = len(planned)
            for j, (name, t) in enumerate(planned):
                values[1 + 2 * j:3 + 2 * j] = [self.index[id(t)], DTYPES.index(dtypes[name])]
        values = self.dist.broadcast(values, "the sharded weight push's aside plan (rank 0 -> every rank)")
        self.aside = [(values[1 + 2 * j], W.torch_dtype(DTYPES[values[2 + 2 * j]])) for j in range(values[0])]

    def gather_aside(self) -> Iterator[torch.Tensor]:
        """The announced aside tensors, each gathered whole in its dtype, in order (what a consumer leaves,
        :meth:`finish` gathers). Collective per tensor."""
        while True:
            with self._lock:
                if self._closed or self.aside is None or self._aside_next >= len(self.aside):
                    return
                i, dtype = self.aside[self._aside_next]
                self._aside_next += 1
                full = self._full(i, dtype)
            yield full

    # ------------------------------------------------------------------ the plan (one broadcast)

    def announce(self, planned: Sequence[tuple[str, torch.Tensor]] | None = None,
                 groups: Sequence[Sequence[int]] = (), dtypes: dict[str, str] | None = None) -> None:
        """Rank 0: broadcast which tensors each bucket gathers (``groups``: indices into ``planned``), in
        which dtype; None: nothing. Other ranks: receive it (their arguments are ignored). Collective."""
        n = len(self.named)
        values = [0] * (1 + 3 * n)  # [status, then per sent tensor: param index, bucket, dtype code]
        if self.dist.is_main and planned is not None:
            values[0] = 1
            for j, (k, i) in enumerate((k, i) for k, idx in enumerate(groups) for i in idx):
                name, t = planned[i]
                values[1 + 3 * j:4 + 3 * j] = [self.index[id(t)], k, DTYPES.index(dtypes[name])]
            values[1 + 3 * len(planned):] = [-1] * (3 * (n - len(planned)))
        values = self.dist.broadcast(values, "the sharded weight push's bucket plan (rank 0 -> every rank)")
        buckets: list[list[tuple[int, torch.dtype]]] = []
        if values[0]:
            for j in range(n):
                i, k, code = values[1 + 3 * j:4 + 3 * j]
                if i < 0:
                    break
                if k == len(buckets):
                    buckets.append([])
                buckets[k].append((i, W.torch_dtype(DTYPES[code])))
        self.buckets = buckets

    # ------------------------------------------------------------------ the gathers

    def gather(self, k: int) -> list[torch.Tensor]:
        """Bucket ``k``'s full tensors in the serving dtype, on :attr:`device`. Collective; in bucket order."""
        with self._lock:
            if self._closed or self.buckets is None or k != self._next:
                raise RuntimeError(f"bucket {k} requested out of order (next {self._next}, closed {self._closed}): "
                                   "the gathers must follow the announced plan")
            self._next += 1
            return [self._full(i, dtype) for i, dtype in self.buckets[k]]

    def finish(self) -> None:
        """Announce empty plans where none was, then gather everything announced and not gathered yet (dropped):
        the aside tensors, then the buckets. Idempotent."""
        with self._lock:
            self._closed = True
            if self._broken:
                return
            if self.aside is None:
                self.announce_aside(None)
            while self._aside_next < len(self.aside):
                self._full(*self.aside[self._aside_next])
                self._aside_next += 1
            if self.buckets is None:
                self.announce(None)
            while self._next < len(self.buckets):
                for i, dtype in self.buckets[self._next]:
                    self._full(i, dtype)
                self._next += 1

    def follow(self) -> int:
        """Ranks > 0: receive rank 0's plans (aside, then buckets) and take part in every gather of them; returns
        the buckets gathered."""
        self.finish()
        return len(self.buckets or [])

    def each(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight gathered whole, in its own dtype, one at a time, in the same order on every rank
        (the overlap mode's snapshot: no plan to announce). Collective per tensor."""
        for i, (name, t) in enumerate(self.named):
            yield name, self._full(i, t.dtype)

    def _full(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        name, p = self.named[i]
        if not isinstance(p, Derived):
            return self._gather(name, p, dtype)
        # parts in their own dtype (a merge of cast parts would not be the merge of the weights); the cast after
        parts = [self._gather(name, t, t.dtype) for t in p.parts]
        if not self.dist.is_main:
            return parts[0]  # ranks > 0 drop what they gather
        try:
            with torch.no_grad():
                return p.combine(parts).to(dtype=dtype)
        except Exception as exc:  # noqa: BLE001 - a bug, not a push failure: the ranks' gathers would part ways
            self._broken = True
            raise GatherError(f"{self.dist.where}: combining the gathered parts of {name!r} failed "
                              f"({type(exc).__name__}: {exc}); the other ranks' next collective times out") from exc

    def _gather(self, name: str, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            if not isinstance(p, DTensor):  # not sharded: every rank holds it whole
                return p.detach().to(device=self.device, dtype=dtype)
            try:
                local = p.to_local().to(device=self.device, dtype=dtype)  # NCCL gathers device memory
                full = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                                          stride=p.stride()).full_tensor()
            except Exception as exc:  # noqa: BLE001 - re-raised as the fatal kind
                self._broken = True
                raise GatherError(f"{self.dist.where}: all-gather of {name!r} for the weight push failed "
                                  f"({type(exc).__name__}: {exc}). Likely cause: another learner rank died or is "
                                  "in a different collective (every rank must run the same sync)") from exc
        self.gathers += 1
        return full


class RunningFingerprint:
    """``common.weight_sync.weights.fingerprint(named, dtypes)`` built one tensor at a time (each already in its
    serving dtype), so a sharded push samples each tensor while its gathered copy exists."""

    def __init__(self) -> None:
        self._parts: dict[str, tuple[bytes, torch.Tensor]] = {}

    def add(self, name: str, t: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """Sample ``t`` (in its serving dtype) as ``name``; returns the sample (what :meth:`put` takes back)."""
        flat = t.detach().reshape(-1)
        n = flat.numel()
        if n > W.FINGERPRINT_SAMPLES:  # the same evenly spaced samples (integer arithmetic) as the original
            k = W.FINGERPRINT_SAMPLES
            flat = flat[torch.arange(k, device=flat.device) * (n - 1) // (k - 1)]
        head = f"{name}|{W.dtype_name(flat.dtype)}|{list(t.shape)}|".encode()
        self._parts[name] = (head, flat.contiguous().view(torch.uint8))  # a small copy; the full tensor can go
        return self._parts[name]

    def put(self, name: str, part: tuple[bytes, torch.Tensor]) -> None:
        """A sample :meth:`add` returned for ``name`` in an earlier push (a frozen tensor: it never changes)."""
        self._parts[name] = part

    def names(self) -> set[str]:
        return set(self._parts)

    def hexdigest(self) -> str:
        names = sorted(self._parts)
        samples = [self._parts[n][1] for n in names]
        if any(s.is_cuda for s in samples):
            torch.cuda.synchronize()  # sampled on the side streams of the NCCL sender
        blob = torch.cat([s.cpu() for s in samples]).numpy().tobytes() if samples else b""
        h, pos = hashlib.blake2b(digest_size=8), 0
        for name, s in zip(names, samples):
            h.update(self._parts[name][0])
            h.update(blob[pos:pos + s.numel()])
            pos += s.numel()
        return h.hexdigest()


class BucketGather:
    """Rank 0's side of one sharded push: the bucket cut (the transports' shared rule), its announcement,
    the gathers the transport asks for, and the fingerprint of the served tensors it sent (``fingerprint``: the
    running one the aside gathers began; ``served``: the names it samples, an adapter's own tensors not)."""

    def __init__(self, source: ShardedWeights, planned: Sequence[tuple[str, torch.Tensor]], dtypes: dict[str, str],
                 bucket_bytes: int, fingerprint: RunningFingerprint | None = None,
                 served: set[str] | None = None) -> None:
        self.source, self.planned = source, list(planned)
        sizes = [e - b for b, e in W.packed_offsets([(dtypes[n], list(t.shape)) for n, t in self.planned])]
        self.groups = W.packed_chunks(sizes, bucket_bytes)  # = common.weight_sync.packed.bucket_plan's cut
        self.fingerprint = fingerprint if fingerprint is not None else RunningFingerprint()
        self.served = served
        source.announce(self.planned, self.groups, dtypes)

    def get(self, k: int, idx: Sequence[int]) -> list[torch.Tensor]:
        """The gathered tensors of bucket ``k`` (planned indices ``idx``, which must be the announced cut)."""
        if list(idx) != self.groups[k]:
            raise RuntimeError(f"the transport cut bucket {k} as {list(idx)}, the announced plan has {self.groups[k]}")
        tensors = self.source.gather(k)
        for i, t in zip(idx, tensors):
            if self.served is None or self.planned[i][0] in self.served:
                self.fingerprint.add(self.planned[i][0], t)
        return tensors


__all__ = ["BucketGather", "Derived", "GatherError", "RunningFingerprint", "ShardedWeights", "gather_device"]
