"""One weight push, whatever the transport: the sender interface, the plan, and the push protocol.

Every sender pushes the learner's weights to one rollout server the same way::

    open      /sync/init: a session with the server's manifest, tied groups and serving dtype; it declares the
              names frozen for the run (``skip``) and, for ``model.adapter.sync: adapter``, the adapter
              (a transport may set itself up here: the NCCL sender joins its group)
    plan      names mapped to the manifest, tied weights once, every served name present, shapes checked
    fingerprint  of the COMPLETE served model as the server will hold it (its dtype): frozen and merged
              tensors included, whatever travels
    select    what travels: the planned tensors minus the frozen names the server accepted, and in an
              adapter session minus the adapted layers' weights plus the adapter's tensors
    prepare   what the transport needs before the fence (e.g. the NCCL packing header)
    begin     /sync/begin: the server's fence closes (in-flight /infer drained or aborted)
    send      the transport moves the bytes (HTTP buckets; NCCL broadcasts)
    commit    /sync/commit: the server swaps, checks the fingerprint, ver += 1, the fence reopens
    on any failure after open: /sync/abort (best effort), the server keeps its old weights and ver
    check     the server's fingerprint equals ours

Sharded weights (a :class:`learner.weight_sync.sharded.ShardedWeights` as ``named_tensors``, FSDP2): the plan
uses the global shapes and ``select`` is the same (skip and adapter sessions included); before ``begin`` the
served tensors that do not travel are gathered *aside* for the fingerprint (a frozen one only until rank 0 holds
its samples: it never changes); after ``begin`` the bucket plan is announced to every learner rank, each
bucket is gathered just in time when the transport asks for it (:meth:`PushSender._bucket`), and the
fingerprint is sampled from the gathered tensors as they go and sent at ``commit`` (no second
gather). What travels is decided on rank 0 from the server's answer and reaches the other ranks as the
aside and bucket plans (broadcasts), so every rank runs the same gathers. Whatever fails, the remaining
gathers still run (``ShardedWeights.finish``), so the other ranks never wait for a collective that does not
come (learner/weight_sync/sharded.py).

:class:`PushSender` writes this protocol once; a transport implements :meth:`PushSender._send`
(and, where it needs them, ``_open``, ``_prepare`` and ``_failed``). :class:`WeightSender` is the
interface the learner's sync boundary (``learner/weight_sync/boundary.py``) holds;
``learner.weight_sync.transport.make_sender`` picks the transport.

What this module does not know: when to sync, ranks, or how the server stages weights.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from common.weight_sync.messages import AdapterSpec, SyncInitResponse
from common.weight_sync import weights as W
from learner.weight_sync.session import SyncClient, SyncError, SyncSession
from learner.weight_sync.sharded import BucketGather, RunningFingerprint, ShardedWeights

log = logging.getLogger(__name__)

Named = Iterable[tuple[str, torch.Tensor]]
#: A fence that drains re-run batches longer than this says so (a warning the first time, then info): at 7b with
#: rollouts of up to 3,084 tokens one drained for 48.5 s while no rollout was admitted (docs/benchmarks.md section 22).
SLOW_DRAIN_S = 5.0


@dataclass
class SyncReport:
    """What one committed push took (seconds) and moved."""

    ver: int
    fence_s: float  # /sync/begin: admission closed and in-flight drained or aborted
    wire_s: float  # all /sync/bucket calls (cast + serialise + transfer + server staging)
    commit_s: float  # /sync/commit round trip (swap + cache reset on the server)
    total_s: float  # init to commit response
    bytes: int
    n_buckets: int
    fingerprint: str  # of the weights now served (equal to the learner's)
    ver_before: int = 0
    drained: int = 0
    aborted: int = 0
    spared: int = 0  # of drained: re-runs an earlier abort fence had cut (SyncBeginResponse.spared)
    server_update_s: float | None = None  # NCCL path: the server's own time for /sync/update (receive + load)
    server_load: dict | None = None  # NCCL path: how the engine loaded it (SyncBucketResponse.load)
    skipped_bytes: int = 0  # served bytes (serving dtype) not sent in full: frozen, or merged on the server
    n_skipped: int = 0  # served tensors not sent in full


@dataclass
class Sent:
    """What a transport's ``_send`` moved (for the report)."""

    bytes: int
    n_buckets: int
    server_update_s: float | None = None
    server_load: dict | None = None


@dataclass
class AdapterPush:
    """An ``adapter`` session's payload: the adapter's shape and its tensors under the wire names of
    ``rollout_server/engines/adapter_merge.py`` (``<layer>.lora_A.weight`` ...; learner/recipe.py builds both)."""

    spec: AdapterSpec
    tensors: list[tuple[str, torch.Tensor]]


class WeightSender(Protocol):
    """What the learner holds per rollout server: push every served weight and commit, or raise SyncError."""

    base_url: str
    transport: str

    def push(self, named_tensors: Named, bucket_bytes: int = 512 << 20, fence: str = "drain",
             min_ver: int | None = None, *, skip: Iterable[str] = (),
             adapter: AdapterPush | None = None) -> SyncReport: ...

    def close(self) -> None: ...


def plan(info: SyncInitResponse, named_tensors: Named) -> list[tuple[str, torch.Tensor]]:
    """Match the learner's tensors to the server's manifest, in manifest order (not yet cast).

    Names lose ``module.`` / ``_orig_mod.``; a tied group is sent once under its first name;
    names the server does not serve are skipped with a warning. Raises :class:`SyncError` when a
    served name is missing or a shape differs (before any fence is closed).
    """
    alias = {n: g[0] for g in info.tied for n in g[1:]}
    specs = {s.name: s for s in info.manifest}
    found: dict[str, torch.Tensor] = {}
    extra = []
    for raw, t in named_tensors:
        name = alias.get(W.hf_name(raw), W.hf_name(raw))
        if name not in specs:
            extra.append(raw)
        elif name not in found:
            found[name] = t
    if extra:
        log.warning("weight sync skips %d tensor(s) the server does not serve (first: %s)", len(extra), extra[0])
    missing = [n for n in specs if n not in found]
    if missing:
        raise SyncError("plan", f"{len(missing)} served parameter(s) missing on the learner (first: {missing[0]!r}); "
                        "send the HF model's own named_parameters() (same architecture as the server)")
    bad = [(n, list(found[n].shape), s.shape) for n, s in specs.items() if list(found[n].shape) != s.shape]
    if bad:
        raise SyncError("plan", f"{len(bad)} shape mismatch(es), first {bad[0][0]!r}: learner {bad[0][1]} vs "
                        f"server {bad[0][2]}")
    return [(n, found[n]) for n in specs]


def session_dtypes(info: SyncInitResponse) -> dict[str, str]:
    """Name -> the dtype it travels in: every served name's serving dtype, and an adapter session's tensors'."""
    return {s.name: s.dtype for s in [*info.manifest, *info.adapter_manifest]}


def select(info: SyncInitResponse, planned: list[tuple[str, torch.Tensor]],
           adapter: AdapterPush | None) -> list[tuple[str, torch.Tensor]]:
    """What travels this session: the planned tensors minus the frozen names the server accepted
    (``info.skip``), and in an adapter session minus the adapted layers' weights (the server merges them)
    plus every adapter tensor of ``info.adapter_manifest`` (SyncError when one is missing or misshapen)."""
    kept = set(info.skip)
    if adapter is None:
        return [(n, t) for n, t in planned if n not in kept]
    merged = {f"{layer}.weight" for layer in adapter.spec.layers}
    have = dict(adapter.tensors)
    wanted = info.adapter_manifest
    bad = [s.name for s in wanted if s.name not in have or list(have[s.name].shape) != s.shape]
    if bad or not wanted:
        raise SyncError("plan", f"the server's adapter manifest does not match the learner's adapter (first: "
                        f"{bad[0] if bad else 'an empty manifest'!r}); is the server a tandem hf engine of this "
                        "version?")
    return [(n, t) for n, t in planned if n not in kept and n not in merged] + [(s.name, have[s.name]) for s in wanted]


def cast_stream(info: SyncInitResponse, planned: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor as the server holds it: CPU, contiguous, serving dtype (one at a time)."""
    dtypes = session_dtypes(info)
    for name, t in planned:
        yield name, t.detach().to(device="cpu", dtype=W.torch_dtype(dtypes[name])).contiguous()


class PushSender(abc.ABC):
    """The push protocol of the module docstring over a :class:`SyncClient`; transports fill in ``_send``."""

    transport = "?"
    #: Where a transport stages bytes when the weights do not say (FSDP2: the gather device, also for the
    #: overlap mode's host snapshot, so NCCL and CUDA IPC still go through the learner's GPU). None: the tensors'.
    transfer_device: torch.device | None = None
    _sharded: ShardedWeights | None = None  # during a sharded push
    _gathered: BucketGather | None = None  # during a sharded push, once its plan is announced
    _declared: dict[str, Any] = {}  # during a push: SyncClient.open's skip / adapter (transports' _open pass it on)

    def __init__(self, base_url: str, *, auth_token: str | None = None, timeout_s: float = 300.0,
                 client_id: str | None = None, connect_timeout_s: float = 10.0) -> None:
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self.control = SyncClient(base_url, auth_token=auth_token, timeout_s=timeout_s, client_id=client_id,
                                  connect_timeout_s=connect_timeout_s)
        self._slow_drains = 0  # fences that drained re-run batches for longer than SLOW_DRAIN_S

    def close(self) -> None:
        self.control.close()

    def __enter__(self) -> PushSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def health(self):
        """``GET /health`` of the server this sender pushes to."""
        return self.control.health()

    # -------------------------------------------------------------- transport hooks

    def _open(self, bucket_bytes: int, named: list[tuple[str, torch.Tensor]], deadline: float,
              weight_load: str | None) -> SyncSession:
        return self.control.open(bucket_bytes, **self._declared)

    def _prepare(self, session: SyncSession, planned: list[tuple[str, torch.Tensor]], dtypes: dict[str, str],
                 bucket_bytes: int) -> Any:
        return None

    @abc.abstractmethod
    def _send(self, session: SyncSession, planned: list[tuple[str, torch.Tensor]], prepared: Any,
              bucket_bytes: int, deadline: float) -> Sent:
        """Move every planned tensor to the server inside the fence; raise SyncError on failure."""

    def _failed(self, exc: BaseException) -> None:
        """A push failed after open (before the abort is sent): drop transport state that may be broken."""

    def _bucket(self, k: int, idx: list[int], planned: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Bucket ``k``'s tensors (``planned`` indices ``idx``, the shared cut): the planned tensors themselves, or,
        in a sharded push, gathered now on every rank (in the serving dtype). Transports ask in bucket order."""
        if self._gathered is None:
            return [planned[i][1] for i in idx]
        return self._gathered.get(k, idx)

    def _device(self, named: list[tuple[str, torch.Tensor]]) -> torch.device:
        """Where this push's bytes are staged: :attr:`transfer_device` if set, else the weights' GPU if any."""
        if self._sharded is not None:
            return self._sharded.device
        if self.transfer_device is not None:
            return self.transfer_device
        return next((t.device for _, t in named if t.is_cuda), torch.device("cpu"))

    # -------------------------------------------------------------- the protocol

    def push(self, named_tensors: Named, bucket_bytes: int = 512 << 20, fence: str = "drain",
             min_ver: int | None = None, *, on_phase: Callable[[str], None] | None = None,
             weight_load: str | None = None, skip: Iterable[str] = (),
             adapter: AdapterPush | None = None) -> SyncReport:
        """Send the served weights and commit (module docstring). Raises :class:`SyncError`; the server then
        keeps its old weights and ver.

        ``named_tensors``: the complete served model (merged, for an adapter run): what the fingerprint covers.
        ``skip``: served names frozen for the whole run (equal to the checkpoint the server loaded); those the
        server accepts are not sent. ``adapter``: an adapter session (the adapter's tensors travel instead of its
        layers' merged weights); sharded, its tensors must be the ``extra`` of the ``ShardedWeights``.
        ``min_ver``: the lowest ver the commit may produce (``SyncCommitRequest.min_ver``). ``on_phase(name)``
        is called after ``begin`` (tests use it to freeze the server mid-sync); ``weight_load`` overrides the
        server's NCCL load path for this push (``fast`` | ``native``: benchmarks).
        """
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        sharded = named_tensors if isinstance(named_tensors, ShardedWeights) else None
        named = list(named_tensors)
        self._sharded, self._gathered = sharded, None
        if sharded is not None and adapter is not None and {id(t) for _, t in adapter.tensors} - {
                id(t) for _, t in sharded.extra}:
            self._end_sharded()  # empty plans: the other ranks move on
            raise SyncError("plan", "a sharded adapter push needs the adapter's tensors as ShardedWeights.extra "
                            "(the gather plan indexes them)")
        self._declared = {"skip": sorted(skip), "adapter": adapter.spec if adapter is not None else None}
        try:
            session = self._open(bucket_bytes, named, deadline, weight_load)
        except BaseException:
            self._end_sharded()  # announces "nothing to gather" to the other ranks
            raise
        finally:
            self._declared = {}
        try:
            planned = plan(session.info, named)
            dtypes = session_dtypes(session.info)
            # of the complete served model as the server will hold it; sharded: sampled from the gathered tensors
            fp = W.fingerprint(planned, dtypes) if sharded is None else None
            sending = select(session.info, planned, adapter)
            sent_names = {n for n, _ in sending}
            unsent = [(n, t) for n, t in planned if n not in sent_names]
            skipped_bytes = sum(t.numel() * W.torch_dtype(dtypes[n]).itemsize for n, t in unsent)
            if session.info.skip_refused:
                log.info("%s sends frozen parameters in full: %s", self.base_url, session.info.skip_refused)
            prepared = self._prepare(session, sending, dtypes, bucket_bytes)
            running = self._sample_unsent(sharded, unsent, dtypes, set(skip)) if sharded is not None else None
            t1 = time.monotonic()
            begun = session.begin(fence)
            t2 = time.monotonic()
            if on_phase is not None:
                on_phase("begun")
            if sharded is not None:  # the plan, to every rank
                self._gathered = BucketGather(sharded, sending, dtypes, bucket_bytes, running,
                                              served={n for n, _ in planned})
            sent = self._send(session, sending, prepared, bucket_bytes, deadline)
            if self._gathered is not None:
                fp = self._gathered.fingerprint.hexdigest()
            t3 = time.monotonic()
            done = session.commit(fp, min_ver)
            t4 = time.monotonic()
        except BaseException as exc:
            self._failed(exc)
            try:
                session.abort(f"learner push failed: {type(exc).__name__}: {exc}"[:500])
            except Exception as abort_exc:  # noqa: BLE001 - the server's idle timeout is the backstop
                log.warning("could not abort sync session %s: %s", session.id, abort_exc)
            raise
        finally:
            self._end_sharded()  # after the abort: the fence reopens first, then the remaining gathers run
        if done.fingerprint != fp:  # the server compared too; this catches a server that did not
            raise SyncError("commit", f"server fingerprint {done.fingerprint} != learner {fp}")
        report = SyncReport(ver=done.ver, fence_s=t2 - t1, wire_s=t3 - t2, commit_s=t4 - t3, total_s=t4 - t0,
                            bytes=sent.bytes, n_buckets=sent.n_buckets, fingerprint=done.fingerprint,
                            ver_before=begun.ver_before, drained=begun.drained, aborted=begun.aborted,
                            spared=begun.spared, server_update_s=sent.server_update_s, server_load=sent.server_load,
                            skipped_bytes=skipped_bytes, n_skipped=len(unsent))
        log.info("weights synced to %s over %s%s: ver %d, %d bucket(s), %.1f MB (%.1f MB of %d served tensor(s) not "
                 "sent: %s), fence %.3fs wire %.3fs (%.2f GB/s) commit %.3fs, fingerprint %s", self.base_url,
                 self.transport, f" ({adapter.spec.type} adapter)" if adapter is not None else "", report.ver,
                 report.n_buckets, report.bytes / 1e6, skipped_bytes / 1e6, len(unsent),
                 "frozen or merged on the server" if adapter is not None else "frozen", report.fence_s,
                 report.wire_s, report.bytes / max(report.wire_s, 1e-9) / 1e9, report.commit_s, report.fingerprint)
        self._note_slow_drain(report)
        return report

    def _note_slow_drain(self, report: SyncReport) -> None:
        """A fence that drained re-run batches for long says why and which knob fixes it (warning once, then info)."""
        if not report.spared or report.fence_s <= SLOW_DRAIN_S:
            return
        (log.info if self._slow_drains else log.warning)(
            "the abort fence of %s waited %.1fs to drain %d re-run batch(es) an earlier fence had cut (a batch is cut "
            "once: rollout_server/fence.py MAX_CUTS); no rollout was admitted meanwhile. Rollouts this long outlast "
            "the time between syncs: raise weight_sync.every_steps so a sync comes less often than a rollout of "
            "max_new_tokens takes, or lower rollout_matching.decoding.max_new_tokens", self.base_url, report.fence_s,
            report.spared)
        self._slow_drains += 1

    @staticmethod
    def _sample_unsent(sharded: ShardedWeights, unsent: list[tuple[str, torch.Tensor]], dtypes: dict[str, str],
                       frozen: set[str]) -> RunningFingerprint:
        """Sharded push, before the fence: the fingerprint's samples of the served tensors that do not travel.
        A frozen one (``frozen``: the declared skip names) comes from ``sharded.samples`` once rank 0 holds it,
        else it is gathered aside on every rank (learner/weight_sync/sharded.py) and, if frozen, kept."""
        running = RunningFingerprint()
        aside = []
        for name, t in unsent:
            part = sharded.samples.get((name, dtypes[name])) if name in frozen else None
            if part is None:
                aside.append((name, t))
            else:
                running.put(name, part)
        sharded.announce_aside(aside, dtypes)
        for (name, _), full in zip(aside, sharded.gather_aside(), strict=True):
            head, sample = running.add(name, full)
            if name in frozen:
                sharded.samples[(name, dtypes[name])] = (head, sample.cpu().clone())
        return running

    def _end_sharded(self) -> None:
        """Sharded push: drive the gathers the transport did not (the other ranks are in them), then forget it."""
        sharded, self._sharded, self._gathered = self._sharded, None, None
        if sharded is not None:
            sharded.finish()
