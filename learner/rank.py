"""One learner rank's training machinery: what every Channel-B mode's loop is made of.

:class:`Learner` holds the model, optimizer, Channel-A data, weight sync, metrics and checkpoints of
one rank, and the pieces of one optimizer step. The loops that put the pieces in order are elsewhere:
the async loop in ``learner/train.py`` (its docstring has the wait diagram of a step) and the
one-process ``step``/``micro`` loops in ``learner/modes.py``. The pieces, in the async mode's order::

    maybe_sync ─► (B: the decision's packs | A: take_a_window) ─► step_inputs (inputs + global_normaliser)
      ─► forward_backward × GA (gradients all-reduced on the last) ─► finish_step
           (optimizer update, counters, the gathered metrics record, final push, checkpoint when due)

Each piece times itself into the step's :class:`RankStats` (``time/*`` in docs/metrics.md); what no piece
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
import math
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.config.load import ConfigError
from common.packing.schedule import RealizedRatio, exact_ratio
from learner import checkpoint, parallel
from learner.data import ChannelAData
from learner.device_time import DeviceSpans
from learner.distributed import Dist
from learner.evaluation import PeriodicEval
from learner.loss import LossWeights, Normaliser
from learner.metrics import ROLLOUT_COUNTS, MetricsWriter, RankStats, gather_stats_record
from learner.model import (PackInputs, build_optimizer, clip_and_step, forward_loss, load_policy, pack_inputs, pack_limits,
                           resolve_dtype)
from learner.prefetch import AWindow, ChannelAPrefetcher
from learner.run_record import config_dict
from learner.pack_queue import ReadyQueue
from learner.recipe import restore_adapter
from learner.sync.boundary import WeightSync
from learner.throughput import Throughput

log = logging.getLogger(__name__)

REALIZED_WINDOW = 100  # optimizer steps behind stage2_ab/async/b_ratio_realized


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
        # max_train_seconds: time/step summed after this process's first step (start-up: sync setup, CUDA init)
        self.train_seconds, self._budget_running = 0.0, False
        self.out_of_time = False
        self._final_push_failed = False
        self.realized = RealizedRatio(REALIZED_WINDOW)
        self.recent_kinds: deque[bool] = deque(maxlen=REALIZED_WINDOW)  # checkpointed to restore ``realized``
        self.b_trained: set[str] = set()  # the B-sample ledger (shared with the ready queue in async mode)
        self.totals = {"steps_a": 0, "steps_b": 0, "b_skipped_due_to_queue": 0, "optimizer_updates": 0, "forwards": 0,
                       "nonfinite_skipped": 0}
        self.queue: ReadyQueue | None = None
        self.a_windows: ChannelAPrefetcher | None = None
        self._sockets: list[Any] = []
        self._trace = None
        self.fb_spans = DeviceSpans(dist.device)  # forward/backward on the GPU: time/forward_backward_gpu
        self.sync = WeightSync(cfg, dist, progress=lambda: self.step)
        self._carry_facts: dict[str, Any] = {}  # a push outcome adopted at a checkpoint: reported with the next step
        ab = cfg.stage2_ab
        # Channel-B packs never get the Stage-1 coord CE (stage2_ab.coord_ce_weight; learner/loss.py).
        self.loss_weights = {
            "A": LossWeights(ab.bbox_smoothl1_weight, ab.bbox_ciou_weight, ab.coord_temperature, ab.coord_ce_weight),
            "B": LossWeights(ab.bbox_smoothl1_weight, ab.bbox_ciou_weight, ab.coord_temperature),
        }

    # -- setup ----------------------------------------------------------------------------------

    def open_queue(self) -> None:
        """Bind this rank's pack PULL and credit PUB first, so actors can connect while the model loads."""
        from common.wire.transport import CreditPublisher, PackReceiver, credit_endpoint, max_frame_bytes, pack_endpoint

        t, a = self.cfg.transport, self.cfg.stage2_ab.channel_b.async_
        receiver = PackReceiver(pack_endpoint(t, self.dist.rank, self.cfg.learner), hwm=t.hwm, linger_ms=t.linger_ms,
                                max_frame_bytes=max_frame_bytes(t, self.packing_length))  # setup() checks the model
        publisher = CreditPublisher(credit_endpoint(t, self.dist.rank, self.cfg.learner))
        self._sockets = [receiver, publisher]
        self.queue = ReadyQueue(
            rank=self.dist.rank, queue_limit=a.queue_limit, version_window=a.version_window,
            target=a.prefetch_target_packs, recv=receiver.recv, publish=publisher.publish,
            credit_interval_s=t.credit_interval_s, trained_ids=self.b_trained,
        )
        log.info("rank %d: packs at %s, credits at %s", self.dist.rank, receiver.endpoint, publisher.endpoint)

    def setup(self) -> None:
        cfg, dist = self.cfg, self.dist
        sync_t = cfg.rollout_matching.vllm.sync.timeout_s
        if dist.world_size > 1 and cfg.learner.collective_timeout_s <= sync_t:
            raise ConfigError([
                f"learner.collective_timeout_s = {cfg.learner.collective_timeout_s}: must exceed "
                f"rollout_matching.vllm.sync.timeout_s = {sync_t} (the other ranks wait at a barrier while rank 0 "
                f"pushes: every blocking sync, and in overlap mode the start-up sync and a checkpoint's wait for "
                f"the push in flight). Fix: raise learner.collective_timeout_s above {sync_t}"
            ])
        from common.runs.checkpoints import resolve_resume_checkpoint, run_id_of

        torch.manual_seed(cfg.training.seed)
        self.run_id = run_id_of(self.out)  # rank 0 wrote it before any rank got here (learner/main.py)
        self.resume_from = resolve_resume_checkpoint(cfg.training.resume, self.out)
        # A sharded (fsdp) checkpoint has no model/ directory: load model.path, checkpoint.load restores the weights.
        hf_dir = None if self.resume_from is None else self.resume_from / "model"
        model_cfg = replace(cfg.model, path=str(hf_dir)) if hf_dir is not None and hf_dir.is_dir() else cfg.model
        model, tokenizer, coord_ids = load_policy(model_cfg, dist.device, cfg.training.gradient_checkpointing,
                                                  load_device=parallel.load_device(cfg.learner, dist.device),
                                                  compile=cfg.training.compile)
        restore_adapter(model, self.resume_from, cfg.model)
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
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.training)  # after wrap: fsdp's shards
        from common.packing.encode import encoder_from_config

        self.encoder = encoder_from_config(cfg)  # the training thread's (one-process modes' B pipeline, bench)
        if self.queue is not None:
            self._admit_packs(model)
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

    def _admit_packs(self, model: torch.nn.Module) -> None:
        """The ready queue's admission limits from the model, its largest pack checked against the frame cap."""
        from common.wire.transport import max_frame_bytes  # the receiver's cap, from the same config (open_queue)
        one = np.zeros(1, np.int64)
        rows = int(self.encoder.position_ids(one, one, np.zeros((0, 3), np.int64)).shape[0])
        limits = pack_limits(model, self.packing_length, rows, ROLLOUT_COUNTS)
        if limits.largest_frame_bytes() > (cap := max_frame_bytes(self.cfg.transport, self.packing_length)):
            raise ConfigError([
                f"transport.max_frame_mb = {self.cfg.transport.max_frame_mb}: a legal pack of this model can send a "
                f"{limits.largest_frame_bytes() / 2**20:.0f} MiB frame (pixel_values of {self.packing_length} tokens), "
                f"above the {cap / 2**20:.0f} MiB cap: ZMQ would drop it. Fix: set transport.max_frame_mb: "
                f"{math.ceil(2 * limits.largest_frame_bytes() / 2**20)}"
            ])
        self.queue.limits = limits  # type: ignore[union-attr]

    def _resume(self) -> None:
        ckpt = self.resume_from
        if ckpt is None:
            return
        state, rank_state, ledger = checkpoint.load(
            ckpt, self.dist, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler
        )
        self.step, self.ver = int(state["global_step"]), int(state["ver"])
        self.totals.update(state["totals"])
        self.sync.counts.update(state["sync_counts"])
        for kind_b in state["recent_kinds_b"]:
            self.realized.record(kind_b)
            self.recent_kinds.append(kind_b)
        self.realized.total_steps, self.realized.total_b = state["realized_total_steps"], state["realized_total_b"]
        self.data_a.load_state_dict(rank_state["data_a"], self.ver)
        self.b_trained.update(ledger)
        if self.queue is not None:
            self.queue.counters.update(rank_state.get("queue", {}))
            self.queue.set_ver(self.ver)
        log.info("rank %d resumed from %s: global_step %d, ver %d, %d B samples in the ledger",
                 self.dist.rank, ckpt, self.step, self.ver, len(ledger))

    # -- one optimizer step's pieces ------------------------------------------------------------

    def maybe_sync(self, facts: dict[str, Any], stats: RankStats) -> None:
        """The step boundary's weight sync (learner/sync/boundary.py, either mode); every rank adopts rank 0's ver.

        ``time/sync_stall`` is what the training thread spent here: blocking, the barrier-to-barrier
        push on sync steps; overlap, the snapshot (rank 0) and the state broadcast on every step.
        """
        if self._carry_facts:
            facts.update(self._carry_facts)
            self._carry_facts = {}
        t0 = time.monotonic()
        result = self.sync.boundary(self.model, self.step, self.ver)
        if result is not None:
            self._adopt(result, facts)
        stats["time_sync_stall"] += time.monotonic() - t0
        every = self.cfg.training.eval_every_steps
        self._eval_due |= bool(every) and self.step % every == 0
        if self._eval_due and result is not None and result.finished and result.ok:
            # The server now holds this ver: evaluate it (rank 0's thread; nobody waits for it), labelled with
            # the step of its weights (overlap mode: the snapshot's, up to a push earlier than this boundary).
            self._eval_due = False
            step = result.weights_step if result.weights_step is not None else self.step
            self.evals.maybe_start(step, self.ver)

    def _adopt(self, result: Any, facts: dict[str, Any]) -> None:
        facts.update(result.metrics)
        if not result.finished:
            return
        if result.ok:
            self.ver = result.ver
        if self.queue is not None:
            self.queue.set_ver(self.ver)
        facts["sync/ok"] = int(result.ok)
        facts["sync/count"] = facts.get("sync/count", 0) + int(result.ok)  # adopted in this step (sum over records)

    def inputs(self, arrays: dict) -> PackInputs:
        return pack_inputs(arrays, self.cfg.model.attn_implementation, self.dtype, self.dist.device)

    def step_inputs(self, arrays: list[dict], stats: RankStats) -> tuple[list[PackInputs], Normaliser]:
        """The step's pack inputs (tensors, host-to-device copies) and their :meth:`global_normaliser`, timed as
        ``time/prepare_inputs`` (host work a GPU record would otherwise leave unexplained). It holds the
        normaliser's all_reduce, so a rank that gets here first also waits here for the slowest rank."""
        t0 = time.monotonic()
        inputs = [self.inputs(a) for a in arrays]
        norm = self.global_normaliser(inputs)
        stats["time_prepare_inputs"] += time.monotonic() - t0
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
        stats["time_forward_backward"] += time.monotonic() - t0
        seen = {k: self.calls[k] - before[k] for k in self.calls}
        stats["forwards"] += seen["forward"]
        stats["backwards"] += seen["backward"]
        stats["micro_steps"] += 1
        stats["max_forwards_per_micro"] = max(stats["max_forwards_per_micro"], seen["forward"], seen["backward"])
        stats["packs"] += 1
        stats["segments"] += inp.n_segments
        stats["tokens"] += inp.n_tokens
        stats["fill_sum"] += inp.n_tokens / self.packing_length
        for key, value in (("loss_total", terms.total), ("loss_ce", terms.ce), ("loss_bbox_smoothl1", terms.bbox_smoothl1),
                           ("loss_bbox_ciou", terms.bbox_ciou), ("loss_coord_ce", terms.coord_ce)):
            stats[key] += value * loss_scale
        self.totals["forwards"] += seen["forward"]
        return seen

    def trace(self, **record: Any) -> None:
        if self._trace is not None:
            self._trace.write(json.dumps({"rank": self.dist.rank, "step": self.step, **record}) + "\n")
            self._trace.flush()

    def finish_step(self, stats: RankStats, facts: dict[str, Any], kind_b: bool, t_step: float) -> None:
        """Optimizer update, counters, the gathered metrics record, and a checkpoint when due."""
        self.sync.before_weights_change()  # GPU overlap: the update waits for the snapshot copy (device-side)
        loss_ok = self._loss_finite(stats)
        t0 = time.monotonic()
        norm = clip_and_step(self.model, self.optimizer, self.scheduler, self.cfg.training.max_grad_norm,
                             loss_finite=loss_ok)
        stats["time_optimizer_step"] = time.monotonic() - t0  # on the host under FSDP2 cpu_offload
        # Costs nothing here: clip_and_step read the gradient norm (queued behind every backward) to the host, so
        # the host already waited past the last stop event. Without gradients, or a norm taken on the host (FSDP2
        # cpu_offload), seconds() waits for at most the backward's rest, which the metrics all_gather would anyway.
        stats["time_forward_backward_gpu"] = self.fb_spans.seconds()
        skipped = not (loss_ok and math.isfinite(norm))  # the same on every rank (see _loss_finite, clip_and_step)
        facts["train/grad_norm"] = norm if math.isfinite(norm) else None
        facts["train/nonfinite_skipped"] = int(skipped)
        facts["train/lr"] = self.scheduler.get_last_lr()[0]
        if len(self.optimizer.param_groups) > 1:  # training.lr_groups: train/lr_vision, _merger, _llm, _rest
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
                facts[f"train/lr_{group['name']}"] = lr
        self.totals["nonfinite_skipped" if skipped else "optimizer_updates"] += 1
        if skipped:
            log.error("rank %d step %d: non-finite %s: optimizer step skipped (gradients dropped, weights unchanged; "
                      "learner/nonfinite_skipped_total counts them)", self.dist.rank, self.step,
                      "loss" if not loss_ok else f"gradient norm ({norm})")
        self.totals["steps_b" if kind_b else "steps_a"] += 1
        self.realized.record(kind_b)
        self.recent_kinds.append(kind_b)
        stats["kind_b"] = float(kind_b)
        stats["ver_current"] = self.ver
        stats["sync_client_calls"] = self.sync.client_calls
        a = self.a_windows.counters  # as of the last window taken, not the one prefetched
        stats["a_dropped_total"], stats["a_window_carry"] = a["too_long_dropped"] + a["record_errors"], a["window_carry"]
        if self.queue is not None:
            counters = self.queue.snapshot()
            for name, value in counters.items():
                stats[f"queue_{name}"] = value
        stats["time_step"] = time.monotonic() - t_step
        if self._budget_running:
            self.train_seconds += stats["time_step"]
        self._budget_running = True
        for name, gib in parallel.peak_memory_gb(self.dist.device).items():  # since the process started
            stats[f"mem_peak_{name}"] = gib
        facts.update({
            "global_step": self.step + 1,
            "learner/parallel": self.cfg.learner.parallel,
            "stage2_ab/async/ver_current": self.ver,
            "stage2_ab/async/b_ratio_realized": self.realized.value,
            "stage2_ab/async/b_ratio_realized_cumulative": self.realized.cumulative,
            **self.sync.counts,
            **{f"learner/{k}_total": v for k, v in self.totals.items()},
            **(self.throughput.facts() if self.throughput is not None else {}),
        })
        record = gather_stats_record(self.dist, self.step, stats, facts, self.ga, self.packing_length)
        if record is not None:
            self.writer.write(record)
        self.step += 1
        budget = self.cfg.training.max_train_seconds
        if budget is not None:  # rank 0's clock decides for every rank (a tiny broadcast per step)
            self.out_of_time = bool(self.dist.broadcast([int(self.train_seconds >= budget)],
                                                        f"time-budget broadcast at step {self.step}")[0])
        last = self.finished
        if last and self.evals_configured:
            self.push_final_weights()
        every = self.cfg.training.save_every_steps
        if (every and self.step % every == 0) or (last and self.cfg.training.save_final):
            self.save()
        elif last and self.dist.is_main:  # no final checkpoint to say what the server holds: one "end" record does
            self.writer.write_end({"step": self.step, "ver": self.ver, "sync_counts": dict(self.sync.counts)})

    def _loss_finite(self, stats: RankStats) -> bool:
        """Whether every rank's loss of this step is finite (one all_reduce under DDP, so all ranks agree)."""
        ok = math.isfinite(stats["loss_total"])
        if self.dist.world_size > 1:
            ok = self.dist.all_reduce([float(not ok)], "max", f"non-finite loss check at step {self.step}")[0] == 0
        return ok

    @property
    def finished(self) -> bool:
        """``training.max_steps`` reached, or ``training.max_train_seconds`` spent (identical on every rank)."""
        return self.step >= self.cfg.training.max_steps or self.out_of_time

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
        facts: dict[str, Any] = {}
        result = self.sync.run(self.model, self.step, self.ver)
        self._adopt(result, facts)
        self._final_push_failed = not result.ok

    def final_eval(self) -> None:
        """Rank 0, after the last step: evaluate the final weights (training is over; waiting costs no step)."""
        if self._final_push_failed and self.evals.enabled:
            log.error("no final evaluation: the push of the final weights failed (see the sync error above), so "
                      "the server does not hold them; evaluate the final checkpoint with python -m evaluator")
            return
        self.evals.final(self.step, self.ver, deadline_s=self.cfg.rollout_matching.vllm.infer_timeout_s)
        if self.dist.is_main:  # the final evaluation may have named a new best: apply the rule once more
            checkpoint.retain(self, final=self.cfg.training.save_final)

    def settle_sync(self, why: str) -> None:
        """overlap: wait for the push in flight (its deadline) and adopt its outcome on every rank (a collective);
        its timings go into the next step's record (this step's is written). blocking: nothing to do."""
        settled = self.sync.settle(self.model, self.step, self.ver, why)
        if settled is not None:
            facts: dict[str, Any] = {}
            self._adopt(settled, facts)
            self._carry_facts = {k: v for k, v in facts.items() if k not in ("sync/in_flight", "sync/started")}

    def save(self) -> None:
        self.settle_sync("checkpoint")  # so the saved ver is the server's (docs/learner.md, Weight sync)
        checkpoint.save_learner(self)

    def take_a_window(self, stats: RankStats) -> AWindow:
        """This step's Channel-A window (exactly GA packs tagged with the current ver), built ahead on a thread."""
        t0 = time.monotonic()
        window = self.a_windows.take(self.ver)  # type: ignore[union-attr]
        stats["time_wait_for_a_window"] += time.monotonic() - t0
        return window

    def close(self) -> None:
        self.sync.close()  # waits for a push in flight up to its deadline (rank 0)
        if self.a_windows is not None:
            self.a_windows.close()
        if self.queue is not None:
            self.queue.stop()
        for sock in self._sockets:
            sock.close()
        if self._trace is not None:
            self._trace.close()
        if getattr(self, "writer", None) is not None:
            self.writer.close()
