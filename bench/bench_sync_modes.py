"""Learner-visible weight-sync stall, ``weight_sync.mode: blocking`` vs ``overlap``, side by side in one run.

    python bench/bench_sync_modes.py [--nproc 2] [--rounds 3] [--steps 24] [--sync-every 2] [--json out.json]

Starts a rollout server (hf engine, the tiny model, CPU) and ``torchrun --nproc_per_node=N`` of this
script's worker: the real ``Learner`` on every rank (gloo), A steps only (no actors: the sync costs
do not depend on the step kind), a sync due every ``--sync-every`` steps. The workers alternate the
two modes on the same model and server, ``--steps`` optimizer steps per phase, ``--rounds`` times
(blocking, overlap, blocking, overlap, ...), so both see the same box load. Before leaving an
overlap phase every rank settles the push in flight (as a checkpoint does), so phases never overlap.

Reported per mode, from the learner's own ``metrics.jsonl`` (medians over the timed steps):

  stall per sync        blocking: ``time/sync_stall`` of the sync steps (barrier to barrier);
                        overlap: the phase's total ``time/sync_stall`` (every step's state broadcast plus
                        each push's snapshot) divided by the pushes it adopted — what the learner pays per sync
  stall at push start   overlap: ``time/sync_stall`` of the steps where a push started (snapshot + broadcast)
  stall per step        ``time/sync_stall`` of every step (overlap: the state broadcast alone on most steps)
  time/step             the step's wall time (slowest rank); "other steps": those where no push started
                        or was adopted (overlap: a push may still be running on rank 0's thread, sharing
                        the cores); wall/step = the phase's wall clock / its steps
  push                  ``time/sync_total`` (overlap: the background push, not a stall) and
                        ``sync/steps_during_push``; ``sync/deferred`` per phase

The first ``--warmup`` steps of every phase are not timed (the start-up sync, the switch).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from common.config.load import load_config
    from learner.distributed import Dist
    from learner.pack_queue import ReadyQueue
    from learner.rank import Learner
    from learner.train import async_step

    cfg = load_config(args.config, [], world_size=int(os.environ.get("WORLD_SIZE", "1")))
    dist = Dist("gloo", cfg.learner.collective_timeout_s)
    learner = Learner(cfg, dist)
    a = cfg.stage2_ab.channel_b.async_
    learner.queue = ReadyQueue(rank=dist.rank, queue_limit=a.queue_limit, version_window=a.version_window,
                               target=a.prefetch_target_packs, trained_ids=learner.b_trained)
    learner.setup()
    phases = []
    try:
        for r in range(args.rounds):
            for mode in ("blocking", "overlap"):
                learner.sync.mode = mode  # the same on every rank, at the same step
                first, t0 = learner.step, time.monotonic()
                for _ in range(args.steps):
                    async_step(learner)
                learner.settle_sync("end of the phase")  # overlap: the push in flight lands before blocking resumes
                phases.append({"round": r, "mode": mode, "first": first, "end": learner.step,
                               "wall_s": time.monotonic() - t0})
    finally:
        learner.close()
        dist.close()
    if dist.is_main:
        (Path(cfg.training.output_dir) / "phases.json").write_text(json.dumps(phases))
    return 0


def summarise(out: Path, warmup: int) -> list[dict]:
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if r.get("record", "step") == "step"}  # evaluation records share the file and the step numbers
    phases = json.loads((out / "phases.json").read_text())
    results = []
    for mode in ("blocking", "overlap"):
        per_sync, at_start, per_step, step_t, quiet_t, wall, push, during = [], [], [], [], [], [], [], []
        deferred = syncs = 0
        for ph in (p for p in phases if p["mode"] == mode):
            timed = [records[s] for s in range(ph["first"] + warmup, ph["end"])]
            per_step += [r["time/sync_stall"] for r in timed]
            step_t += [r["time/step"] for r in timed]
            quiet_t += [r["time/step"] for r in timed if not r.get("sync/started") and "sync/count" not in r]
            wall.append(ph["wall_s"] / (ph["end"] - ph["first"]))
            deferred += timed[-1]["sync/deferred"] - records[ph["first"] + warmup - 1]["sync/deferred"]
            if mode == "blocking":
                sync_steps = [r for r in timed if "sync/count" in r]
                per_sync += [r["time/sync_stall"] for r in sync_steps]
                push += [r["time/sync_total"] for r in sync_steps]
                syncs += len(sync_steps)
            else:
                at_start += [r["time/sync_stall"] for r in timed if r.get("sync/started")]
                adopted = [r for r in timed if r.get("sync/ok") == 1]
                push += [r["time/sync_total"] for r in adopted]
                during += [r["sync/steps_during_push"] for r in adopted]
                syncs += len(adopted)
                if adopted:
                    per_sync.append(sum(r["time/sync_stall"] for r in timed) / len(adopted))
        med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
        results.append({
            "mode": mode, "steps": len(step_t), "syncs": syncs, "stall_per_sync_s": med(per_sync),
            "stall_at_push_start_s": med(at_start), "stall_per_step_s": med(per_step),
            "stall_per_step_max_s": max(per_step), "time_step_s": med(step_t), "wall_per_step_s": med(wall),
            "time_step_other_s": med(quiet_t),
            "push_s": med(push), "steps_during_push": med(during), "deferred": deferred,
        })
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="learner ranks (torchrun, gloo)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="optimizer steps per phase")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each phase")
    ap.add_argument("--sync-every", type=int, default=2)
    ap.add_argument("--ga", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    import yaml

    from common.data.synthetic import ensure_synthetic_data
    from tests.ports import free_port_block
    from tests.server_proc import rollout_server_process
    from tools.make_tiny_model import ensure_tiny_model

    model = ensure_tiny_model(ROOT / "artifacts" / "tiny-model")
    data = ensure_synthetic_data(ROOT / "artifacts" / "data" / "synth")
    out = Path(tempfile.mkdtemp(prefix="bench-sync-modes-"))
    with rollout_server_process(model) as srv:
        cfg = yaml.safe_load((ROOT / "configs" / "demo_cpu.yaml").read_text())
        cfg["model"]["path"] = str(model)
        cfg["data"] = {"train_jsonl": str(data / "train.jsonl"), "val_jsonl": None}
        cfg["training"].update(output_dir=str(out), max_steps=10**6, save_every_steps=0, progress=False,
                               gradient_accumulation_steps=args.ga)
        cfg["stage2_ab"]["schedule"]["b_ratio"] = 0.0
        cfg["weight_sync"].update(mode="overlap", every_steps=args.sync_every)
        cfg["rollout_matching"]["vllm"]["servers"] = [{"base_url": srv.url}]
        cfg["weight_sync"]["bucket_mb"] = args.bucket_mb
        cfg["transport"]["base_port"] = free_port_block(2 * args.nproc)
        cfg["learner"]["nproc_per_node"] = args.nproc
        path = out / "bench.yaml"
        path.write_text(yaml.safe_dump(cfg))
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                __file__, "--worker", "--config", str(path), "--rounds", str(args.rounds), "--steps", str(args.steps)]
        proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1800)
        if proc.returncode != 0:
            print(f"workers exited with {proc.returncode}", file=sys.stderr)
            return proc.returncode
    results = summarise(out, args.warmup)
    import torch

    env = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
           "ranks": args.nproc, "ga": args.ga, "sync_every_steps": args.sync_every, "bucket_mb": args.bucket_mb,
           "rounds": args.rounds, "steps_per_phase": args.steps, "model": "tiny Qwen2.5-VL (3.3 MB fp32)",
           "server": "hf engine, CPU, same box"}
    print(f"sync modes bench — {env}")
    ms = lambda v: "—" if v != v else f"{v * 1e3:5.1f}ms"  # noqa: E731 - nan: not measured in this mode
    sec = lambda v: "—" if v != v else f"{v:.3f}s"  # noqa: E731
    print(f"{'mode':9} {'steps':>5} {'syncs':>5} {'stall/sync':>10} {'@start':>8} {'stall/step':>10} {'max':>7} "
          f"{'time/step':>9} {'other':>7} {'wall/step':>9} {'push':>7} {'steps in push':>13} {'deferred':>8}")
    for r in results:
        print(f"{r['mode']:9} {r['steps']:5d} {r['syncs']:5d} {ms(r['stall_per_sync_s']):>10} "
              f"{ms(r['stall_at_push_start_s']):>8} {ms(r['stall_per_step_s']):>10} {ms(r['stall_per_step_max_s']):>7} "
              f"{r['time_step_s']:8.3f}s {sec(r['time_step_other_s']):>7} {r['wall_per_step_s']:8.3f}s "
              f"{r['push_s']:6.3f}s "
              f"{r['steps_during_push']:13.1f} {r['deferred']:8d}")
    print(f"metrics: {out / 'metrics.jsonl'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
