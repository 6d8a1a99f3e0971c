"""Validation during training: greedy rollouts of ``data.val_jsonl`` through the rollout server, on rank 0.

::

    boundary before step s (after the weight sync; learner/rank.py maybe_sync)
      s == 0 or s % training.eval_every_steps == 0 (the first boundary from then whose push committed),
      and no evaluation running?
        rank 0: start a thread ─► common.evaluation.loop.evaluate_records(val records, HttpInfer(min_ver=ver))
                                    ONE /infer of every image (one ver) ─► strict parse ─► P/R/F1@0.5 + COCO mAP
                                 ─► MetricsWriter.write_eval({"record": "eval", "step": s, "eval/*": ...})
        the training thread goes on at once (it never waits for an evaluation)
      one still running: this one is skipped, counted (eval/skipped_busy) and logged
    after the last step: every rank pushes the final weights if the last push is older (a collective),
      then rank 0 waits for a running evaluation and evaluates the final weights (training is over)

``step`` in an eval record is the number of optimizer steps behind the weights it scored; ``eval/ver``
the server ver that produced the rollouts (``min_ver`` = the learner's ver at that boundary, so never
older weights). Every image goes in one /infer request (up to ``rollout_server.max_batch_items``), so
one ver scores them all: a server answers a request under one ver. The price: a sync that arrives
meanwhile waits at the server's drain fence for that request like for any rollout batch — the
learner's own wait in blocking mode (``time/sync_stall``), the push thread's in overlap mode. The
rollouts share the server with the actors, so an evaluation also slows Channel-B production while it
runs; its time is ``eval/time_s`` (docs/evaluation.md has the measured cost).

What this module does not know: how the numbers are computed (common/evaluation/metrics.py), or ranks
beyond "rank 0 evaluates".
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class PeriodicEval:
    """Rank 0's evaluation thread; every method is a no-op on other ranks or without ``data.val_jsonl``."""

    def __init__(self, cfg: Any, *, is_main: bool, write: Any) -> None:
        """``write(record)``: where eval records go (``MetricsWriter.write_eval``)."""
        self.enabled = bool(is_main and cfg.data.val_jsonl)
        self.every = int(cfg.training.eval_every_steps)
        self.write = write
        self.counts = {"eval/runs": 0, "eval/skipped_busy": 0, "eval/failures": 0}
        self._thread: threading.Thread | None = None
        if not self.enabled:
            return
        from transformers import AutoTokenizer  # deferred; a tokenizer of its own: the thread parses with it

        from common.detection.answer import Prompts
        from common.evaluation.loop import load_eval_set
        from common.detection.coord_tokens import require_coord_tokens

        self.cfg = cfg
        self.evalset = load_eval_set(cfg.data.val_jsonl, max_images=cfg.training.eval_max_images,
                                     image_root=cfg.data.image_root, coord_mode=cfg.data.coord_mode)
        for problem in self.evalset.skipped[:5]:
            log.warning("validation record skipped: %s", problem)
        if not self.evalset.records:
            raise ValueError(f"data.val_jsonl = {cfg.data.val_jsonl}: no usable records ({len(self.evalset.skipped)} "
                             "lines skipped). Fix: point it at a JSONL of the data contract, or unset it")
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.coord_ids = require_coord_tokens(self.tokenizer, cfg.model.path)
        self.prompts = Prompts.of(cfg.data.system_prompt, cfg.data.user_prompt, cfg.data.answer_format)
        self.url = cfg.rollout_matching.vllm.servers[0].base_url
        log.info("evaluation: %d validation images of %s at step 0, every %s steps and at the end, via %s",
                 len(self.evalset.records), cfg.data.val_jsonl, self.every or "(never)", self.url)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def maybe_start(self, step: int, ver: int) -> None:
        """Evaluate ``ver`` (the learner's, just committed on the server) at the boundary before ``step``.

        The caller decides when (learner/rank.py: the first committed push at or after each due step)."""
        if not self.enabled:
            return
        if self.busy:
            self.counts["eval/skipped_busy"] += 1
            log.warning("evaluation due at step %d skipped: the one started earlier is still running (%d skipped so "
                        "far; raise training.eval_every_steps or lower training.eval_max_images)", step,
                        self.counts["eval/skipped_busy"])
            return
        self._thread = threading.Thread(target=self._run, args=(step, ver), name=f"eval-step{step}", daemon=True)
        self._thread.start()

    def final(self, step: int, ver: int, deadline_s: float) -> None:
        """After training: wait for a running evaluation (``deadline_s``), then evaluate ``ver`` synchronously."""
        if not self.enabled:
            return
        if self._thread is not None:
            self._thread.join(deadline_s)
            if self._thread.is_alive():
                log.error("the evaluation started earlier did not finish within %.0f s; the final one is skipped",
                          deadline_s)
                return
        self._run(step, ver)

    def _run(self, step: int, ver: int) -> None:
        from common.evaluation.loop import HttpInfer, evaluate_records

        rm = self.cfg.rollout_matching
        client = HttpInfer(self.url, timeout_s=rm.vllm.infer_timeout_s, connect_timeout_s=rm.vllm.connect_timeout_s,
                           client_id="learner-eval", min_ver=ver,
                           start_hint="make launch-rollout CONFIG=<your config>")
        t0 = time.monotonic()
        try:
            result = evaluate_records(
                self.evalset.records, client, tokenizer=self.tokenizer, coord_ids=self.coord_ids,
                image_root=self.evalset.image_root, max_new_tokens=rm.decoding.max_new_tokens,
                batch_size=min(len(self.evalset.records), self.cfg.rollout_server.max_batch_items), prompts=self.prompts,
                federated=self.evalset.federated,
            )
        except Exception as exc:  # an evaluation must never take the learner down
            self.counts["eval/failures"] += 1
            log.error("evaluation at step %d (ver %d) failed after %.1f s: %s", step, ver, time.monotonic() - t0, exc)
            return
        finally:
            client.close()
        self.counts["eval/runs"] += 1
        record = {"record": "eval", "step": step, "eval/ver_requested": ver, **result.record(), **self.counts}
        self.write(record)
        r = result.report
        log.info("eval at step %d (ver %d): F1@0.5 %s, mAP %s, mAP50 %s, parse failures %.0f %%, %.1f objects/image "
                 "(GT %.1f), %.1f s", step, result.ver_max, _fmt(r.f1), _fmt(r.map), _fmt(r.map_50),
                 100 * r.parse_failure_rate, r.objects_per_image, r.gt_per_image, result.elapsed_s)
        if result.ver_max > ver:  # an abort-mode fence cut the request and the server re-ran it on newer weights
            log.warning("eval at step %d scored ver %d, not the ver %d it asked for: a sync fence (abort) cut it and the "
                        "server re-ran it on newer weights, so its step is a lower bound; weight_sync.fence: drain or "
                        "weight_sync.mode: overlap keeps an evaluation on its own ver", step, result.ver_max, ver)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"
