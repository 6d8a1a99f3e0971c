"""Learner CPU figures for the tiny model: optimizer steps/s of A and B steps, and time in wait_for_packs.

    python bench/bench_learner.py [--steps 12] [--warmup 2] [--ga 2] [--server URL] [--json out.json]

One process, world size 1, the real learner (``learner.rank.Learner``: model, Channel-A data,
ready queue, decision, loss, optimizer, metrics), three phases on the same model:

  A          b_ratio 0: Channel-A window packs (per_device_train_batch_size 1 → one sample per pack)
  B (fed)    b_ratio 1, a feeder thread keeps the ready queue at target (actors keep up)
  B (slow)   b_ratio 1, the feeder delivers one pack per ``--slow-interval-s`` (actors cannot keep up):
             the learner falls back to A (pack_wait_s 0), so wait_for_packs stays ~0 and the skip rate shows

B packs are real encoded segments of the synthetic records (one per pack, as A), sent through the
wire codec (``pack_to_frames`` → ``ReadyQueue.push_frames``) but not through ZMQ. Without
``--server`` no rollout server runs: the start-up sync fails fast (connection refused, logged) and
every step is timed without syncs; with ``--server http://host:port`` (a running rollout server for
the same model) a sync runs every ``--sync-every`` steps and its phases are reported.

Figures are per optimizer step (GA packs), medians over the timed steps, from the learner's own
metrics records (``time/step``, ``time/forward_backward``, ``time/wait_for_packs``,
``time/wait_for_a_window``: A steps take windows the Channel-A prefetch thread built;
``time/prepare_inputs`` and ``time/other``, the step time no part covers); ``best`` is 1 / the fastest
step, the figure least disturbed by other processes on a shared box. On a GPU the JSON also holds
``forward_backward_gpu_s`` (``time/forward_backward_gpu``, which busy then counts: docs/metrics.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def feeder(queue, pool, stop: threading.Event, interval_s: float, prefix: str) -> None:
    """Keep the queue at its target (interval 0) or add one pack per ``interval_s``."""
    from common.packing.segment import Pack
    from common.wire.codec import pack_to_frames

    n = 0
    while not stop.is_set():
        if interval_s == 0 and queue.eligible() >= queue.target:
            time.sleep(0.002)
            continue
        seg = replace(pool[n % len(pool)], sample_id=f"{prefix}{n}@0", ver=queue.ver_current)
        queue.push_frames(pack_to_frames(Pack(ver=seg.ver, channel="B", segments=[seg]), "bench-feeder", n))
        n += 1
        if interval_s:
            stop.wait(interval_s)


def encoded_segments(encoder, data_dir: Path, n: int) -> list:
    """``n`` teacher-forced segments of the synthetic records (GT targets; the shape of a B segment)."""
    from common.detection.answer import canonical_order
    from common.data.records import load_record
    from common.detection.targets import channel_a_target

    out = []
    for line in (data_dir / "train.jsonl").read_text().splitlines():
        record = load_record(json.loads(line))
        target = channel_a_target(canonical_order(record.objects), encoder.tokenizer, coord_ids=encoder.coord_ids)
        if (seg := encoder.encode(record, target, sample_id="pool", channel="B", ver=0)) is not None:
            out.append(seg)
        if len(out) == n:
            return out
    return out


def phase(learner, name: str, b_ratio: Fraction, steps: int, warmup: int, pool, interval_s: float | None) -> dict:
    from learner.train import async_step

    stop = threading.Event()
    thread = None
    if interval_s is not None:
        thread = threading.Thread(target=feeder, args=(learner.queue, pool, stop, interval_s, f"{name}-"), daemon=True)
        thread.start()
    learner.b_ratio = b_ratio
    first = learner.step
    try:
        for _ in range(warmup + steps):
            async_step(learner)
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=5)
    records = [json.loads(line) for line in (learner.out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r.get("record", "step") == "step"]  # evaluation records share the file
    timed = [r for r in records if first + warmup <= r["step"] < first + warmup + steps]
    med = lambda key: statistics.median(r[key] for r in timed)  # noqa: E731
    kinds_b = sum(r["stage2_ab/async/step_kind_b"] for r in timed)
    out = {
        "phase": name,
        "steps": len(timed),
        "b_steps": kinds_b,
        "skipped_b": sum(r["stage2_ab/async/b_step_skipped_due_to_queue"] for r in timed),
        "steps_per_s": 1.0 / med("time/step"),
        "steps_per_s_best": 1.0 / min(r["time/step"] for r in timed),  # least disturbed by other load on the box
        "time_step_s": med("time/step"),
        "forward_backward_s": med("time/forward_backward"),
        "wait_for_packs_s": med("time/wait_for_packs"),
        "wait_for_packs_max_s": max(r["time/wait_for_packs"] for r in timed),
        "wait_for_a_window_s": med("time/wait_for_a_window"),
        "prepare_inputs_s": med("time/prepare_inputs"),
        "other_s": med("time/other"),
        "busy_fraction": med("learner/busy_fraction"),
        "tokens_per_s": med("throughput/tokens_per_s"),
        "tokens_per_step": med("packing/tokens"),
    }
    if all("time/forward_backward_gpu" in r for r in timed):  # a GPU learner (absent on CPU)
        out["forward_backward_gpu_s"] = med("time/forward_backward_gpu")
    syncs = [r for r in timed if "time/sync_wire" in r]
    if syncs:
        out.update({f"sync_{k}_s": statistics.median(r[f"time/sync_{k}"] for r in syncs)
                    for k in ("total", "fence", "wire", "commit")})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="timed optimizer steps per phase")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each phase")
    ap.add_argument("--ga", type=int, default=2, help="gradient_accumulation_steps (packs per step)")
    ap.add_argument("--packing-length", type=int, default=1024)
    ap.add_argument("--slow-interval-s", type=float, default=0.25, help="one B pack per this many seconds in phase 3")
    ap.add_argument("--server", default=None, help="a running rollout server URL to include weight syncs")
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import torch

    from common.config.load import load_config
    from learner.distributed import Dist
    from learner.pack_queue import ReadyQueue
    from learner.rank import Learner
    from common.data.synthetic import ensure_synthetic_data
    from tools.make_tiny_model import ensure_tiny_model

    model = ensure_tiny_model(ROOT / "artifacts" / "tiny-model")
    data = ensure_synthetic_data(ROOT / "artifacts" / "data" / "synth")
    out = Path(tempfile.mkdtemp(prefix="bench-learner-"))
    server = args.server or "http://127.0.0.1:9"  # nothing listens on the discard port: syncs fail fast
    overrides = [
        f"model.path={model}", f"data.train_jsonl={data / 'train.jsonl'}", "data.val_jsonl=null",
        f"training.output_dir={out}", "training.max_steps=1000000", "training.save_every_steps=0",
        "training.progress=false", f"training.gradient_accumulation_steps={args.ga}",
        f"training.global_max_length={args.packing_length}", "learner.nproc_per_node=1", "learner.pack_wait_s=0",
        f"rollout_matching.vllm.servers=[{{base_url: '{server}'}}]",
        f"weight_sync.every_steps={args.sync_every if args.server else 1000000}",
        "stage2_ab.channel_b.async.queue_limit=8", f"stage2_ab.channel_b.async.prefetch_target_packs={max(4, args.ga)}",
        "stage2_ab.channel_b.async.version_window=4",
    ]
    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml", overrides, world_size=1)
    if not args.server:
        # the one start-up sync fails by design
        logging.getLogger("learner.weight_sync.boundary").setLevel(logging.CRITICAL)
    dist = Dist("gloo")
    learner = Learner(cfg, dist)
    a = cfg.stage2_ab.channel_b.async_
    learner.queue = ReadyQueue(rank=0, queue_limit=a.queue_limit, version_window=a.version_window,
                               target=a.prefetch_target_packs, trained_ids=learner.b_trained)
    learner.setup()
    pool = encoded_segments(learner.encoder, data, 8)
    results = [
        phase(learner, "A", Fraction(0), args.steps, args.warmup, pool, None),
        phase(learner, "B (actors keep up)", Fraction(1), args.steps, args.warmup, pool, 0.0),
        phase(learner, "B wanted, actors too slow", Fraction(1), args.steps, args.warmup, pool, args.slow_interval_s),
    ]
    learner.close()
    env = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "ga": args.ga,
           "packing_length": args.packing_length, "model": "tiny Qwen2.5-VL (0.8M params, fp32)"}
    print(f"learner bench — {env}")
    print(f"{'phase':28} {'steps':>5} {'B':>3} {'skip':>4} {'steps/s':>8} {'best':>6} {'fwd+bwd s':>9} {'wait s':>8} "
          f"{'wait max':>8} {'A wait':>7} {'inputs':>7} {'other':>7} {'busy':>5} {'tok/s':>7}")
    for r in results:
        print(f"{r['phase']:28} {r['steps']:5d} {r['b_steps']:3d} {r['skipped_b']:4d} {r['steps_per_s']:8.2f} "
              f"{r['steps_per_s_best']:6.2f} "
              f"{r['forward_backward_s']:9.3f} {r['wait_for_packs_s']:8.4f} {r['wait_for_packs_max_s']:8.4f} "
              f"{r['wait_for_a_window_s']:7.4f} {r['prepare_inputs_s']:7.4f} {r['other_s']:7.4f} "
              f"{r['busy_fraction']:5.2f} {r['tokens_per_s']:7.0f}")
        if "sync_total_s" in r:
            print(f"{'':28} sync: total {r['sync_total_s']:.3f}s fence {r['sync_fence_s']:.3f}s "
                  f"wire {r['sync_wire_s']:.3f}s commit {r['sync_commit_s']:.3f}s")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "results": results}, indent=1))
    dist.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
