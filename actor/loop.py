"""The actor main loop: Channel-B samples for one learner rank, from rollout to pack on the wire.

Data flow (one process, one main thread + ``max_inflight_batches`` HTTP threads)::

    SampleStream (shard of rank r, own seed) ──► retry deque (server down / stale) ──┐
                                                                                     │ admission: credits allow it
                                                                                     ▼
    rollout threads: Pipeline.rollout_batch ── POST /infer (decode batch, min_ver) ──► rollout server
                                                                                     │ Rollout(ver)
    main thread:     Pipeline.build_segments (parse → match → target → encode)       ▼
                       │ ver < ver_current - version_window → stale-dropped (sample requeued)
                       ▼
                     Packer (version-pure; flush/drop old ver on a server ver advance)
                       ▼
                     outbox ── credit gate: outstanding < share ──► PackSender (PUSH) ──► learner rank r
                                                                          CreditSubscriber (SUB) ◄── credits

Each wait and what unblocks it:
  - start: first credits, deadline ``actor.learner_wait_timeout_s``  ← the learner rank starts publishing;
    on timeout the actor exits (code 3) naming the endpoint and the learner command.
  - tick (≤ 50 ms): a rollout future completing ← the server answering /infer.
  - admission: ``outstanding + whole packs the started work fills < share`` ← credits reporting
    consumption (an actor may run one decode batch past its share; it never strands a pack it could fill).
  - outbox: ``outstanding < share`` and fresh credits ← the learner consuming / publishing.
  - send: ``PackSender.send`` deadline ``actor.send_timeout_s`` ← the learner's PULL accepting; on
    timeout the pack stays in the outbox (retried, or dropped and counted once stale).
  - server down: back-off doubling up to ``actor.server_backoff_max_s`` ← the server answering again.
  - learner silent for ``actor.learner_silence_s``: generation pauses; after ``learner_wait_timeout_s``
    more, exit (code 3) with the message.
  - learner done (its last credits say ``done``): exit 0 at once; rollouts in flight are abandoned and
    unsent packs counted in ``actor/dropped_at_stop`` (nothing would train them).
  - stop (SIGTERM/SIGINT, or ``actor.max_samples`` taken): in-flight rollouts finish, the packer
    flushes, the outbox drains under credits until the rank acknowledged everything, all within
    ``actor.stop_timeout_s``; leftovers are counted in ``actor/dropped_at_stop``.

Everything right of the packer that faces the learner rank (credit waits, the outbox, sends, the
sent-pack ledger) is :class:`actor.learner_link.LearnerLink`; this loop decides when to poll, admit,
collect, pack and send.

Conservation (checked in every metrics record, ``actor/conservation_ok``)::

    segments_built = packed (sent + outbox) + flushed_dropped + too_long_dropped + stale_dropped
                     + buffered + dropped_at_stop

What this module does not know: how packs are trained, or how the server generates.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from actor.client import RolloutRequestError, RolloutUnavailable
from actor.credits import CreditGate
from actor.learner_link import LearnerLink
from actor.pipeline import BatchMetrics, Pipeline, Sample
from actor.stream import SampleStream
from common.runs.checkpoints import read_b_ledger, resolve_resume_checkpoint
from common.data.check import BadRecords
from common.packing.packer import Packer
from common.packing.segment import Pack, Segment
from common.wire.transport import CreditSubscriber, PackSender

log = logging.getLogger(__name__)

TICK_S = 0.05
MAX_SAMPLE_FAILURES = 5  # a sample the (reachable) server fails on this often is dropped, counted
EXIT_OK, EXIT_CONFIG, EXIT_NO_LEARNER = 0, 2, 3


class ActorLoop:
    """One actor: ``run()`` until stopped; every dependency may be injected (tests, in-process wiring)."""

    def __init__(self, cfg: Any, rank: int, index: int = 0, *, encoder: Any = None, client: Any = None,
                 sender: PackSender | None = None, subscriber: CreditSubscriber | None = None,
                 config_path: str | None = None) -> None:
        self.cfg, self.rank, self.index = cfg, rank, index
        self.config_path = config_path or "CONFIG"
        self.actor_id = f"actor-r{rank}-{index}"
        a = cfg.actor
        if encoder is None:
            from common.packing.encode import encoder_from_config

            encoder = encoder_from_config(cfg)
        if client is None:
            from actor.client import RolloutClient

            client = RolloutClient.from_config(cfg, client_id=self.actor_id, config_path=self.config_path)
        self.encoder, self.client = encoder, client
        self.pipeline = Pipeline(cfg, encoder)
        self.gate = CreditGate(self.actor_id, index, a.num_actors_per_rank, lost_pack_timeout_s=a.lost_pack_timeout_s)
        self.packer = Packer(cfg.training.global_max_length, cfg.training.packing_min_fill_ratio, cfg.training.pack_max_wait_s)
        ckpt = resolve_resume_checkpoint(cfg.training.resume, cfg.training.output_dir)
        trained = read_b_ledger(ckpt, rank)
        world = cfg.derived.world_size if cfg.derived is not None else cfg.learner.nproc_per_node
        self.stream = SampleStream(cfg.data.train_jsonl, rank=rank, world_size=world, index=index,
                                   num_actors_per_rank=a.num_actors_per_rank, seed=cfg.training.seed, skip_keys=trained)
        out = Path(cfg.training.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.metrics_path = out / f"actor_rank{rank}_{index}.jsonl"
        self._metrics_f = self.metrics_path.open("a", encoding="utf-8")
        self.c = collections.Counter()  # cumulative actor/* counters
        self.bad_records = BadRecords(cfg.data.on_bad_record, str(self.stream.path))
        self.link = LearnerLink(cfg, rank, index, self.actor_id, self.gate, self.c,
                                ledger_path=out / f"actor_rank{rank}_{index}.ledger.jsonl", log_record=self._log,
                                config_path=self.config_path, sender=sender, subscriber=subscriber)
        if trained:
            log.info("%s: resuming from %s, skipping %d trained B samples", self.actor_id, ckpt, len(trained))

        self._iter = iter(self.stream)
        self._retry: collections.deque[Sample] = collections.deque()
        self._failures: collections.Counter[str] = collections.Counter()  # failed rollouts per sample key
        self._pool = cf.ThreadPoolExecutor(max_workers=a.max_inflight_batches, thread_name_prefix=f"{self.actor_id}-infer")
        self._inflight: dict[cf.Future, list[Sample]] = {}
        self.abandoned_inflight = False  # set when the learner said done with rollouts still in flight
        self._stop = threading.Event()
        self._taken = 0
        self._backoff_s, self._backoff_until = 0.0, 0.0
        self._window = BatchMetrics()
        self._window_packs: list[float] = []
        self._window_times = collections.Counter()

    # ------------------------------------------------------------------------------------------ run

    def request_stop(self, *_: Any) -> None:
        self._stop.set()

    def run(self) -> int:
        """Until stopped (signal, ``request_stop`` or ``actor.max_samples``): 0; 2 if a rollout server resizes images
        otherwise than this actor's encoder (data.min_pixels / data.max_pixels); 3 if the learner never came."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, self.request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            if not self.link.wait_first(self._stop):
                return EXIT_NO_LEARNER if not self._stop.is_set() else EXIT_OK
            log.info("%s: learner rank %d is there (%s); share %d packs", self.actor_id, self.rank,
                     self.link.subscriber.endpoint, self.gate.share)
            check = getattr(self.client, "image_pixels_mismatch", None)  # an injected stand-in may not have it
            why = check(getattr(self.encoder, "image_pixels", None)) if check is not None else None
            if why:
                log.error("%s: %s", self.actor_id, why)
                return EXIT_CONFIG
            self.stream.skip_keys |= self.link.rejoin_skip  # a restarted actor: what the rank already holds
            next_metrics = time.monotonic() + self.cfg.actor.metrics_every_s
            while not self._stop.is_set():
                tick = time.perf_counter()
                if not self.link.poll():
                    return EXIT_NO_LEARNER
                if self.link.done:
                    return self._stop_on_done()
                idle = not self._inflight
                self._collect(timeout_s=TICK_S)
                self._to_outbox(self.packer.pop_ready())
                self._send()
                if not self._admit() and idle:  # nothing to do but wait for the learner to consume
                    self._window_times["time/wait_credit"] += time.perf_counter() - tick
                if self._exhausted() and not self._inflight:
                    break
                if time.monotonic() >= next_metrics:
                    self._write_metrics()
                    next_metrics = time.monotonic() + self.cfg.actor.metrics_every_s
            self._drain()
            return EXIT_OK
        finally:
            self._write_metrics(final=True)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self.link.close()
            self._metrics_f.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    # ---------------------------------------------------------------------------------- admission

    def _exhausted(self) -> bool:
        m = self.cfg.actor.max_samples
        return m is not None and self._taken >= m and not self._retry

    def _packs_started(self) -> int:
        """Whole packs that the work already started (in the outbox, the packer, and in flight) will fill.

        Counted in packs that reach the packer's release fill, from tokens: a sample in flight is
        taken at the mean segment length seen so far (before any: one whole pack, so the first batch
        alone holds admission back until its lengths are known). Why whole packs: a pack that work
        already started cannot fill is a pack that would leave only at ``pack_max_wait_s``,
        underfilled; counting its fraction against the share (as an earlier rule did) stopped an
        actor with a share of 1 from ever filling one (on the GPU 2 + 2 run: B packs at mean fill
        0.43, each waiting the 2 s timeout).
        """
        pc, packer = self.packer.counters, self.packer
        buffered = packer.buffered_tokens
        seen = pc["segments_packed"] + packer.buffered
        per_sample = (pc["tokens_packed"] + buffered) / seen if seen else packer.release_tokens
        inflight = sum(len(s) for s in self._inflight.values())
        started = buffered + inflight * per_sample
        return len(self.link.outbox) + int(started // packer.release_tokens)

    def _admit(self) -> bool:
        """Start rollout batches while credits allow; False if credits (not back-off or the cap) held one back.

        Rule: start another batch while ``outstanding + packs the started work fills < share``, so an
        actor runs at most one decode batch past its share, and never leaves a pack it could fill
        waiting for the timeout (:meth:`_packs_started`).
        """
        batch = self.cfg.stage2_ab.channel_b.rollout_decode_batch_size
        while (len(self._inflight) < self.cfg.actor.max_inflight_batches and not self._stop.is_set()
               and time.monotonic() >= self._backoff_until and self.link.fresh()):
            idle = not self._inflight and not self.link.outbox and self.packer.buffered == 0 and self.gate.outstanding == 0
            if not idle and self.gate.outstanding + self._packs_started() >= self.gate.share:
                self.c["credit_waits"] += 1
                return False
            samples = self._take(batch)
            if not samples:
                return True
            stale_below = self.gate.stale_below()
            future = self._pool.submit(self._rollout, samples, stale_below)
            self._inflight[future] = samples
        return True

    def _take(self, n: int) -> list[Sample]:
        out: list[Sample] = []
        while len(out) < n and self._retry:
            out.append(self._retry.popleft())
        while len(out) < n and not self._exhausted():
            item = next(self._iter)
            self._taken += 1
            try:
                out.append(self.pipeline.sample(item.key, item.record, where=f"{self.stream.path.name}:{item.line + 1}"))
            except (ValueError, OSError) as exc:
                self.c["bad_records"] += 1
                self.bad_records.handle(exc)  # data.on_bad_record: fail raises (the actor exits naming the record)
        return out

    def _rollout(self, samples: list[Sample], min_ver: int | None) -> tuple[list[Any], float]:
        """Worker thread: one /infer call; ``min_ver`` = the lowest ver that would not arrive stale."""
        min_ver = None if min_ver is None or min_ver <= 0 else min_ver
        t0 = time.perf_counter()
        rollouts = self.pipeline.rollout_batch(samples, self.client, ver_hint=min_ver, client_id=self.actor_id)
        return rollouts, time.perf_counter() - t0

    # --------------------------------------------------------------------------------- collection

    def _collect(self, timeout_s: float) -> None:
        if not self._inflight:
            time.sleep(timeout_s)
            return
        done, _ = cf.wait(list(self._inflight), timeout=timeout_s, return_when=cf.FIRST_COMPLETED)
        for future in done:
            samples = self._inflight.pop(future)
            try:
                rollouts, elapsed = future.result()
            except RolloutRequestError as exc:  # the server refused the request itself (4xx): retrying cannot help
                self._request_refused(samples, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - the server being down must never stop the actor
                self._server_failed(samples, exc)
                continue
            self._backoff_s = 0.0
            self._window_times["time/rollout"] += elapsed
            segments, metrics = self.pipeline.build_segments(samples, rollouts)
            self._window.add(metrics)
            self.c["samples_done"] += len(samples)
            self.c["segments_built"] += int(metrics.counts["rollout/segments"] + metrics.counts["rollout/too_long_dropped"])
            self.c["too_long_dropped"] += int(metrics.counts["rollout/too_long_dropped"])
            self.c["errors"] += int(metrics.counts["rollout/errors"])
            by_key = {s.key: s for s in samples}
            for segment in segments:
                self._to_packer(segment, by_key[segment.sample_id])

    def _server_failed(self, samples: list[Sample], exc: BaseException) -> None:
        self.c["server_errors"] += 1
        if not isinstance(exc, RolloutUnavailable):  # the server answered but failed on these samples
            for s in samples:
                self._failures[s.key] += 1
            poison = [s for s in samples if self._failures[s.key] > MAX_SAMPLE_FAILURES]
            for s in poison:
                self.c["rejected_samples"] += 1
                log.error("%s: sample %s dropped after %d failed rollouts (last: %s)", self.actor_id, s.key,
                          MAX_SAMPLE_FAILURES, exc)
            samples = [s for s in samples if s not in poison]
        self._retry.extendleft(reversed(samples))
        cap = self.cfg.actor.server_backoff_max_s
        self._backoff_s = min(cap, max(0.5, 2 * self._backoff_s))
        self._backoff_until = time.monotonic() + self._backoff_s
        log.warning("%s: rollout of %d samples failed (%s: %s); retrying in %.1fs (server %s; start it with "
                    "`python -m rollout_server --config CONFIG`)", self.actor_id, len(samples), type(exc).__name__, exc,
                    self._backoff_s, ", ".join(s.base_url for s in self.cfg.rollout_matching.vllm.servers))

    def _request_refused(self, samples: list[Sample], exc: BaseException) -> None:
        if len(samples) > 1:  # find the culprit: every sample on its own (already admitted, so no credit check)
            for sample in samples:
                self._inflight[self._pool.submit(self._rollout, [sample], self.gate.stale_below())] = [sample]
            return
        self.c["rejected_samples"] += 1
        log.error("%s: sample %s dropped, the rollout server refused it: %s", self.actor_id, samples[0].key, exc)

    def _to_packer(self, segment: Segment, sample: Sample) -> None:
        if self.link.is_stale(segment.ver):
            self.c["stale_dropped"] += 1
            self._retry.append(sample)  # roll it out again under current weights
            return
        if self.packer.ver is None or segment.ver > self.packer.ver:
            dropped_before = self.packer.counters["flushed_dropped"]
            self._to_outbox(self.packer.advance_ver(segment.ver, self.cfg.actor.flush_policy))
            self.c["ver_advances"] += 1
            if self.packer.counters["flushed_dropped"] > dropped_before:
                log.info("%s: ver %d: dropped %d old-ver segments (actor.flush_policy=drop)", self.actor_id, segment.ver,
                         self.packer.counters["flushed_dropped"] - dropped_before)
        if self.packer.add(segment):
            self.link.samples[segment.sample_id] = sample

    def _to_outbox(self, packs: list[Pack]) -> None:
        for pack in packs:
            self.link.outbox.append(pack)
            self._window_packs.append(pack.n_tokens / self.packer.packing_length)

    # ------------------------------------------------------------------------------------ sending

    def _send(self) -> None:
        spent = self.link.send(requeue=self._retry.extend)
        if spent is not None:
            self._window_times["time/send"] += spent

    # ---------------------------------------------------------------------------------------- stop

    def _drain(self) -> None:
        """Finish in-flight rollouts, flush the packer, send what credits allow until acknowledged."""
        deadline = time.monotonic() + self.cfg.actor.stop_timeout_s
        log.info("%s: stopping (%d rollout batches in flight, %d buffered, %d packs in the outbox)",
                 self.actor_id, len(self._inflight), self.packer.buffered, len(self.link.outbox))
        while self._inflight and time.monotonic() < deadline and not self.link.done:
            self.link.poll()
            self._collect(timeout_s=TICK_S)
            self._send()
        self._to_outbox(self.packer.flush_all())
        while (self.link.outbox or self.gate.in_transit) and time.monotonic() < deadline and not self.link.done:
            self.link.poll()
            self._send()
            time.sleep(TICK_S)
        self.link.drop_unsent()

    def _stop_on_done(self) -> int:
        """The learner finished: nothing sent from now on would be trained, so stop without draining."""
        for future in self._inflight:
            future.cancel()
        self._to_outbox(self.packer.flush_all())
        log.info("%s: exiting: %d rollout batches in flight abandoned, %d packs unsent", self.actor_id,
                 len(self._inflight), len(self.link.outbox))
        self.abandoned_inflight = bool(self._inflight)  # actor/__main__.py then exits without joining their threads
        self._inflight.clear()
        self.link.drop_unsent()
        return EXIT_OK

    # ------------------------------------------------------------------------------------- metrics

    def counters(self) -> dict[str, int]:
        """Cumulative ``actor/*`` counters including the conservation identity of the module docstring."""
        pc = self.packer.counters
        outbox = self.link.outbox_segments()
        too_long = self.c["too_long_dropped"] + int(pc["too_long_dropped"])
        out = {
            "actor/samples_taken": self._taken,
            "actor/samples_done": self.c["samples_done"],
            "actor/segments_built": self.c["segments_built"],
            "actor/segments_sent": self.c["segments_sent"],
            "actor/segments_outbox": outbox,
            "actor/flushed_dropped": int(pc["flushed_dropped"]),
            "actor/too_long_dropped": too_long,
            "actor/stale_dropped": self.c["stale_dropped"],
            "actor/buffered": self.packer.buffered,
            "actor/dropped_at_stop": self.c["dropped_at_stop"],
            "actor/packs_sent": self.c["packs_sent"],
            "actor/tokens_sent": self.c["tokens_sent"],
            "actor/underfilled_packs": int(pc["underfilled_packs"]),
            "actor/flushed_packs": int(pc["flushed_packs"]),
            # empty room of the packs built, by why they left (common/packing/packer.py): min fill, max wait, ver flush
            "actor/fill_lost_ready_tokens": int(pc["fill_lost_ready_tokens"]),
            "actor/fill_lost_wait_tokens": int(pc["fill_lost_wait_tokens"]),
            "actor/fill_lost_flush_tokens": int(pc["fill_lost_flush_tokens"]),
            "actor/server_errors": self.c["server_errors"],
            "actor/errors": self.c["errors"],
            "actor/bad_records": self.c["bad_records"],
            "actor/rejected_samples": self.c["rejected_samples"],
            "actor/send_timeouts": self.c["send_timeouts"],
            "actor/credit_waits": self.c["credit_waits"],
            "actor/lost_packs": self.gate.lost_packs,
            "actor/learner_restarts": self.gate.restarts,
            "actor/prompt_mismatch": self.encoder.counters.get("prompt_mismatch", 0) if hasattr(self.encoder, "counters") else 0,
            "actor/resume_skipped": self.stream.skipped,
            "actor/rejoins": self.c["rejoins"],
        }
        rhs = (out["actor/segments_sent"] + outbox + out["actor/flushed_dropped"] + too_long + out["actor/stale_dropped"]
               + out["actor/buffered"] + out["actor/dropped_at_stop"])
        out["actor/conservation_ok"] = int(out["actor/segments_built"] == rhs)
        return out

    def _write_metrics(self, final: bool = False) -> None:
        record: dict[str, Any] = {"event": "final" if final else "metrics", "actor": self.actor_id, "rank": self.rank,
                                  "index": self.index, "ts": time.time()}
        record.update(self._window.summary())
        record.update(self._window_times)
        fills = self._window_packs
        record["packing/fill"] = sum(fills) / len(fills) if fills else 0.0
        record["packing/packs"] = len(fills)
        record["packing/fill_mean_total"] = self.packer.mean_fill
        record.update({f"packing/fill_lost_{r}": v for r, v in self.packer.fill_lost().items()})  # + mean = 1
        record.update(self.counters())
        credits = self.gate.credits
        record.update({"credits/ver_current": credits.ver_current if credits else -1, "credits/share": self.gate.share,
                       "credits/outstanding": self.gate.outstanding, "credits/in_transit": self.gate.in_transit})
        if not record["actor/conservation_ok"]:
            log.error("%s: actor conservation broken: %s", self.actor_id, self.counters())
        self._log(record)
        self._window, self._window_packs, self._window_times = BatchMetrics(), [], collections.Counter()

    def _log(self, record: dict[str, Any]) -> None:
        self._metrics_f.write(json.dumps(record) + "\n")
        self._metrics_f.flush()
