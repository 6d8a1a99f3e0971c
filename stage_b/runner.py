"""``run_all(config)``: ticket-parallel rollout on every rank, selection and reflection on rank 0.

One global batch (P = runner.per_rank_rollout_batch_size, W = WORLD_SIZE, batch = P × W tickets)::

    rank 0                                   every rank r                              unblocked by
    ──────                                   ────────────                              ────────────
    broadcast Command(rollout, snapshot) ──► snapshot = guidance of this batch         rank 0 (after its
                                                                                       previous batch)
                                             shard = batch[shard_bounds(len, W, r)]
                                             candidates = rollout(shard, snapshot)
    all_gather(ok | error) ◄───────────────► all_gather(ok | error)                    the slowest rank
    gather_object(candidates) ◄──────────── gather_object(candidates)                  (a failure anywhere:
                                                                                        RankFailure on all)
    per ticket, in batch order:
      trajectories, failure | selection,
      learnable → reflection.add()  ── global pending ≥ reflection.batch_size → reflect now;
                                       the repo changes, this batch's snapshot does not
    metrics; next batch ──────────────────► (ranks ≠ 0 wait in the next broadcast)

After the last batch of an epoch rank 0 flushes the pending records through reflection; the run
ends with a ``done`` broadcast (or ``abort`` if rank 0 failed, so nobody waits for it). Every
collective has the gloo timeout ``runner.collective_timeout_s``.

With WORLD_SIZE unset or 1 the same loop runs with identity collectives.

What this module does not know: how answers are generated or parsed (rollout, prompts), how a
verdict is chosen (selection), how guidance changes (reflection, guidance).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from stage_b.artifacts import ArtifactWriter
from stage_b.config import StageBConfig
from stage_b.distributed import (Dist, Command, RankFailure, epoch_order, global_batches, resolve_placement,
                                 shard_bounds)
from stage_b.guidance import GuidanceRepo, GuidanceSnapshot, load_seed
from stage_b.reflection import ReflectionEngine
from stage_b.rollout import RolloutSampler, build_generator, reflection_completer
from stage_b.selection import Candidate, failure_reason, select
from stage_b.tickets import Ticket, check_tickets, fingerprint, load_tickets, make_demo_tickets, mission_slug

log = logging.getLogger(__name__)


@dataclass
class ShardResult:
    """What one rank sends rank 0 for one global batch (gather_object)."""

    rank: int
    bounds: tuple[int, int]  # [lo, hi) within the global batch
    guidance_step: int  # the snapshot step this rank used
    candidates: dict[str, list[Candidate]]
    rollout_s: float


@dataclass
class RunSummary:
    """What this rank did (returned by run_all on every rank; rank 0 also writes it)."""

    rank: int
    world: int
    mission: str = ""
    run_dir: str | None = None  # rank 0 only
    batches: list[dict[str, Any]] = field(default_factory=list)  # per global batch: step used, shard, keys
    reflection_cycles: int | None = None  # rank 0 only: None elsewhere (no engine exists there)
    final_step: int | None = None
    files_written: list[str] = field(default_factory=list)


@dataclass
class RunTiming:
    """Where the run's time went, on this rank's clock; rank 0's is ``timing`` in run_summary.json.

    ``loop_s`` is the throughput window: from the first global batch's broadcast to the end of the last
    epoch's reflection flush (start-up, model load and the final broadcast excluded), so
    ``tickets / loop_s`` compares world sizes without their different start-up costs (torchrun, one
    model load per rank). Seconds, ``time.monotonic``.
    """

    setup_s: float = 0.0  # tickets + model load (+ artifact directory on rank 0), this rank
    loop_s: float = 0.0  # first batch broadcast -> last epoch end; 0 when the run failed before it ended
    rollout_s: float = 0.0  # sum over global batches of the SLOWEST rank's rollout (rank 0 sees every rank's)
    wait_for_ranks_s: float = 0.0  # sum of this rank's idle time between its own rollout and the gather
    select_s: float = 0.0  # rank 0: selection + artifact writing, reflection excluded
    reflection_s: float = 0.0  # rank 0: reflection cycles, mid-batch and at epoch end
    global_batches: int = 0
    tickets: int = 0  # tickets rolled out, every epoch (a ticket judged in 2 epochs counts twice)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}
        out["tickets_per_s"] = round(self.tickets / self.loop_s, 3) if self.loop_s > 0 else None
        out["rollout_tickets_per_s"] = round(self.tickets / self.rollout_s, 3) if self.rollout_s > 0 else None
        return out


def load_run_tickets(cfg: StageBConfig) -> tuple[list[Ticket], str]:
    """The run's tickets (file, or the deterministic demo set) and its single mission."""
    if cfg.tickets.path is not None:
        return load_tickets(cfg.tickets.path, cfg.tickets.mission)
    d = cfg.tickets.demo
    tickets = make_demo_tickets(d.num_groups, d.images_per_group, d.fail_share, d.seed)
    return tickets, check_tickets(tickets, cfg.tickets.mission, "tickets.demo")


def run_all(cfg: StageBConfig) -> RunSummary:
    """Run Stage-B on this rank (torchrun rank or a single process); raises on any rank's failure."""
    dist = Dist.from_env(cfg.runner.collective_timeout_s)
    try:
        return _Run(cfg, dist).run()
    finally:
        dist.close()


class _Run:
    def __init__(self, cfg: StageBConfig, dist: Dist) -> None:
        self.cfg, self.dist = cfg, dist
        self.summary = RunSummary(dist.rank, dist.world)
        self.writer: ArtifactWriter | None = None  # rank 0 only
        self.repo: GuidanceRepo | None = None  # rank 0 only
        self.reflection: ReflectionEngine | None = None  # rank 0 only
        self.need_review: dict[str, list[str]] = {}  # rank 0 only: reason -> ticket keys
        self.epoch_stats: Counter = Counter()
        self.timing = RunTiming()
        self.tickets: list[Ticket] = []
        self.mission = ""

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        import torch

        cfg, dist = self.cfg, self.dist
        self.tickets, self.mission = load_run_tickets(cfg)
        self.summary.mission = self.mission
        placement = resolve_placement(cfg.model.device_map, dist.world, dist.local_rank,
                                      torch.cuda.device_count() if torch.cuda.is_available() else 0)
        if placement.device.startswith("cuda"):
            torch.cuda.set_device(int(placement.device.split(":")[1]))
        self.generator = build_generator(cfg.sampler, cfg.model, placement)
        self.sampler = RolloutSampler(self.generator, cfg.sampler, self.mission, dist.rank)
        if dist.is_main:
            run_dir = Path(cfg.output.root) / cfg.run_name / mission_slug(self.mission)
            self.writer = ArtifactWriter(run_dir, cfg.output.overwrite)
            self.summary.run_dir = str(run_dir)
            self.writer.write_json("run_config.json", {"config": asdict(cfg), "world_size": dist.world,
                                                       "mission": self.mission, "num_tickets": len(self.tickets),
                                                       "tickets_fingerprint": fingerprint(self.tickets)})
            self.repo = GuidanceRepo(self.mission, run_dir, load_seed(cfg.guidance.path),
                                     cfg.guidance.snapshot_retention, on_write=self.writer.note)
            self.reflection = ReflectionEngine(reflection_completer(self.generator, cfg.reflection), self.repo,
                                               cfg.reflection, self.mission, self._emit)

    def _emit(self, name: str, record: dict[str, Any]) -> None:
        self.writer.append(name, record)
        if name == "need_review_queue":
            self.need_review.setdefault(record["reason"], []).append(record["ticket_key"])

    # ------------------------------------------------------------------ main loop
    def run(self) -> RunSummary:
        cfg, dist = self.cfg, self.dist
        status, error = "ok", None
        try:
            t0 = time.monotonic()
            dist.guarded("setup", self._setup)
            self.timing.setup_s = time.monotonic() - t0
            dist.agree(fingerprint(self.tickets), "ticket set")
            t_loop = time.monotonic()
            P, W = cfg.runner.per_rank_rollout_batch_size, dist.world
            for epoch in range(cfg.runner.epochs):
                order = epoch_order(len(self.tickets), cfg.runner.seed, epoch, cfg.runner.shuffle)
                batches = global_batches(len(order), P * W)
                for b, (start, end) in enumerate(batches):
                    batch = [self.tickets[i] for i in order[start:end]]
                    self._global_batch(epoch, b, len(batches), batch)
                self._main_only("epoch end", lambda: self._epoch_end(epoch))
            self.timing.loop_s = time.monotonic() - t_loop
            self._main_only("run end", self._run_end)
            cmd = dist.broadcast(Command("done") if dist.is_main else None, "run end")
            if cmd.kind == "abort":
                raise RankFailure(cmd.payload)
        except BaseException as exc:
            status, error = "failed", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if self.writer is not None:
                self.summary.reflection_cycles = self.reflection.counters.cycles if self.reflection else 0
                self.summary.final_step = self.repo.step if self.repo else None
                self.writer.write_json("run_summary.json", {"status": status, "error": error, **self._summary_json()})
                self.writer.close()
                self.summary.files_written = sorted(str(p) for p in self.writer.written)
        return self.summary

    def _global_batch(self, epoch: int, b: int, num_batches: int, batch: list[Ticket]) -> None:
        dist = self.dist
        cmd = dist.broadcast(Command("rollout", self.repo.snapshot()) if dist.is_main else None,
                             f"guidance snapshot for epoch {epoch} batch {b}")
        if cmd.kind == "abort":
            raise RankFailure(cmd.payload)
        snapshot: GuidanceSnapshot = cmd.payload
        lo, hi = shard_bounds(len(batch), dist.world, dist.rank)
        shard = batch[lo:hi]
        clock: dict[str, float] = {"start": time.monotonic()}

        def rollout() -> dict[str, list[Candidate]]:
            out = self.sampler.generate_for_batch(shard, snapshot)
            clock["done"] = time.monotonic()
            return out

        cands = dist.guarded(f"rollout (epoch {epoch} batch {b})", rollout)
        rollout_s = clock["done"] - clock["start"]
        self.summary.batches.append({"epoch": epoch, "batch": b, "guidance_step": snapshot.step,
                                     "bounds": [lo, hi], "keys": [t.key for t in shard]})
        gathered = dist.gather(ShardResult(dist.rank, (lo, hi), snapshot.step, cands, rollout_s),
                               f"rollout results of epoch {epoch} batch {b}")
        wait_s = time.monotonic() - clock["done"]  # this rank idle while the slowest rank finished
        t = self.timing
        t.global_batches += 1
        t.tickets += len(batch)
        t.wait_for_ranks_s += wait_s
        t.rollout_s += max(r.rollout_s for r in gathered) if dist.is_main else rollout_s
        self._main_only(f"selection of epoch {epoch} batch {b}",
                        lambda: self._select_batch(epoch, b, num_batches, batch, snapshot, gathered, wait_s))

    def _main_only(self, what: str, fn: Callable[[], None]) -> None:
        """Rank 0's own work; on failure tell the waiting ranks (abort) before raising."""
        if not self.dist.is_main:
            return
        try:
            fn()
        except Exception as exc:
            log.exception("rank 0 failed during %s", what)
            self.dist.broadcast(Command("abort", f"rank 0 failed during {what}: {type(exc).__name__}: {exc}"),
                                "abort notice")
            raise

    # ------------------------------------------------------------------ rank 0
    def _select_batch(self, epoch: int, b: int, num_batches: int, batch: list[Ticket], snapshot: GuidanceSnapshot,
                      gathered: list[ShardResult], wait_s: float) -> None:
        w, refl = self.writer, self.reflection
        t0 = time.monotonic()
        by_key: dict[str, list[Candidate]] = {}
        for res in sorted(gathered, key=lambda r: r.rank):
            by_key.update(res.candidates)
        if list(by_key) != [t.key for t in batch]:
            raise RuntimeError(f"gathered shards do not cover batch {b} exactly once, in order")
        stats: Counter = Counter()
        cycles_before = refl.counters.cycles
        reflect_s = 0.0
        for pos, t in enumerate(batch):
            cands = by_key[t.key]
            where = {"epoch": epoch, "batch": b, "position": pos}
            base = {**where, "group_id": t.group_id, "label": t.label}
            for c in cands:
                w.append("trajectories", {**base, **c.to_json()})
            stats["candidates"] += len(cands)
            stats["candidates_format_ok"] += sum(c.format_ok for c in cands)
            why = failure_reason(cands)
            if why is not None:
                w.append("failure_malformed", {**base, "ticket_key": t.key, "reason": why,
                                               "rank": cands[0].rank if cands else None,
                                               "guidance_step": snapshot.step,
                                               "texts": [c.text[:200] for c in cands]})
                stats["failures"] += 1
                stats[f"failure_{why}"] += 1
                continue
            sel = select(cands, t.label, self.cfg.selection.tie_break, self.cfg.selection.min_verdict_agreement)
            w.append("selections", {**base, **sel.to_json(), "guidance_step": snapshot.step, "rank": cands[0].rank})
            stats["selected"] += 1
            stats["correct"] += sel.label_match
            stats["fp"] += sel.verdict == "pass" and t.label == "fail"
            stats["fn"] += sel.verdict == "fail" and t.label == "pass"
            if sel.learnable:
                stats["learnable"] += 1
                t_add = time.monotonic()
                refl.add({**sel.to_json(), "group_id": t.group_id, "summaries": list(t.summaries),
                          "epoch": epoch, "batch": b}, where)
                reflect_s += time.monotonic() - t_add
        self.epoch_stats.update(stats)
        w.append("metrics", {"kind": "batch", "epoch": epoch, "batch": b, **self._metrics(stats),
                             "guidance/step": snapshot.step,
                             "guidance/step_after": self.repo.step,
                             "reflection/cycles": refl.counters.cycles - cycles_before,
                             "reflection/pending": len(refl.pending),
                             "time/rollout_s": round(max(r.rollout_s for r in gathered), 3),
                             "time/wait_for_ranks_s": round(wait_s, 3),
                             "time/select_reflect_s": round(time.monotonic() - t0, 3),
                             "time/reflection_s": round(reflect_s, 3)})
        w.flush()
        self.timing.reflection_s += reflect_s
        self.timing.select_s += time.monotonic() - t0 - reflect_s
        if self.cfg.runner.progress:
            log.info("epoch %d batch %d/%d: %d tickets, acc %.2f, %d failures, %d learnable, guidance step %d -> %d",
                     epoch, b + 1, num_batches, len(batch), self._metrics(stats)["stage_b/acc"], stats["failures"],
                     stats["learnable"], snapshot.step, self.repo.step)

    @staticmethod
    def _metrics(s: Counter) -> dict[str, Any]:
        sel = s["selected"]
        out = {
            "stage_b/tickets": sel + s["failures"],
            "stage_b/selected": sel,
            "stage_b/acc": round(s["correct"] / sel, 4) if sel else 0.0,
            "stage_b/fp": s["fp"],
            "stage_b/fn": s["fn"],
            "stage_b/learnable": s["learnable"],
            "stage_b/failures": s["failures"],
            "stage_b/format_ok_rate": round(s["candidates_format_ok"] / s["candidates"], 4) if s["candidates"] else 0.0,
        }
        out.update({f"stage_b/{k}": v for k, v in sorted(s.items()) if k.startswith("failure_")})
        return out

    def _epoch_end(self, epoch: int) -> None:
        t0 = time.monotonic()
        self.reflection.flush({"epoch": epoch, "batch": None, "position": None})
        self.timing.reflection_s += time.monotonic() - t0
        c = self.reflection.counters
        self.writer.append("metrics", {"kind": "epoch", "epoch": epoch, **self._metrics(self.epoch_stats),
                                       "guidance/step": self.repo.step,
                                       **{f"reflection/{k}": v for k, v in asdict(c).items()}})
        self.writer.flush()
        self.epoch_stats = Counter()

    def _run_end(self) -> None:
        self.writer.write_json("need_review.json", {"mission": self.mission, "by_reason": self.need_review,
                                                    "count": sum(map(len, self.need_review.values()))})

    def _summary_json(self) -> dict[str, Any]:
        c = self.reflection.counters if self.reflection else None
        return {"world_size": self.dist.world, "mission": self.mission,
                "global_batches": len(self.summary.batches),
                "guidance_step": self.repo.step if self.repo else None,
                "reflection": asdict(c) if c else None, "timing": self.timing.to_json(),
                # every file rank 0 wrote under run_dir (this one included; pruned snapshots too), so a
                # reader can check that nothing else wrote there (bench/bench_stage_b.py does)
                "files": sorted({str(p.relative_to(self.writer.run_dir)) for p in self.writer.written}
                                | {"run_summary.json"})}
