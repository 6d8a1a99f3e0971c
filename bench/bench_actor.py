"""Actor CPU throughput, generation excluded: how many rollouts one core post-processes per second.

    python bench/bench_actor.py [--samples 200] [--repeats 7] [--json out.json]

What is timed (one process, one thread, pinned by the OS to one core at a time):
  - the whole Channel-B post-processing of ``actor/pipeline.py`` — strict parse, Hungarian match,
    reordered_gt (and rollout_prefix) target, teacher-forced encode with the processor and images,
    and the model's rope index — on *synthetic responses*: each sample's serialised GT with
    perturbations (box jitter, dropped objects, false positives, shuffled order, and a share of
    truncated or garbage answers), so no generation happens;
  - packing of the resulting segments (``common/packing/packer.py``) and pack encoding for the wire;
  - ``hungarian_match`` alone for 10 / 50 / 100 objects (median over repeats).

Inputs: the tiny model (``make tiny-model``) and the synthetic data (``make data``); both are
built on demand. The tiny model's processor has a 112x112 max image (16 image tokens), so the image
part is cheaper than with a real 3B checkpoint; parse/match/target costs scale with the answer, not
the model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.detection.answer import IM_END, canonical_order, serialize_objects  # noqa: E402
from common.data.records import GTObject  # noqa: E402
from common.detection.matching import hungarian_match  # noqa: E402


def perturb(rng: np.random.Generator, objects: list[GTObject]) -> list[GTObject]:
    """A plausible model answer: jittered, some missed, some invented, order partly shuffled."""
    out = []
    for o in objects:
        if rng.random() < 0.15:
            continue  # missed -> FN
        jitter = rng.integers(-25, 26, size=4)
        b = np.clip(np.array(o.bins) + jitter, 0, 999)
        x1, x2 = sorted((int(b[0]), int(b[2])))
        y1, y2 = sorted((int(b[1]), int(b[3])))
        out.append(GTObject(o.desc, (x1, y1, x2, y2)))
    for _ in range(rng.poisson(0.5)):  # invented -> FP
        x1, y1 = rng.integers(0, 900, size=2)
        out.append(GTObject("phantom shape", (int(x1), int(y1), int(x1) + 60, int(y1) + 60)))
    out = canonical_order(out)
    if len(out) > 2 and rng.random() < 0.3:
        i = int(rng.integers(0, len(out) - 1))
        out[i], out[i + 1] = out[i + 1], out[i]
    return out


def synthetic_responses(pipeline, samples, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    tok = pipeline.tokenizer
    out = []
    for s in samples:
        ids = tok.encode(serialize_objects(perturb(rng, list(s.record.objects))) + IM_END, add_special_tokens=False)
        r = rng.random()
        if r < 0.10:  # truncated (hit max_new_tokens)
            ids = ids[: max(1, int(len(ids) * rng.uniform(0.2, 0.9)))]
        elif r < 0.13:  # garbage
            ids = rng.integers(0, len(tok), size=len(ids)).tolist()
        out.append(ids)
    return out


def bench_pipeline(cfg, n_samples: int, target: str) -> dict:
    from common.packing.encode import encoder_from_config
    from actor.pipeline import Pipeline, Rollout
    from actor.stream import SampleStream
    from common.packing.packer import Packer
    from common.wire.codec import pack_to_frames

    encoder = encoder_from_config(cfg)
    pipeline = Pipeline(cfg, encoder)
    pipeline.target_kind = target
    stream = iter(SampleStream(cfg.data.train_jsonl, rank=0, world_size=1, seed=0))
    items = [next(stream) for _ in range(n_samples)]
    samples = [pipeline.sample(i.key, i.record) for i in items]
    responses = synthetic_responses(pipeline, samples)
    rollouts = [Rollout(ids, ver=1) for ids in responses]
    pipeline.build_segments(samples[:4], rollouts[:4])  # warm caches (tokenizer tables, processor)

    t0 = time.perf_counter()
    segments, metrics = pipeline.build_segments(samples, rollouts)
    t1 = time.perf_counter()
    packer = Packer(cfg.training.global_max_length, cfg.training.packing_min_fill_ratio, 0.0)
    packs = []
    for s in segments:
        packer.add(s)
        packs += packer.pop_ready(now=0.0)
    packs += packer.flush_all()
    frames = [pack_to_frames(p, "bench", i) for i, p in enumerate(packs)]
    t2 = time.perf_counter()
    m = metrics.summary()
    n = len(samples)
    return {
        "target": target,
        "samples": n,
        "rollouts_per_s_per_core": n / (t1 - t0),
        "ms_per_rollout": 1000 * (t1 - t0) / n,
        "ms_per_rollout_by_stage": {k: 1000 * m[f"time/{k}"] / n for k in ("parse", "match", "target", "encode")},
        "pack_ms_per_rollout": 1000 * (t2 - t1) / n,
        "packs": len(packs),
        "mean_fill": packer.mean_fill,
        "mean_segment_tokens": float(np.mean([s.length for s in segments])),
        "mean_objects_per_sample": m["rollout/n_gt"] / n,
        "precision": m["rollout/precision"],
        "recall": m["rollout/recall"],
        "invalid_rollouts": m["rollout/invalid_rollout"],
        "bytes_per_pack": float(np.mean([sum(memoryview(f).nbytes for f in fr) for fr in frames])) if frames else 0.0,
    }


def bench_matching(sizes=(10, 50, 100), repeats: int = 7, top_k: int = 5) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for n in sizes:
        times = []
        for _ in range(repeats):
            xy = rng.integers(0, 900, size=(n, 2))
            wh = rng.integers(10, 100, size=(n, 2))
            gt = np.concatenate([xy, np.minimum(xy + wh, 999)], axis=1).astype(float)
            pred = np.clip(gt + rng.integers(-8, 9, size=gt.shape), 0, 999)[rng.permutation(n)]
            t0 = time.perf_counter()
            hungarian_match(pred, gt, candidate_top_k=top_k, gate=0.3, fp_cost=0.5, fn_cost=2.0)
            times.append(time.perf_counter() - t0)
        out[str(n)] = {"median_ms": 1000 * statistics.median(times), "min_ms": 1000 * min(times)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from common.config.load import load_config
    from common.data.synthetic import ensure_synthetic_data
    from tools.make_tiny_model import ensure_tiny_model

    model = ensure_tiny_model(ROOT / "artifacts" / "tiny-model")
    data = ensure_synthetic_data(ROOT / "artifacts" / "data" / "synth")
    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml", [f"model.path={model}", f"data.train_jsonl={data / 'train.jsonl'}",
                                                          "training.output_dir=/tmp/tandem-bench-actor"])
    import torch

    torch.set_num_threads(1)  # per core
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "python": platform.python_version()},
        "pipeline": [bench_pipeline(cfg, args.samples, t) for t in ("reordered_gt", "rollout_prefix")],
        "matching": bench_matching(repeats=args.repeats),
    }
    for p in result["pipeline"]:
        st = ", ".join(f"{k} {v:.2f}" for k, v in p["ms_per_rollout_by_stage"].items())
        print(f"pipeline[{p['target']}]: {p['rollouts_per_s_per_core']:.1f} rollouts/s/core "
              f"({p['ms_per_rollout']:.2f} ms each: {st}; packing+wire {p['pack_ms_per_rollout']:.2f} ms), "
              f"{p['samples']} samples, {p['mean_objects_per_sample']:.1f} obj/sample, fill {p['mean_fill']:.2f}")
    for n, t in result["matching"].items():
        print(f"hungarian_match {n:>3} objects: median {t['median_ms']:.2f} ms (min {t['min_ms']:.2f})")
    print(f"machine: {result['machine']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
