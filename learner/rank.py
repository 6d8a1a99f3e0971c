"""One learner rank's training machinery: what every Channel-B mode's loop is made of.

:class:`Learner` wires the parts of one rank — the model, the optimizer update (``learner/optimizer_step.py``),
Channel-A data, the B packs' intake (``learner/pack_intake.py``), weight sync, the run's counters
(``learner/run_counters.py``), the time budget (``learner/time_budget.py``), metrics and checkpoints
(``learner/checkpointer.py``) — and holds the pieces of one optimizer step. The loops that put the pieces
in order are elsewhere: the async loop in ``learner/train.py`` (its docstring has the wait diagram of a step)
and the one-process ``step``/``micro`` loops in ``learner/modes.py``. A loop opens one ``StepRecord``
(``learner/step_record.py``) per step and hands it to the pieces, in the async mode's order::

    maybe_sync ─► (B: the decision's packs | A: take_a_window) ─► step_inputs (inputs + global_normaliser)
      ─► forward_backward × GA (gradients all-reduced on the last) ─► finish_step
           (optimizer update, counters, the gathered metrics line, final push, checkpoint when due)

Each piece times itself into the record's ``RankStats`` (``time/*`` in docs/metrics.md); what no piece
times (bookkeeping between them, the loss check) is the record's ``time/other``.

The pieces that hold a collective (maybe_sync, global_normaliser, finish_step, settle_sync, save) must
be called on every rank in the same order: a rank that skipped one would leave its peers waiting
until ``learner.collective_timeout_s``.

What this module does not know: the order of a step (the loops decide it), sockets beyond
constructing them, or how actors produce packs.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from common.packing.schedule import exact_ratio
from learner import parallel
from learner.checkpointer import Checkpointer, TrainerState
from learner.data import ChannelAData
from learner.device_time import DeviceSpans
from learner.distributed import Dist
from learner.evaluation import PeriodicEval
from learner.loss import LossWeights, Normaliser
from learner.metrics import MetricsWriter, gather_metrics_line
from learner.model import PackInputs, forward_loss, load_policy, pack_inputs, resolve_dtype
from learner.optimizer_step import OptimizerStep
from learner.prefetch import AWindow, ChannelAPrefetcher
from learner.run_record import config_dict
from learner.pack_intake import Intake, admission_limits, open_intake
from learner.pack_queue import ReadyQueue
from learner.recipe import restore_adapter
from learner.run_counters import RunCounters
from learner.step_record import RankStats, RunFacts, StepRecord
from learner.weight_sync.boundary import WeightSync
from learner.throughput import Throughput
from learner.time_budget import TimeBudget

log = logging.getLogger(__name__)


class Learner:
    """Model, optimizer, Channel-A data, weight sync, metrics and checkpoints of one rank."""

    def __init__(self, cfg: Any, dist: Dist) -> None:
        self.cfg, self.dist = cfg, dist
        self.ga = cfg.derived.gradient_accumulation_steps
        self.b_ratio = exact_ratio(cfg.stage2_ab.schedule.b_ratio)
        self.packing_length = cfg.derived.packing_length
        self.out = Path(cfg.training.output_dir)
        self.run_id: str | None = None  # the output_dir's run (run_info.json), read in setup()
        self.step = 0
        self.ver = 0
        self.budget = TimeBudget(cfg.training.max_train_seconds, dist)
        self._final_push_failed = False
        self.counters = RunCounters()  # steps by kind, updates, skips, forwards, the realized B ratio
        self.b_trained: set[str] = set()  # the B-sample ledger (shared with the ready queue in async mode)
        self.queue: ReadyQueue | None = None
        self.a_windows: ChannelAPrefetcher | None = None
        self._intake: Intake | None = None  # async mode: the pack and credit sockets (open_queue)
        self._trace = None
        self.fb_spans = DeviceSpans(dist.device)  # forward/backward on the GPU: time/forward_backward_gpu
        self.sync = WeightSync(cfg, dist, progress=lambda: self.step)
        self._carry_sync: dict[str, Any] = {}  # a push outcome adopted at a checkpoint: reported with the next step
        ab = cfg.stage2_ab
        # Channel-B packs never get the Stage-1 coord CE (stage2_ab.coord_ce_weight; learner/loss.py).
        self.loss_weights = {
            "A": LossWeights(ab.bbox_smoothl1_weight, ab.bbox_ciou_weight, ab.coord_temperature, ab.coord_ce_weight),
            "B": LossWeights(ab.bbox_smoothl1_weight, ab.bbox_ciou_weight, ab.coord_temperature),
        }

    # -- setup ----------------------------------------------------------------------------------

    def open_queue(self) -> None:
        """Bind this rank's pack PULL and credit PUB first, so actors can connect while the model loads."""
        self._intake = open_intake(self.cfg, self.dist.rank, self.packing_length, self.b_trained)
        self.queue = self._intake.queue

    def setup(self) -> None:
        cfg, dist = self.cfg, self.dist
        from common.runs.checkpoints import run_id_of

        torch.manual_seed(cfg.training.seed)
        self.run_id = run_id_of(self.out)  # rank 0 wrote it before any rank got here (learner/main.py)
        self.checkpoints = Checkpointer(cfg, dist, self.out)
        resume_from = self.checkpoints.resume_from
        # A sharded (fsdp) checkpoint has no model/ directory: load model.path, checkpoint.load restores the weights.
        hf_dir = None if resume_from is None else resume_from / "model"
        model_cfg = replace(cfg.model, path=str(hf_dir)) if hf_dir is not None and hf_dir.is_dir() else cfg.model
        model, tokenizer, coord_ids = load_policy(model_cfg, dist.device, cfg.training.gradient_checkpointing,
                                                  load_device=parallel.load_device(cfg.learner, dist.device),
                                                  compile=cfg.training.compile,
                                                  checkpoint_every=cfg.training.gradient_checkpointing_every)
        restore_adapter(model, resume_from, cfg.model)
        self.tokenizer, self.coord_ids = tokenizer, torch.tensor(coord_ids, device=dist.device)
        self.calls = {"forward": 0, "backward": 0}  # measured by hooks, not assumed (metrics + trace)
        model.register_forward_pre_hook(lambda *_: self.calls.__setitem__("forward", self.calls["forward"] + 1))
        self.dtype = resolve_dtype(cfg.model.dtype, dist.device)
        self.hf_model = model  # under fsdp the same module, sharded in place
        # MFU's inputs, counted before fsdp shards the parameters; the peak measured on rank 0's device
        self.throughput = Throughput.of(model, dist.device, self.dtype, dist.world_size, cfg.training.peak_tflops) \
            if dist.is_main else None
        self.model = parallel.wrap(model, cfg.learner, dist.device, dist.world_size, dist.local_rank)
        dist.initialized |= torch.distributed.is_initialized()  # a one-rank fsdp group: Dist.close tears it down
        self.optimizer_step = OptimizerStep(self.model, cfg.training, dist)  # after wrap: fsdp's shards
        from common.packing.encode import encoder_from_config

        self.encoder = encoder_from_config(cfg)  # the training thread's (one-process modes' B pipeline, bench)
        if self.queue is not None:  # what a legal pack of this model holds; refused here if over the frame cap
            self.queue.limits = admission_limits(model, self.encoder, cfg.transport, self.packing_length)
        # Channel-A gets its own Encoder: its prefetch thread runs it, and an Encoder is not thread-safe.
        self.data_a = ChannelAData(cfg, encoder_from_config(cfg), rank=dist.rank, world_size=dist.world_size, ga=self.ga)
        self._resume()
        # Half the collective deadline: a rank whose window is stuck fails, naming the cause, before its
        # peers (already waiting in the step's first all_reduce) time out with a less telling message.
        self.a_windows = ChannelAPrefetcher(
            self.data_a, rank=dist.rank, deadline_s=cfg.learner.collective_timeout_s / 2,
            what=f"{self.ga} packs of {self.packing_length} tokens from {cfg.data.train_jsonl}",
            deadline_from="half of learner.collective_timeout_s",
        )
        self.a_windows.start()  # from here on its thread owns data_a; the first window builds during the first sync
        if cfg.training.trace_micro_steps:
            self.out.mkdir(parents=True, exist_ok=True)
            self._trace = (self.out / f"trace_rank{dist.rank}.jsonl").open("a", encoding="utf-8")
        self.writer = MetricsWriter(
            self.out, enabled=dist.is_main, progress=cfg.training.progress, start_step=self.step,
            max_steps=cfg.training.max_steps, run_id=self.run_id, report_to=cfg.training.report_to,
            run_name=cfg.run_name, config=config_dict(cfg),  # without secrets: trackers may upload it
        )
        self.evals = PeriodicEval(cfg, is_main=dist.is_main, write=self.writer.write_eval)
        self._eval_due = True  # the first push (start-up sync) is evaluated: the quality training starts from

    def _resume(self) -> None:
        opt = self.optimizer_step
        restored = self.checkpoints.load(model=self.model, optimizer=opt.optimizer, scheduler=opt.scheduler)
        if restored is None:
            return
        state = restored.state
        self.step, self.ver = int(state.global_step), int(state.ver)
        self.counters.restore(state.totals, state.recent_kinds_b, state.realized_total_steps, state.realized_total_b)
        self.sync.counts.update(state.sync_counts)
        self.data_a.load_state_dict(restored.data_a, self.ver)
        self.b_trained.update(restored.ledger)
        if self.queue is not None:
            self.queue.counters.update(restored.queue)
            self.queue.set_ver(self.ver)
        log.info("rank %d resumed from %s: global_step %d, ver %d, %d B samples in the ledger",
                 self.dist.rank, self.checkpoints.resume_from, self.step, self.ver, len(restored.ledger))

    # -- one optimizer step's pieces ------------------------------------------------------------

    def maybe_sync(self, record: StepRecord) -> None:
        """The step boundary's weight sync (learner/weight_sync/boundary.py, either mode); every rank adopts rank 0's
        ver. The sync's own entries (``sync/*``, ``time/sync_*``, named by learner/weight_sync) go into
        ``record.facts.sync``.

        ``time/sync_stall`` is what the training thread spent here: blocking, the barrier-to-barrier
        push on sync steps; overlap, the snapshot (rank 0) and the state broadcast on every step.
        """
        if self._carry_sync:
            record.facts.sync.update(self._carry_sync)
            self._carry_sync = {}
        t0 = time.monotonic()
        result = self.sync.boundary(self.model, self.step, self.ver)
        if result is not None:
            self._adopt(result, record.facts.sync)
        record.stats.time_sync_stall += time.monotonic() - t0
        every = self.cfg.training.eval_every_steps
        self._eval_due |= bool(every) and self.step % every == 0
        if self._eval_due and result is not None and result.finished and result.ok:
            # The server now holds this ver: evaluate it (rank 0's thread; nobody waits for it), labelled with
            # the step of its weights (overlap mode: the snapshot's, up to a push earlier than this boundary).
            self._eval_due = False
            step = result.weights_step if result.weights_step is not None else self.step
            self.evals.maybe_start(step, self.ver)

    def _adopt(self, result: Any, sync: dict[str, Any]) -> None:
        """Take a sync outcome's ver on this rank; its entries go into ``sync`` (a step's ``facts.sync``)."""
        sync.update(result.metrics)
        if not result.finished:
            return
        if result.ok:
            self.ver = result.ver
        if self.queue is not None:
            self.queue.set_ver(self.ver)
        sync["sync/ok"] = int(result.ok)
        sync["sync/count"] = sync.get("sync/count", 0) + int(result.ok)  # adopted in this step (sum over records)

    def inputs(self, arrays: dict) -> PackInputs:
        return pack_inputs(arrays, self.cfg.model.attn_implementation, self.dtype, self.dist.device)

    def step_inputs(self, arrays: list[dict], stats: RankStats) -> tuple[list[PackInputs], Normaliser]:
        """The step's pack inputs (tensors, host-to-device copies) and their :meth:`global_normaliser`, timed as
        ``time/prepare_inputs`` (host work a GPU record would otherwise leave unexplained). It holds the
        normaliser's all_reduce, so a rank that gets here first also waits here for the slowest rank."""
        t0 = time.monotonic()
        inputs = [self.inputs(a) for a in arrays]
        norm = self.global_normaliser(inputs)
        stats.time_prepare_inputs += time.monotonic() - t0
        return inputs, norm

    def global_normaliser(self, inputs: list[PackInputs]) -> Normaliser:
        """CE tokens and boxes over every rank's packs of this step (one all_reduce)."""
        ce, boxes = self.dist.all_reduce(
            [sum(i.rows.n_ce for i in inputs), sum(i.rows.n_boxes for i in inputs)], "sum",
            f"supervised-token count (all_reduce SUM) at step {self.step}",
        )
        return Normaliser(ce_tokens=ce, boxes=boxes, scale=float(self.dist.world_size))

    def _count_backward(self, grad: torch.Tensor) -> None:
        self.calls["backward"] += 1

    def forward_backward(self, inp: PackInputs, norm: Normaliser, stats: RankStats, *, channel: str, sync_grads: bool,
                         loss_scale: float = 1.0) -> dict[str, int]:
        """One packed forward and one backward of a ``channel`` ("A" or "B") pack; gradients all-reduce only if
        ``sync_grads``.

        ``time/forward_backward`` is host wall time; on a GPU the backward is only launched here, so the span is also
        timed on the device (``time/forward_backward_gpu``: ``self.fb_spans``, read in :meth:`finish_step`).
        Returns the forwards and backwards the hooks actually saw (1 and 1; a test checks it).
        """
        before = dict(self.calls)
        t0 = time.monotonic()
        self.fb_spans.start()
        with parallel.grad_sync(self.model, sync_grads):
            terms = forward_loss(self.model, inp, self.coord_ids, norm, self.loss_weights[channel],
                                 self.cfg.training.loss_head)
            if terms.backward.requires_grad:
                terms.backward.register_hook(self._count_backward)
            (terms.backward * loss_scale).backward()
        self.fb_spans.stop()
        stats.time_forward_backward += time.monotonic() - t0
        seen = {k: self.calls[k] - before[k] for k in self.calls}
        stats.forwards += seen["forward"]
        stats.backwards += seen["backward"]
        stats.micro_steps += 1
        stats.max_forwards_per_micro = max(stats.max_forwards_per_micro, seen["forward"], seen["backward"])
        stats.packs += 1
        stats.segments += inp.n_segments
        stats.tokens += inp.n_tokens
        stats.fill_sum += inp.n_tokens / self.packing_length
        stats.add_losses(terms, loss_scale)
        self.counters.totals.forwards += seen["forward"]
        return seen

    def trace(self, **record: Any) -> None:
        if self._trace is not None:
            self._trace.write(json.dumps({"rank": self.dist.rank, "step": self.step, **record}) + "\n")
            self._trace.flush()

    def finish_step(self, record: StepRecord) -> None:
        """Close the step on every rank (collectives: the loss check, the metrics all_gather, the budget)::

            sync fence ─► optimizer update (learner/optimizer_step.py) ─► run counters ─► this rank's stats
              closed (device time, queue snapshot, time/step, peak memory) ─► all_gather ─► rank 0 writes
              the metrics line ─► step += 1 ─► budget ─► last step: final push ─► checkpoint when due
              (or, without one at the end, the "end" record)
        """
        stats, facts = record.stats, record.facts
        self.sync.before_weights_change()  # GPU overlap: the update waits for the snapshot copy (device-side)
        facts.optimizer = outcome = self.optimizer_step.apply(stats.loss_total, self.step)
        stats.time_optimizer_step = outcome.seconds
        # Costs nothing here: clip_and_step read the gradient norm (queued behind every backward) to the host, so
        # the host already waited past the last stop event. Without gradients, or a norm taken on the host (FSDP2
        # cpu_offload), seconds() waits for at most the backward's rest, which the metrics all_gather would anyway.
        stats.time_forward_backward_gpu = self.fb_spans.seconds()
        kind_b = facts.step_kind_b
        self.counters.count_step(kind_b=kind_b, skipped=outcome.skipped)
        stats.kind_b = float(kind_b)
        stats.ver_current = self.ver
        stats.sync_client_calls = self.sync.client_calls
        a = self.a_windows.counters  # as of the last window taken, not the one prefetched
        stats.a_dropped_total, stats.a_window_carry = a["too_long_dropped"] + a["record_errors"], a["window_carry"]
        if self.queue is not None:
            stats.queue.update(self.queue.snapshot())
        stats.time_step = time.monotonic() - record.started
        self.budget.add(stats.time_step)
        peak = parallel.peak_memory_gb(self.dist.device)  # since the process started; rss always, GPU ones on a GPU
        stats.mem_peak_rss = peak["rss"]
        stats.mem_peak_allocated, stats.mem_peak_reserved = peak.get("allocated", 0.0), peak.get("reserved", 0.0)
        facts.run = RunFacts(
            global_step=self.step + 1, parallel=self.cfg.learner.parallel, ver_current=self.ver,
            b_ratio_realized=self.counters.realized.value,
            b_ratio_realized_cumulative=self.counters.realized.cumulative,
            sync_counts=dict(self.sync.counts), totals=replace(self.counters.totals), throughput=self.throughput,
        )
        line = gather_metrics_line(self.dist, self.step, record, self.ga)
        if line is not None:
            self.writer.write(line)
        self.step += 1
        self.budget.check(self.step)
        last = self.finished
        if last and self.evals_configured:
            self.push_final_weights()
        if self.checkpoints.due(self.step, last=last):
            self.save()
        elif last and self.dist.is_main:  # no final checkpoint to say what the server holds: one "end" record does
            self.writer.write_end({"step": self.step, "ver": self.ver, "sync_counts": dict(self.sync.counts)})

    @property
    def finished(self) -> bool:
        """``training.max_steps`` reached, or ``training.max_train_seconds`` spent (identical on every rank)."""
        return self.step >= self.cfg.training.max_steps or self.budget.out_of_time

    @property
    def evals_configured(self) -> bool:
        """Same answer on every rank (the config's), so the collective in push_final_weights runs on all."""
        return bool(self.cfg.data.val_jsonl)

    def push_final_weights(self) -> None:
        """Collective: push the weights of the last step unless the last push already has them, so the final
        evaluation scores the trained model (and the final checkpoint's ver is the server's)."""
        self.settle_sync("final evaluation")
        if self.sync.last_sync_step == self.step:
            return
        result = self.sync.run(self.model, self.step, self.ver)
        self._adopt(result, {})  # after the last record: its entries go nowhere
        self._final_push_failed = not result.ok

    def final_eval(self) -> None:
        """Rank 0, after the last step: evaluate the final weights (training is over; waiting costs no step)."""
        if self._final_push_failed and self.evals.enabled:
            log.error("no final evaluation: the push of the final weights failed (see the sync error above), so "
                      "the server does not hold them; evaluate the final checkpoint with python -m evaluator")
            return
        self.evals.final(self.step, self.ver, deadline_s=self.cfg.rollout_matching.vllm.infer_timeout_s)
        if self.dist.is_main:  # the final evaluation may have named a new best: apply the rule once more
            self.checkpoints.retain(self.step, final=self.cfg.training.save_final)

    def settle_sync(self, why: str) -> None:
        """overlap: wait for the push in flight (its deadline) and adopt its outcome on every rank (a collective);
        its timings go into the next step's record (this step's is written). blocking: nothing to do."""
        settled = self.sync.settle(self.model, self.step, self.ver, why)
        if settled is not None:
            sync: dict[str, Any] = {}
            self._adopt(settled, sync)
            self._carry_sync = {k: v for k, v in sync.items() if k not in ("sync/in_flight", "sync/started")}

    def save(self) -> None:
        """Checkpoint this step on every rank (collective), once the push in flight settled."""
        self.settle_sync("checkpoint")  # so the saved ver is the server's (docs/learner.md, Weight sync)
        opt, c = self.optimizer_step, self.counters
        state = TrainerState(
            run_id=self.run_id, global_step=self.step, ver=self.ver, totals=c.totals.state(),
            sync_counts=dict(self.sync.counts), recent_kinds_b=list(c.recent_kinds),
            realized_total_steps=c.realized.total_steps, realized_total_b=c.realized.total_b,
        )
        self.checkpoints.save(
            self.step, model=self.model, optimizer=opt.optimizer, scheduler=opt.scheduler, state=state,
            data_a=self.a_windows.state_dict(),  # type: ignore[union-attr]
            queue_counters=self.queue.snapshot() if self.queue is not None else None,
            trained_ids=self.b_trained, final=self.finished,
        )

    def take_a_window(self, stats: RankStats) -> AWindow:
        """This step's Channel-A window (exactly GA packs tagged with the current ver), built ahead on a thread."""
        t0 = time.monotonic()
        window = self.a_windows.take(self.ver)  # type: ignore[union-attr]
        stats.time_wait_for_a_window += time.monotonic() - t0
        return window

    def close(self) -> None:
        self.sync.close()  # waits for a push in flight up to its deadline (rank 0)
        if self.a_windows is not None:
            self.a_windows.close()
        if getattr(self, "data_a", None) is not None:  # after the prefetch thread that owns it: its encode workers
            self.data_a.close()
        if self.queue is not None:
            self.queue.stop()
        if self._intake is not None:
            self._intake.close()
        if self._trace is not None:
            self._trace.close()
        if getattr(self, "writer", None) is not None:
            self.writer.close()
