"""The whole topology at the users' operating point, end to end (issue 31): one JSON line from the run's summary.

    python bench/bench_e2e_op.py [--config configs/gpu/op_point_3b_1gpu.yaml] [--preset 3b] [--vocab 151936]
        [--side 1008] [--max-objects 40] [--n 64] [--steps 24] [--data DIR] [--work /tmp/tandem-e2e]
        [--deadline-s 1500] [--out OUT.json] [--build-only] [key=value ...]
    python bench/bench_e2e_op.py --quick    # the same code: the tiny model on the CPU demo config (tests/)

What it runs is what a user runs: ``python -m launcher --config CONFIG`` (the rollout server with its
engine, the actors, the torchrun learner), on

- a model directory of the preset's shapes (``tools/make_tiny_model.py --init pool``: random weights,
  seconds even for 7b), its embedding widened to ``--vocab`` rows (151,936: a real Qwen checkpoint's) and
  its image processor taking ``--side``² pixels whole, as a real checkpoint's does;
  or the model directory ``--model`` (your checkpoint, as it is);
- ``--n`` synthetic records (common/data/synthetic.py) of ``--side`` px with 1..``--max-objects`` shapes, or the
  JSONL folder ``--data`` (``train.jsonl``; made beforehand, e.g. on a CPU box, and carried).

The run has no validation set (``data.val_jsonl=null``: a random model's greedy answers run to
``max_new_tokens`` and say nothing) and no checkpoint; ``training.max_steps=--steps``. Random weights
mean rollouts that run to ``max_new_tokens`` and parse to nothing: the rollout side's worst case, while
the learner trains B packs of full-length answers.

The line: steps (A/B), syncs, ``busy_fraction`` (the learner's time-weighted share of step time in
forward/backward), ``sync_stall_share`` (of training time) and the stall per sync, tokens/s and MFU
(medians over the steps after the first), peak memory per rank, the packs' fill, wall seconds and the
device. Every figure is read from the run's ``summary.json`` (launcher/summary.py), nothing is re-timed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: The summary's figures the line reports (launcher/summary.py names them).
FIELDS = ("steps", "steps_a", "steps_b", "syncs", "ver_final", "busy_fraction", "sync_mode", "sync_stall_share",
          "sync_stall_share_after_start", "sync_stall_median_s", "sync_stall_n", "sync_bytes", "tokens_per_s_median",
          "mfu_median", "peak_tflops", "peak_source", "step_time_median_s", "peak_memory_gb_by_rank",
          "wait_for_packs_s", "mean_fill_a", "mean_fill_b", "packs_trained_b", "rollouts_trained",
          "rollouts_valid_share", "drop_stale_total", "nonfinite_skipped")


def build_inputs(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """The model directory and the training JSONL (both built once: a second call with the same settings reuses them)."""
    from common.data.synthetic import generate
    from tools.make_tiny_model import ensure_tiny_model

    if args.model:  # the user's own checkpoint (its processor decides the image size)
        model = Path(args.model)
        if not (model / "config.json").is_file():
            raise SystemExit(f"--model {args.model}: no config.json there (an HF model directory is expected)")
    else:
        model = ensure_tiny_model(work / f"model-{args.family}-{args.preset}-v{args.vocab or 0}-{args.side}",
                                  preset=args.preset, family=args.family,
                                  init="pool" if args.preset != "tiny" else "hf", vocab=args.vocab or None,
                                  max_pixels=args.side * args.side)
    if args.data:
        train = Path(args.data) / "train.jsonl"
        if not train.is_file():
            raise SystemExit(f"--data {args.data}: no train.jsonl there (make it with python -m common.data.synthetic "
                             f"--sides {args.side} --max-objects {args.max_objects} --out DIR)")
    else:
        train = generate(work / f"data-{args.side}-{args.max_objects}-{args.n}", sides=[args.side],
                         max_objects=args.max_objects, split=(args.n, 0))
    return model, train


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def run(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model, train = build_inputs(args, work)
    built_s = time.monotonic() - t0
    out = work / "run"
    argv = [sys.executable, "-m", "launcher", "--config", args.config, f"model.path={model}",
            f"data.train_jsonl={train}", "data.val_jsonl=null", f"data.image_root={train.parent}",
            f"training.max_steps={args.steps}", "training.save_every_steps=0", "training.save_final=false",
            f"training.output_dir={out}",
            "training.overwrite=true", "run_name=bench-e2e-op", *overrides]
    log_path = work / "launcher.out"
    t1 = time.monotonic()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=args.deadline_s)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None  # subprocess.run killed the launcher; its summary (if any) is still read below
    wall = time.monotonic() - t1
    summary_path = out / "summary.json"
    if not summary_path.is_file():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise SystemExit(f"the run left no {summary_path} (launcher exit {rc}, {wall:.0f}s); the launcher's "
                         f"output ends:\n{tail}")
    summary = json.loads(summary_path.read_text())
    rows = json.loads((model / "config.json").read_text()).get("text_config", {}).get("vocab_size")
    return {"bench": "e2e_op", "config": args.config, "model": str(model) if args.model else None,
            "preset": None if args.model else args.preset, "family": args.family, "vocab": rows, "side": args.side, "max_objects": args.max_objects, "device": device_name(),
            "launcher_rc": rc, "wall_s": round(wall, 1), "inputs_built_s": round(built_s, 1),
            "overrides": overrides, **{k: summary.get(k) for k in FIELDS}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="configs/gpu/op_point_3b_1gpu.yaml")
    ap.add_argument("--preset", default="3b", help="tools/make_tiny_model.py preset (default: %(default)s)")
    ap.add_argument("--family", default="qwen2.5-vl", choices=["qwen2.5-vl", "qwen3-vl"])
    ap.add_argument("--vocab", type=int, default=None,
                    help="embedding rows (default: 151936, a real Qwen checkpoint's; --quick: the tokenizer's; 0: the tokenizer's)")
    ap.add_argument("--side", type=int, default=1008, help="image side in px (a multiple of 28: 36 x 36 merged patches)")
    ap.add_argument("--max-objects", type=int, default=40)
    ap.add_argument("--n", type=int, default=64, help="synthetic training records")
    ap.add_argument("--data", default=None, help="a folder with train.jsonl (and its images) instead of --n records")
    ap.add_argument("--model", default=None,
                    help="an HF model directory (your checkpoint) instead of the preset's random weights "
                         "(--preset, --family, --vocab are then ignored)")
    ap.add_argument("--steps", type=int, default=24, help="training.max_steps")
    ap.add_argument("--work", default="/tmp/tandem-e2e-op", help="model, data, run and launcher output")
    ap.add_argument("--deadline-s", type=float, default=1500.0, help="the launcher is killed after this")
    ap.add_argument("--out", default=None, help="also write the line here")
    ap.add_argument("--quick", action="store_true", help="the tiny model on configs/demo_cpu.yaml (what tests run)")
    ap.add_argument("--build-only", action="store_true",
                    help="build the model and data into --work, print their paths, and stop (a call of its own on a\n"
                         "bare GPU machine: the 7b preset's took 157 s; the run after it reuses them)")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        ap.error(f"unrecognised arguments {bad}: options are listed above; config overrides are key=value")
    if args.quick:
        args.config, args.preset, args.vocab, args.side, args.max_objects, args.n = \
            "configs/demo_cpu.yaml", "tiny", args.vocab or 0, 112, 4, 16
        args.steps = min(args.steps, 6)
        overrides = ["weight_sync.every_steps=2", *overrides]
    elif args.vocab is None:
        args.vocab = 151936
    if args.build_only:
        t0 = time.monotonic()
        model, train = build_inputs(args, Path(args.work))
        print(json.dumps({"model": str(model), "train": str(train), "built_s": round(time.monotonic() - t0, 1)}))
        return 0
    line = run(args, overrides)
    print(json.dumps(line))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(line) + "\n")
    return 0 if line["launcher_rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
