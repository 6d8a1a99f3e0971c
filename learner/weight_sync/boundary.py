"""Weight sync from the learner to the rollout servers: ``blocking`` and ``overlap`` modes (docs/learner.md, Weight sync).

``weight_sync.mode: blocking`` (default). At a step boundary every
``weight_sync.every_steps`` optimizer steps, and once at start (fresh or resumed)::

    every rank: barrier("before the push")                     all ranks stop at the boundary
    rank 0:     sender.push(full weights)                   init → begin (server fence) → send → commit (sync/base.py)
                per server, bounded by weight_sync.timeout_s
    every rank: barrier("after the push")                      unblocked when rank 0 returns (or fails)
    every rank: broadcast [ver, ok] from rank 0                every rank adopts the same ver before the next decision

Under FSDP2 (``learner.parallel: fsdp``; learner/weight_sync/sharded.py) no rank holds the full weights, so
the push runs on every rank between the two barriers, per server::

    rank 0:     init (skip, adapter) → plan (global shapes)   ranks > 0: wait in the aside plan broadcast
    every rank: broadcast the aside plan from rank 0, then     the served tensors that do not travel and whose
                all-gather each of its tensors (fingerprint      fingerprint samples rank 0 lacks (frozen: once
                samples on rank 0, dropped)                      per run; an adapter session's merged layers)
    rank 0:     begin (fence)                                  ranks > 0: wait in the bucket plan broadcast
    every rank: broadcast the bucket plan from rank 0          (an empty plan if rank 0 failed before the fence,
                                                                 or for a server after a failed one)
    every rank: per bucket: all-gather its tensors (cast to    rank 0 sends the bucket, samples the fingerprint;
                the serving dtype first), in plan order         the others drop it
    rank 0:     a send failed (5xx, timeout, server gone):     sending stops, gathering does not: every rank
                keep gathering the remaining buckets, unsent    issues the same collectives whatever fails
    rank 0:     commit with the fingerprint of what was sent   (no second gather) or abort
    every rank: barrier, broadcast [ver, ok] as above          still the one source of ver

``weight_sync.mode: overlap`` (async mode only). The start-up sync is the blocking one above (server and
learner agree before the first step). Then, at EVERY step boundary, every rank::

    rank 0:     outcome = the push thread's result if it finished since the last boundary (learner/weight_sync/overlap.py)
                due (weight_sync.every_steps since the last push started)?
                  push idle: snapshot the weights (CPU copy / GPU copy on a side stream after an event)
                             and hand them to the push thread; returns at once       time/sync_snapshot
                  push busy: deferred (sync/deferred += 1); it starts at the first boundary the thread is idle
    every rank: broadcast [ver, outcome, started, deferred, in_flight, shards_ok] from rank 0   one tiny collective
    every rank: adopt ver (queue.set_ver) when an outcome came; count attempts/successes/failures/deferred alike
    started:    the snapshot is taken after the broadcast; under FSDP2 every rank copies its own shards to the host
                on a side stream and ranks > 0 send them to rank 0 from a thread over a gloo side group, where rank
                0's push thread assembles them before it pushes (learner/weight_sync/shard_snapshot.py: no gather
                on the training path); where that cannot run (a layout other than one dim-0 shard on a 1-D mesh,
                or after a receive missed its deadline: shards_ok 0), every rank all-gathers each weight in turn
                and rank 0 copies it into its host snapshot, then starts the thread

What travels (DDP and FSDP2 alike): the served names frozen for the run (``learner/recipe.py``
``frozen_names``: ``model.freeze`` groups, and under an adapter every base weight it does not adapt) are
declared at ``/sync/init`` and not sent where the server accepts them; with ``model.adapter.sync: adapter`` the
adapter's tensors travel instead of its layers' merged weights and the server merges them. Under FSDP2 rank 0
decides this from the server's answer and the other ranks learn it from the gather plans it broadcasts (the
aside plan, then the bucket plan: learner/weight_sync/sharded.py), so no rank gathers for a tensor that does
not travel except what the fingerprint needs. The fingerprint always covers the complete served model. A
commit refused for a fingerprint mismatch after such a push (the server's frozen or base copy is not the
learner's) makes every later push to that server a full one. A server that refuses the adapter session itself
(a 400 naming ``adapter``: an engine or transport that does not merge, e.g. vLLM over nccl) gets merged
weights from then on: at once with the same weights (unsharded), or from the next sync (FSDP2: the push's
gathers are already paired with the other ranks', so this sync fails); logged as a warning with the server's
reason, counted in ``sync/adapter_fallbacks`` (rank 0's). ``sync/bytes``, ``sync/skipped_bytes``: what travelled, what not.

No barrier surrounds the push: every rank trains on while rank 0's thread pushes. A push that commits during
step s becomes the learner's ver at the boundary before step s + 1, on every rank at once (the broadcast). The
server tags every /infer response with its ver, so packs stay exact; the learner's ``ver_current`` lags the
server's by at most one ver until that boundary (packs of ``ver_current + 1`` are trained like any other,
``ver_lag`` -1; docs/learner.md: what ``version_window`` bounds). :meth:`WeightSync.settle` waits for a push in
flight (with a deadline) and adopts its outcome before a checkpoint, so the checkpoint's ver is the server's.

Only rank 0 constructs a client, a snapshot or a thread, or opens a connection; the other ranks only
take part in the collectives, FSDP2's gathers included (no rank-dependent branch around a collective:
the collectives of either mode run on every rank whatever happens on rank 0).

A failed or timed-out push (server down, 409, 5xx, deadline) is **not fatal**: rank 0 logs the
error naming the server URL and the command that starts it, counts ``sync/failures``, and every
rank keeps the old ``ver``. Training goes on with A steps and with B packs that are still within
the version window of the old ``ver``; the next due boundary tries again. The server keeps its old
weights and ``ver`` on any failed sync (its fence guarantees it), so learner and server still agree
on what ``ver`` means.

What this module does not know: queues, the schedule, or how the server stages weights.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.distributed import Dist
from learner.weight_sync.base import AdapterPush, WeightSender
from learner.weight_sync.served import is_sharded, named_weights, unwrap
from learner.weight_sync.session import SyncError
from learner.weight_sync.transport import make_sender
from learner.weight_sync.overlap import ABORT_GRACE_S, BackgroundPush, WeightSnapshot
from learner.weight_sync.shard_snapshot import ShardSnapshot
from learner.weight_sync.sharded import GatherError, ShardedWeights

log = logging.getLogger(__name__)

SERVER_START_HINT = "python -m rollout_server --config CONFIG"


def adapter_refused(exc: SyncError) -> bool:
    """The server refused an adapter session as such (a 400 naming ``adapter``), not a failed push."""
    return exc.status == 400 and "adapter" in str(exc) and "fingerprint" not in str(exc)


@dataclass
class SyncResult:
    """What every rank learns at one boundary (identical on every rank after the broadcast)."""

    ok: bool
    ver: int
    metrics: dict[str, float] = field(default_factory=dict)  # rank 0's timings; empty on other ranks
    finished: bool = True  # a push's outcome arrived at this boundary (overlap mode: not on most steps)
    weights_step: int | None = None  # rank 0: optimizer steps behind the pushed weights (overlap: its snapshot's)


class WeightSync:
    """The sync protocols of the module docstring, with their cadence and counters."""

    def __init__(self, cfg: Any, dist: Dist, progress: Callable[[], int] = lambda: 0) -> None:
        """``progress()``: optimizer steps the learner has completed (overlap mode reads it on the push thread)."""
        self.dist = dist
        vcfg, ws = cfg.rollout_matching.vllm, cfg.weight_sync
        self.servers = [s.base_url for s in vcfg.servers]
        self.bucket_bytes = int(ws.bucket_mb) * 2**20
        self.timeout_s = float(ws.timeout_s)
        self.fence = ws.fence
        self.transport = ws.transport  # auto: nccl when this rank has CUDA and the server runs vLLM
        self.master_addr = ws.master_addr
        self.connect_timeout_s = float(vcfg.connect_timeout_s)
        self.every = int(cfg.weight_sync.every_steps)
        self.mode = cfg.weight_sync.mode
        self.auth_token = cfg.rollout_server.auth_token
        adapter = getattr(cfg.model, "adapter", None)
        self.adapter_sync = adapter is not None and adapter.sync == "adapter"
        self._frozen: list[str] = []  # learner/recipe.py frozen_names, once (frozen for the whole run)
        self._frozen_samples: dict = {}  # FSDP2, rank 0: fingerprint samples of frozen weights (ShardedWeights.samples)
        self._adapter: AdapterPush | None = None  # rank 0: the last source's adapter shape (its tensors ride along)
        self._full_push: set[str] = set()  # servers whose copy refused a skip or adapter push: full pushes from now
        self._merged_push: set[str] = set()  # servers that refused the adapter session: merged pushes from now
        self._senders: dict[str, WeightSender] = {}
        self.last_sync_step: int | None = None
        self.counts = {"sync/attempts": 0, "sync/successes": 0, "sync/failures": 0, "sync/deferred": 0,
                       "sync/adapter_fallbacks": 0}
        self.client_calls = 0  # pushes this rank issued (stays 0 on every rank but 0)
        self.gathers = 0  # all-gathers of sharded weights this rank took part in (FSDP2; every rank)
        self.transfer_device: torch.device | None = None  # FSDP2: the gather device, where senders stage bytes
        self.snapshot: WeightSnapshot | None = None
        self.shards: ShardSnapshot | None = None  # FSDP2 overlap, every rank: made at the start-up sync
        self.pusher: BackgroundPush | None = None
        if self.mode == "overlap" and dist.is_main:
            self.snapshot = WeightSnapshot()
            self.pusher = BackgroundPush(lambda tensors, step, ver: self._push_all(lambda: tensors, step, ver),
                                         deadline_s=len(self.servers) * (self.timeout_s + ABORT_GRACE_S),
                                         progress=progress, servers=self.servers)

    def due(self, step: int) -> bool:
        """First boundary of this process, then every ``weight_sync.every_steps`` (same answer on every rank)."""
        return self.last_sync_step is None or step - self.last_sync_step >= self.every

    def boundary(self, model: torch.nn.Module, step: int, ver: int) -> SyncResult | None:
        """What the learner calls at the boundary before optimizer step ``step``; None when nothing happened.

        blocking: :meth:`run` when due. overlap: the start-up sync is :meth:`run`; then
        :meth:`_overlap_boundary` at every boundary (its broadcast runs every step, on every rank).
        """
        if self.mode == "overlap" and self.last_sync_step is not None:
            return self._overlap_boundary(model, step, ver, start=True, wait_s=None)
        return self.run(model, step, ver) if self.due(step) else None

    def settle(self, model: torch.nn.Module, step: int, ver: int, why: str) -> SyncResult | None:
        """overlap: wait for the push in flight (its deadline, within the collective one) and adopt its
        outcome on every rank; starts nothing. Collective: every rank calls it at the same point."""
        if self.mode != "overlap" or self.last_sync_step is None:
            return None
        wait_s = 0.0
        if self.pusher is not None and self.pusher.busy:
            wait_s = min(self.pusher.remaining_s(), 0.9 * self.dist.timeout_s)
            log.info("%s at step %d: waiting up to %.0fs for the weight push in flight, so the saved ver is the "
                     "server's", why, step, wait_s)
        result = self._overlap_boundary(model, step, ver, start=False, wait_s=wait_s)
        if self.dist.is_main and result.metrics.get("sync/in_flight"):
            log.warning("%s at step %d: the weight push in flight did not finish within %.0fs; saving ver %d (the "
                        "server may reach ver %d when it commits; the next sync converges)", why, step, wait_s, ver,
                        ver + 1)
        return result

    def before_weights_change(self) -> None:
        """Call before the optimizer step: on a GPU the training stream waits for the snapshot copy."""
        for snapshot in (self.snapshot, self.shards):
            if snapshot is not None:
                snapshot.guard_writes()

    def close(self) -> None:
        """Wait for a push in flight up to its deadline, then close the senders (no collective: runs on error paths)."""
        if self.pusher is not None and not self.pusher.close(self.pusher.remaining_s()):
            return  # the thread still uses the senders; the process exit ends them
        if self.shards is not None:
            self.shards.close()
        for sender in self._senders.values():
            with contextlib.suppress(Exception):
                sender.close()
        self._senders.clear()

    def _sender(self, base_url: str) -> WeightSender:
        if base_url not in self._senders:
            sender = make_sender(base_url, self.transport, master_addr=self.master_addr, auth_token=self.auth_token,
                                 timeout_s=self.timeout_s, connect_timeout_s=self.connect_timeout_s,
                                 client_id=f"learner-rank{self.dist.rank}@{socket.gethostname()}:{os.getpid()}")
            log.info("weight sync to %s over %s", base_url, sender.transport)
            self._senders[base_url] = sender
        sender = self._senders[base_url]
        if self.transfer_device is not None:
            sender.transfer_device = self.transfer_device  # type: ignore[attr-defined]
        return sender

    def _sharded_source(self, model: torch.nn.Module) -> ShardedWeights:
        """One server's walk over the sharded weights (learner/weight_sync/sharded.py); same list and order on
        every rank: the served weights, then, for an adapter sync, the adapter's tensors (DTensors: the push
        gathers them only when they travel; an overlap snapshot copies both and :meth:`_split` parts them)."""
        from learner.recipe import adapter_push, frozen_names

        inner = unwrap(model)
        if not self._frozen:
            self._frozen = frozen_names(inner)
        extra: list[tuple[str, torch.Tensor]] = []
        if self.adapter_sync:
            self._adapter = adapter_push(inner)
            extra = self._adapter.tensors
        source = ShardedWeights(list(named_weights(model)), self.dist, extra=extra, samples=self._frozen_samples)
        self.transfer_device = source.device
        return source

    def _follow(self, model: torch.nn.Module) -> None:
        """Ranks > 0 under FSDP2: take part in rank 0's gathers, one plan per server (rank 0 announces an
        empty plan for a server it does not push to), whatever the push's outcome."""
        for _ in self.servers:
            source = self._sharded_source(model)
            source.follow()
            self.gathers += source.gathers

    def run(self, model: torch.nn.Module, step: int, ver: int) -> SyncResult:
        """One blocking sync at the boundary before optimizer step ``step``; returns the ver every rank adopts."""
        self.last_sync_step = step
        self.counts["sync/attempts"] += 1
        t0 = time.monotonic()
        self.dist.barrier(f"weight-sync barrier before rank 0's push (step {step})")
        new_ver, ok, metrics = ver, 0, {}
        sharded = is_sharded(model)
        if self.dist.is_main:
            self.client_calls += len(self.servers)
            new_ver, ok, metrics = self._push_all(
                (lambda: self._sharded_source(model)) if sharded else (lambda: self._source(model)), step, ver)
        elif sharded:
            self._follow(model)
        self.dist.barrier(f"weight-sync barrier after rank 0's push (step {step}; rank 0 talks to {self.servers})")
        new_ver, ok = self.dist.broadcast([new_ver, ok], f"ver broadcast after the weight sync (step {step})")
        if sharded and self.mode == "overlap":  # the overlap snapshot's host buffers now, while every rank waits
            self._shard_snapshot().prepare(self._sharded_source(model).named)
        self.counts["sync/successes" if ok else "sync/failures"] += 1
        metrics["time/sync_total"] = time.monotonic() - t0
        return SyncResult(ok=bool(ok), ver=new_ver, metrics=metrics, weights_step=step)

    def _overlap_boundary(self, model: torch.nn.Module, step: int, ver: int, *, start: bool,
                          wait_s: float | None) -> SyncResult:
        """The overlap protocol at one boundary (module docstring); every rank, every step."""
        metrics: dict[str, float] = {}
        new_ver, outcome, started, deferred, in_flight = ver, 0, 0, 0, 0
        weights_step = None
        if self.dist.is_main:
            done = self.pusher.wait(wait_s) if wait_s is not None else self.pusher.poll()
            if done is not None:
                weights_step = done.started_step
                outcome = 1 if done.ok else 2
                new_ver = done.ver if done.ok else ver
                metrics.update(done.metrics)
                metrics["sync/steps_during_push"] = done.steps_during
            if start and self.due(step):
                deferred, started = (1, 0) if self.pusher.busy else (0, 1)
            in_flight = int(self.pusher.busy) | started
        shards_ok = int(self.shards is None or not self.shards.broken)  # after the poll: a failed assembly says it
        new_ver, outcome, started, deferred, in_flight, shards_ok = self.dist.broadcast(
            [new_ver, outcome, started, deferred, in_flight, shards_ok],
            f"overlap weight-sync state broadcast (step {step})")
        if not shards_ok and self.shards is not None:
            self.shards.broken = True  # every rank gathers on the training path from now on
        if started:  # after the broadcast: under FSDP2 every rank takes part (its shards, or a gather)
            t0 = time.monotonic()
            tensors = self._snapshot(model)
            if self.dist.is_main:
                reading = contextlib.nullcontext if callable(tensors) else self.snapshot.reading
                self.pusher.start(tensors, step, new_ver, reading)
                self.client_calls += len(self.servers)
                metrics["time/sync_snapshot"] = time.monotonic() - t0
            self.last_sync_step = step
            self.counts["sync/attempts"] += 1
        self.counts["sync/deferred"] += deferred
        if outcome:
            self.counts["sync/successes" if outcome == 1 else "sync/failures"] += 1
        metrics.update({"sync/in_flight": in_flight, "sync/started": started})
        return SyncResult(ok=outcome == 1, ver=new_ver, metrics=metrics, finished=bool(outcome), weights_step=weights_step)

    def _source(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """Rank 0, weights not sharded: the served weights (merged under an adapter), then, for an adapter sync,
        the adapter's tensors (:meth:`_split` takes them apart again, after an overlap snapshot copied both)."""
        from learner.recipe import adapter_push, frozen_names

        inner = unwrap(model)
        if not self._frozen:
            self._frozen = frozen_names(inner)
        served = list(named_weights(model))
        if not self.adapter_sync:
            return served
        self._adapter = adapter_push(inner)
        return served + self._adapter.tensors

    def _split(self, source: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]],
                                                                       AdapterPush | None]:
        """A :meth:`_source` list (or its snapshot) as (served weights, the adapter push or None)."""
        if self._adapter is None:
            return source, None
        n = len(self._adapter.tensors)
        return source[:-n], AdapterPush(spec=self._adapter.spec, tensors=source[-n:])

    def _snapshot(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]] | Callable[[], list]:
        """The overlap push's copy of the weights: rank 0 copies its own; FSDP2: every rank copies its shards and
        rank 0 gets the push thread's assembly of them (a callable), else every rank gathers each weight in turn
        and rank 0 copies it into its host staging tensors (pinned on a CUDA host)."""
        if not is_sharded(model):
            return self.snapshot.take(self._source(model)) if self.dist.is_main else []
        source = self._sharded_source(model)
        if self._shard_snapshot().take(source.named):
            return self.shards.assemble if self.dist.is_main else []
        tensors: list[tuple[str, torch.Tensor]] = []
        if self.dist.is_main:
            tensors = self.snapshot.take_gathered(source.named, source.each())
        else:
            for _ in source.each():  # take part in every gather, keep nothing
                pass
        self.gathers += source.gathers
        return tensors

    def _shard_snapshot(self) -> ShardSnapshot:
        if self.shards is None:
            self.shards = ShardSnapshot(self.dist, self.timeout_s)
        return self.shards

    def _adapter_fallback(self, url: str, exc: SyncError) -> None:
        """``url`` refused the adapter session: merged pushes to it from now on (module docstring)."""
        self._merged_push.add(url)
        self.counts["sync/adapter_fallbacks"] += 1
        stale = self._senders.pop(url, None)  # a fresh sender (and connection) for the merged push
        if stale is not None:
            stale.close()
        log.warning("%s refused the adapter push (%s); pushing merged weights to it now and from now on (fix the "
                    "refusal to send only the adapter's tensors again)", url, exc)

    def _push_all(self, tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]], step: int,
                  ver: int) -> tuple[int, int, dict[str, float]]:
        """Rank 0 (or its push thread): push to every server in turn; the first failure ends the sync.

        Sharded weights: ``tensors()`` makes a :class:`ShardedWeights` per server; every one of them is
        announced and walked to its end (an empty plan for a server not pushed to), so the other ranks'
        :meth:`_follow` sees one plan per server whatever fails. A failed gather is fatal (GatherError).
        """
        metrics = {"time/sync_fence": 0.0, "time/sync_wire": 0.0, "time/sync_commit": 0.0, "sync/bytes": 0.0,
                   "sync/skipped_bytes": 0.0, "sync/fence_drained": 0.0, "sync/fence_aborted": 0.0,
                   "sync/fence_spared": 0.0}
        vers: list[int] = []
        floor = ver + 1  # ver continues from max(server ver, learner/checkpoint ver) + 1; servers converge
        for i, url in enumerate(self.servers):
            t_push = time.monotonic()
            source = tensors()
            if isinstance(source, ShardedWeights):
                adapter = AdapterPush(spec=self._adapter.spec, tensors=source.extra) if source.extra else None
            else:
                source, adapter = self._split(list(source))
            skip: list[str] = [] if url in self._full_push else self._frozen
            if url in self._full_push or url in self._merged_push:
                adapter = None
            try:
                try:
                    report = self._sender(url).push(source, bucket_bytes=self.bucket_bytes, fence=self.fence,
                                                    min_ver=floor, skip=skip, adapter=adapter)
                except SyncError as exc:
                    if adapter is None or not adapter_refused(exc):
                        raise
                    self._adapter_fallback(url, exc)
                    if isinstance(source, ShardedWeights):
                        raise  # its gathers are spent, paired with the other ranks': merged from the next sync on
                    adapter = None
                    report = self._sender(url).push(source, bucket_bytes=self.bucket_bytes, fence=self.fence,
                                                    min_ver=floor, skip=skip, adapter=None)
            except GatherError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure of the sync keeps training alive (module docstring)
                kept = skip or adapter is not None
                if kept and isinstance(exc, SyncError) and exc.phase == "commit" and "fingerprint" in str(exc):
                    self._full_push.add(url)
                    log.warning("%s refused a push that left its frozen%s weights in place (fingerprint mismatch: "
                                "its copy is not the learner's); every later push to it sends the full weights",
                                url, " or base" if adapter else "")
                for skipped in [source] + [tensors() for _ in self.servers[i + 1:]]:
                    if isinstance(skipped, ShardedWeights):
                        skipped.finish()  # no-op if the push walked it; else an empty plan for the other ranks
                        self.gathers += skipped.gathers
                stale = self._senders.pop(url, None)  # a fresh sender (and connection) next time
                if stale is not None:
                    stale.close()
                hint = "" if "rollout_server" in str(exc) else f" Is the rollout server up? Start it with: {SERVER_START_HINT}"
                log.error(
                    "weight sync to %s failed at step %d after %.1fs (deadline weight_sync.timeout_s=%.0fs): "
                    "%s: %s. Training continues on the old ver %d (A steps; B packs of vers still in the window).%s",
                    url, step, time.monotonic() - t_push, self.timeout_s, type(exc).__name__, exc, ver, hint,
                )
                return ver, 0, metrics
            if isinstance(source, ShardedWeights):
                self.gathers += source.gathers
            vers.append(int(report.ver))  # the client logged the phases and both fingerprints
            floor = max(floor, int(report.ver))
            metrics["time/sync_fence"] += report.fence_s
            metrics["sync/fence_drained"] += report.drained
            metrics["sync/fence_aborted"] += report.aborted
            metrics["sync/fence_spared"] += report.spared
            metrics["time/sync_wire"] += report.wire_s
            metrics["time/sync_commit"] += report.commit_s
            metrics["sync/bytes"] += report.bytes
            metrics["sync/skipped_bytes"] += report.skipped_bytes
        if len(set(vers)) > 1:
            log.warning("rollout servers report different vers after one sync: %s; using the highest", dict(zip(self.servers, vers)))
        return max(vers), 1, metrics
