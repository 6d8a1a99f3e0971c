"""The learner process's loop: the async mode here, ``step``/``micro`` in learner/modes.py.

One optimizer step, every rank in lockstep; what each wait is unblocked by::

    ┌─ boundary before step s ──────────────────────────────────────────────────────────────────┐
    │ sync (learner/weight_sync/boundary.py; the first boundary of the process is always a blocking sync):     │
    │   blocking, when due: barrier ─► rank 0 pushes ─► barrier ─► broadcast [ver, ok]             │
    │     (unblocked by rank 0's push returning: success, error or sync.timeout_s)                 │
    │   overlap, every step: rank 0 collects a finished push, snapshots + starts one when due      │
    │     (deferred while one is in flight) ─► broadcast [ver, outcome, ...]; the push runs on     │
    │     rank 0's thread while every rank trains on (unblocked by rank 0's snapshot only)         │
    │   every rank: queue.set_ver(ver) → stale packs dropped, credits republished                  │
    │ decision: all_reduce(MIN eligible) ─► rank 0 kind ─► broadcast ─► reserve GA packs (B)       │
    │   (unblocked by every rank reaching the decision; waits for packs only if pack_wait_s > 0)   │
    │ GA packs: B = the reserved ones; A = the window learner/prefetch.py built during an earlier │
    │   step (exactly GA; waits only if that thread is behind: time/wait_for_a_window)            │
    │ inputs (host-to-device copies) + normaliser: all_reduce(SUM) of CE tokens and boxes of      │
    │   every rank's GA packs (time/prepare_inputs)                                               │
    │ GA micro-steps, ONE packed forward/backward each; gradients reduced on the last only        │
    │   (DDP no_sync / FSDP2 requires_gradient_sync: learner/parallel.py)                         │
    │   (the last backward's gradient all-reduce waits for every rank's backward)                 │
    │   (time/forward_backward: host wall time; on a GPU the kernels finish later, so each        │
    │   span is also timed by CUDA events: time/forward_backward_gpu)                             │
    │ clip, AdamW step (GPU overlap: after the snapshot copy's event), LR schedule; global_step    │
    │   (time/optimizer_step; the gradient norm's read waits for the GPU, and after it the        │
    │   forward/backward events are read)                                                         │
    │ all_gather of this step's per-rank stats ─► rank 0 writes metrics.jsonl                     │
    │ checkpoint due? (overlap: settle the push in flight first; every rank writes its part)      │
    └─────────────────────────────────────────────────────────────────────────────────────────────┘
    Meanwhile, on every rank, the ready queue's receiver thread drains ZMQ and publishes credits, and
    the Channel-A prefetch thread builds the next A window (at most one ahead; learner/prefetch.py).
    Nothing in the loop waits on an actor: an empty queue makes an A step.

The step's time is ``time/step``. Its parts are timed on their own: the sync (``time/sync_stall``), the
decision (``time/wait_for_packs``) and the ``time/*`` named above; what none of them covers (bookkeeping
between the parts, the loss check's all_reduce) is ``time/other`` (docs/metrics.md, Time and utilisation).
``time/step`` ends before the stats' all_gather: that and a checkpoint fall in no step's time.

On B steps the Channel-A sampler does not advance (advancing it would silently discard A data):
the prefetched window waits, and checkpoints store the sampler state of the windows taken.

The step's pieces (model, optimizer, sync, metrics, checkpoints) are :class:`learner.rank.Learner`'s;
this module puts them in the order above and carries the step's ``StepRecord`` (learner/step_record.py)
through them.

What this module does not know: sockets beyond constructing them, or how actors produce packs.
"""

from __future__ import annotations

import time
from typing import Any

from common.config.load import ConfigError
from learner.decision import decide_step
from learner.distributed import Dist
from learner.rank import Learner
from learner.step_record import StepRecord


def async_step(learner: Learner) -> None:
    """One optimizer step of the async mode, every rank in lockstep (the diagram of the module docstring)."""
    record = StepRecord()
    stats, facts = record.stats, record.facts
    learner.maybe_sync(record)
    t0 = time.monotonic()
    decision = decide_step(learner.step, learner.b_ratio, learner.ga, learner.queue, learner.dist,
                           wait_s=learner.cfg.learner.pack_wait_s)
    stats.time_wait_for_packs = time.monotonic() - t0
    stats.queue_depth = decision.local_eligible
    kind_b = decision.kind == "B"
    if kind_b:
        items = decision.packs
        arrays, metas = [it.arrays for it in items], [it.message.meta.get("segments", []) for it in items]
    else:
        window = learner.take_a_window(stats)
        packs, arrays = window.packs, window.arrays
        items, metas = [None] * len(packs), [p.segment_meta() for p in packs]
    if len(arrays) != learner.ga:  # DDP safety: every rank runs exactly GA micro-steps
        raise RuntimeError(f"rank {learner.dist.rank}: {len(arrays)} packs for a window of GA={learner.ga} "
                           f"at step {learner.step}")
    inputs, norm = learner.step_inputs(arrays, stats)
    for i, (inp, item, meta) in enumerate(zip(inputs, items, metas)):
        seen = learner.forward_backward(inp, norm, stats, channel=decision.kind, sync_grads=(i == learner.ga - 1))
        pack_ver = item.ver if item is not None else learner.ver
        if item is not None:
            learner.queue.mark_trained(item)  # type: ignore[union-attr]
            stats.add_ver_lag(learner.ver, item.ver)
            stats.add_pack_meta(meta)
        learner.trace(micro=i, kind=decision.kind, ver_current=learner.ver, pack_ver=pack_ver, forwards=seen["forward"],
                      backwards=seen["backward"], sample_ids=[m["sample_id"] for m in meta], tokens=inp.n_tokens)
    facts.policy_wants_b, facts.step_kind_b = decision.policy_wants_b, kind_b
    facts.b_step_skipped_due_to_queue, facts.min_eligible = decision.skipped_due_to_queue, decision.min_eligible
    learner.counters.totals.b_skipped_due_to_queue += int(decision.skipped_due_to_queue)
    learner.finish_step(record)


def run(cfg: Any, dist: Dist) -> int:
    """The learner process: set up, loop until ``training.max_steps``, clean up. Returns an exit code."""
    mode = cfg.stage2_ab.channel_b.mode
    if mode != "async" and dist.world_size > 1:
        raise ConfigError([  # load_config checks this when given the world size; this covers any other path
            f"stage2_ab.channel_b.mode = {mode!r}: runs on one learner process, but WORLD_SIZE = {dist.world_size}. "
            "Fix: use stage2_ab.channel_b.mode: async for multi-GPU learners (or --nproc_per_node=1)"
        ])
    learner = Learner(cfg, dist)
    try:
        if mode == "async":
            learner.open_queue()
        learner.setup()
        if learner.queue is not None:
            learner.queue.start()
        if mode == "async":
            while not learner.finished:
                async_step(learner)
        else:
            from learner.modes import run_sync_mode

            run_sync_mode(learner, mode)
        if learner.queue is not None:
            learner.queue.check_conservation()
        learner.final_eval()
    finally:
        learner.close()
    return 0
