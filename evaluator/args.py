"""The evaluator's command line: the flags, and every problem with them found at once.

``check_args`` names the flag and the fix for each problem (exit 2 in ``evaluator/__main__.py``),
resolves ``--model``/``--checkpoint`` to the model directory and picks the config (:func:`default_config`).
What this module does not know: how the evaluation runs (``evaluator/run.py``); it imports nothing heavy,
so ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.runs import cli

DESCRIPTION = ("Score a model directory or a learner checkpoint on a validation JSONL: F1@0.5, COCO mAP,\n"
               "parse failures (report.json, predictions.png; docs/evaluation.md).")
REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "configs/demo_cpu.yaml"
MAX_TOKENS = 32768  # common.wire.http.MAX_TOKENS_LIMIT (not imported: --help stays instant)
MAX_BATCH = 1024  # common.wire.http.MAX_BATCH


def build_parser() -> argparse.ArgumentParser:
    ap = cli.parser("python -m evaluator", DESCRIPTION)
    ap.add_argument("--model", help="HF model directory (tokenizer + weights the own server loads)")
    ap.add_argument("--checkpoint", help="a learner checkpoint RUN/checkpoints/<step> (its model/ is used)")
    ap.add_argument("--data", help="validation JSONL (records of docs/data.md)")
    ap.add_argument("--out", help="output directory for report.json, predictions.png, rollout_server.log")
    ap.add_argument("--url", help="use this running rollout server instead of starting one (its weights, its ver)")
    ap.add_argument("--max-images", type=int, default=None, help="evaluate the first N valid records (default all)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="generation cap per image (default 256)")
    ap.add_argument("--batch-size", type=int, default=8, help="images per /infer request (default 8)")
    ap.add_argument("--grid", type=int, default=12, help="images drawn in predictions.png (0 = no drawing)")
    ap.add_argument("--image-root", default=None, help="root of relative image paths (default: the JSONL's folder)")
    ap.add_argument("--config", default=None, help="config for the own server and the prompts the model was trained "
                    "with, data.system_prompt / data.user_prompt (default: for --checkpoint RUN/checkpoints/<step>, "
                    f"the run's own RUN/run_config.yaml; else the package's {DEFAULT_CONFIG})")
    ap.add_argument("--server-timeout", type=float, default=180.0, help="seconds to wait for GET /health 200")
    ap.add_argument("--infer-timeout", type=float, default=600.0, help="seconds one /infer batch may take")
    ap.add_argument("--overwrite", action="store_true", help="allow an --out that already holds a report.json")
    return ap


def model_dir_of(args: argparse.Namespace) -> tuple[Path | None, list[str]]:
    """The model directory --model/--checkpoint names, or the problems with them."""
    if bool(args.model) == bool(args.checkpoint):
        return None, ["give exactly one of --model DIR (an HF model directory, e.g. artifacts/tiny-model) or "
                      "--checkpoint RUN/checkpoints/<step>"]
    if args.model:
        path = Path(args.model)
        if (path / "config.json").is_file():
            return path.resolve(), []
        return None, [f"--model {args.model}: no config.json there. Fix: point it at an HF model directory "
                      "(the tiny one is built by `make tiny-model`), or use --checkpoint for a training checkpoint"]
    ckpt = Path(args.checkpoint)
    for candidate in (ckpt / "model", ckpt):
        if (candidate / "config.json").is_file():
            return candidate.resolve(), []
    return None, [f"--checkpoint {args.checkpoint}: neither {ckpt / 'model'} nor {ckpt} holds a config.json. Fix: "
                  "pass a checkpoint directory RUN/checkpoints/<step> (list them with `ls RUN/checkpoints`)"]


def check_args(args: argparse.Namespace) -> list[str]:
    """Every problem with the arguments, each naming the flag and the fix (fills args.model_dir, args.config)."""
    args.model_dir, problems = model_dir_of(args)
    if not args.data:
        problems.append("--data is required: the validation JSONL, e.g. --data artifacts/data/synth/val.jsonl "
                        "(built by `make data`)")
    elif not Path(args.data).is_file():
        problems.append(f"--data {args.data}: no such file. Fix: pass the validation JSONL (e.g. data.val_jsonl)")
    if not args.out:
        problems.append("--out is required: a directory for report.json and predictions.png, e.g. --out runs/eval")
    elif (Path(args.out) / "report.json").exists() and not args.overwrite:
        problems.append(f"--out {args.out} already holds a report.json. Fix: choose a new --out, or pass --overwrite")
    for flag, value, low, high in (("--max-new-tokens", args.max_new_tokens, 1, MAX_TOKENS),
                                   ("--batch-size", args.batch_size, 1, MAX_BATCH), ("--grid", args.grid, 0, 64)):
        if not low <= value <= high:
            problems.append(f"{flag} {value}: must be in {low}..{high}")
    if args.max_images is not None and args.max_images < 1:
        problems.append(f"--max-images {args.max_images}: must be >= 1 (leave it out to evaluate every record)")
    for flag, value in (("--server-timeout", args.server_timeout), ("--infer-timeout", args.infer_timeout)):
        if not value > 0:
            problems.append(f"{flag} {value}: must be > 0 seconds")
    if args.url and not args.url.startswith(("http://", "https://")):
        problems.append(f"--url {args.url}: not an HTTP URL. Fix: e.g. --url http://127.0.0.1:8310")
    args.config, args.config_source = default_config(args)
    if not Path(args.config).is_file():
        problems.append(f"--config {args.config}: no such file. Fix: pass the YAML config the model was trained with "
                        "(its prompts; the own rollout server starts from it), e.g. RUN/run_config.yaml")
    else:
        args.config = str(Path(args.config).resolve())
    return problems


def default_config(args: argparse.Namespace) -> tuple[str, str]:
    """(config path, where it came from): --config as given; else the run's ``run_config.yaml`` when --checkpoint
    is RUN/checkpoints/<step> (its prompts are the ones the model was trained with); else the package's demo config
    (found from the package, not the current directory)."""
    if args.config:
        return args.config, "--config"
    if args.checkpoint:
        run_config = Path(args.checkpoint).resolve().parent.parent / "run_config.yaml"
        if run_config.is_file():
            return str(run_config), "the checkpoint's run (run_config.yaml)"
    why = "no run_config.yaml in the checkpoint's run" if args.checkpoint else "--model has no run to take it from"
    return str(REPO / DEFAULT_CONFIG), f"the default {DEFAULT_CONFIG} ({why})"
