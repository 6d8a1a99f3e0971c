"""Stage-1 warm start: turn a model directory into one that emits ``<|coord_k|>`` boxes.

    python -m learner.warm_start --config configs/warm_start_cpu.yaml --out artifacts/tiny-detector [--force] \
        [key=value ...]

Why it exists: Stage-2 (rollout matching) never puts cross-entropy on coord tokens; it assumes a
Stage-1 checkpoint that already answers in the box format (as the origin does). A freshly built or
freshly extended checkpoint (``tools/add_coord_tokens.py``) has never produced a coord token, so every
rollout is unparseable and Channel-B has nothing to learn from. This command is that Stage-1:
Channel-A steps only (``stage2_ab.schedule.b_ratio`` must be 0), with ``stage2_ab.coord_ce_weight > 0``
adding a full-vocabulary CE on every coord slot to the usual CE + geometry loss (learner/loss.py).

No rollout server: the learner's own pieces (``ChannelAData`` windows, ``pack_inputs``/``forward_loss``,
AdamW + warmup-cosine) in a plain loop. One process by default, so a 2-core box uses both cores for one
model instead of two gloo ranks for two copies; under ``torchrun --nproc_per_node=N -m learner.warm_start``
(one node) every rank trains its own shard of the data with DDP (``learner.parallel: ddp``; a step is N ×
``per_device_train_batch_size`` samples) and rank 0 alone writes the result: the GPU quality benchmark's
warm start on a 4-GPU machine (docs/benchmarks.md section 21).

The result is an ordinary HF model directory (safetensors, config, the base directory's tokenizer,
chat template and processor files), loadable by the hf and vLLM engines and by the learner as
``model.path``. ``tandem_build.json`` in it records the build parameters (the base model's own build
record or file stamps, the training data's manifest or stamp, the training/loss keys); a second run
with the same parameters does nothing, so ``make demo`` pays for the warm start once.
``warm_start_metrics.jsonl`` next to it has one line per logged step.

What this module does not know: rollouts, versions, ranks, or evaluation (``python -m evaluator``
scores the result).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from common.runs import cli
from common.runs.build_dir import build_once

BUILDER_VERSION = 1
BUILD_FILE = "tandem_build.json"
METRICS_FILE = "warm_start_metrics.jsonl"

log = logging.getLogger("learner.warm_start")


def _file_stamp(path: Path) -> dict[str, Any]:
    """Identity of a file we did not build: name, size and the sha256 of its first and last MiB."""
    st = path.stat()
    h = hashlib.sha256()
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read())
    return {"name": path.name, "size": st.st_size, "sha256_head_tail": h.hexdigest()}


def _model_identity(model_dir: Path) -> Any:
    """The base model's build record (tiny models, earlier warm starts) or the stamps of its weight files."""
    try:
        return json.loads((model_dir / BUILD_FILE).read_text())["params"]
    except (OSError, ValueError, KeyError):
        files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
        return [_file_stamp(p) for p in files]


def _data_identity(train_jsonl: Path) -> Any:
    """The synthetic set's manifest parameters, or a stamp of the JSONL itself."""
    try:
        return json.loads((train_jsonl.parent / "manifest.json").read_text())["params"]
    except (OSError, ValueError, KeyError):
        return _file_stamp(train_jsonl)


def build_params(cfg: Any) -> dict[str, Any]:
    """Everything the warm-started weights depend on; equal params = the same build."""
    from common.config.load import to_dict

    t, ab = cfg.training, cfg.stage2_ab
    ranks = cfg.derived.world_size
    return {
        **({"ranks": ranks} if ranks > 1 else {}),  # a step is ranks x per_device samples (one rank: no key, as before)
        "builder": "learner.warm_start",
        "version": BUILDER_VERSION,
        "base_model": _model_identity(Path(cfg.model.path)),
        "data": _data_identity(Path(cfg.data.train_jsonl)),
        "model": {"dtype": cfg.model.dtype, "attn_implementation": cfg.model.attn_implementation},
        "training": {k: getattr(t, k) for k in (
            "per_device_train_batch_size", "gradient_accumulation_steps", "effective_batch_size", "global_max_length",
            "lr", "weight_decay", "warmup_steps", "min_lr_ratio", "max_grad_norm", "max_steps", "seed")},
        # a time budget makes the build this machine's (where it stops): another budget, another build
        **({"max_train_seconds": t.max_train_seconds} if t.max_train_seconds is not None else {}),
        "loss": {k: v for k, v in to_dict(ab).items() if k not in ("schedule", "channel_b")},
    }


def check_config(cfg: Any) -> list[str]:
    """Problems that make a config unusable for a warm start (each with its fix)."""
    problems = []
    if cfg.stage2_ab.coord_ce_weight <= 0:
        problems.append(f"stage2_ab.coord_ce_weight = {cfg.stage2_ab.coord_ce_weight}: a warm start must teach the "
                        "coord tokens. Fix: set stage2_ab.coord_ce_weight: 1.0")
    if cfg.stage2_ab.schedule.b_ratio != 0:
        problems.append(f"stage2_ab.schedule.b_ratio = {cfg.stage2_ab.schedule.b_ratio}: the warm start runs Channel-A "
                        "only (there is no rollout server). Fix: set stage2_ab.schedule.b_ratio: 0")
    if not Path(cfg.data.train_jsonl).is_file():
        problems.append(f"data.train_jsonl = {cfg.data.train_jsonl}: not a file. Fix: point it at a JSONL "
                        "(make data builds the synthetic one)")
    if cfg.learner.parallel != "ddp":
        problems.append(f"learner.parallel = {cfg.learner.parallel}: the warm start's ranks run DDP (rank 0 saves the "
                        "whole model). Fix: set learner.parallel: ddp")
    if not (Path(cfg.model.path) / "config.json").is_file():
        problems.append(f"model.path = {cfg.model.path}: no config.json there. Fix: point it at a model directory "
                        "(make tiny-model builds the tiny one)")
    if not problems:  # data.on_bad_record: fail checks the first records before the model loads
        from common.data.check import start_problems

        problems += start_problems(cfg)
    return problems


def is_built(out: Path, params: dict[str, Any]) -> bool:
    try:
        return json.loads((out / BUILD_FILE).read_text()).get("params") == params
    except (OSError, ValueError):
        return False


#: The data counters the result reports (summed over the ranks).
COUNTERS = ("samples_drawn", "too_long_dropped", "record_errors")


def train(cfg: Any, out_tmp: Path | None, dist: Any = None) -> dict[str, Any]:
    """Run ``training.max_steps`` Channel-A steps with coord CE and save the model into ``out_tmp`` (rank 0).

    ``dist`` (a :class:`learner.distributed.Dist` under torchrun, else None): every rank trains its shard of
    the data, gradients all-reduced by DDP on each step's last pack; the logged losses are the ranks' mean.
    """
    import torch

    from common.packing.encode import encoder_from_config
    from learner import parallel
    from learner.checkpoint import copy_model_side_files
    from learner.data import ChannelAData
    from learner.loss import LossWeights, Normaliser
    from learner.model import build_optimizer, clip_and_step, forward_loss, load_policy, pack_inputs, resolve_dtype
    from learner.time_budget import TimeBudget

    t, ab = cfg.training, cfg.stage2_ab
    rank, world = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    torch.manual_seed(t.seed)
    device = dist.device if dist is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, _tokenizer, coord_ids = load_policy(cfg.model, device, t.gradient_checkpointing, compile=t.compile,
                                               checkpoint_every=t.gradient_checkpointing_every)
    trained = parallel.wrap(model, cfg.learner, device, world, dist.local_rank if dist is not None else 0)
    coord_ids_t = torch.tensor(coord_ids, device=device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    optimizer, scheduler = build_optimizer(model, t)
    ga = cfg.derived.gradient_accumulation_steps
    data = ChannelAData(cfg, encoder_from_config(cfg), rank=rank, world_size=world, ga=ga,
                        samples=cfg.training.per_device_train_batch_size * ga)  # the recipe's batch, not full packs
    names = ("total", "ce", "bbox_smoothl1", "bbox_ciou", "coord_ce")
    metrics = (out_tmp / METRICS_FILE).open("w", encoding="utf-8") if out_tmp is not None else None
    try:  # data.encode_workers > 0: its worker processes end with the training
        weights = LossWeights(ab.bbox_smoothl1_weight, ab.bbox_ciou_weight, ab.coord_temperature, ab.coord_ce_weight)
        every = max(1, t.log_every_steps)
        started = time.monotonic()
        last: dict[str, float] = {}
        budget = TimeBudget(t.max_train_seconds, dist)
        steps = 0
        for step in range(t.max_steps):
            t0 = time.monotonic()
            inputs = [pack_inputs(p.tensors(), cfg.model.attn_implementation, dtype, device) for p in data.next_window(0)]
            norm = Normaliser(ce_tokens=sum(i.rows.n_ce for i in inputs), boxes=sum(i.rows.n_boxes for i in inputs))
            sums = dict.fromkeys(names, 0.0)
            for k, inp in enumerate(inputs):
                with parallel.grad_sync(trained, k == len(inputs) - 1):  # one all-reduce a step, on its last pack
                    terms = forward_loss(trained, inp, coord_ids_t, norm, weights, t.loss_head)
                    terms.backward.backward()
                for name in sums:
                    sums[name] += getattr(terms, name)
            if dist is not None:  # every rank sees the same mean, so a non-finite loss stops all of them
                sums = dict(zip(names, (v / world for v in dist.all_reduce(
                    [sums[n] for n in names], "sum", f"warm start step {step}: the ranks' losses"))))
            if not math.isfinite(sums["total"]):
                raise FloatingPointError(f"warm start step {step}: loss {sums['total']} is not finite. Fix: lower "
                                         f"training.lr (now {t.lr}) or raise training.warmup_steps")
            grad_norm = clip_and_step(model, optimizer, scheduler, t.max_grad_norm)
            last = {f"loss/{k}": v for k, v in sums.items()}
            steps = step + 1
            budget.add(time.monotonic() - t0)
            budget.check(step)  # every rank stops after the same step (rank 0's clock)
            final = steps == t.max_steps or budget.out_of_time
            if metrics is not None and (step % every == 0 or final):
                rec = {"step": step + 1, **last, "train/grad_norm": grad_norm, "train/lr": scheduler.get_last_lr()[0],
                       "time/step": time.monotonic() - t0, "time/elapsed": time.monotonic() - started,
                       "packing/tokens": sum(i.n_tokens for i in inputs), "ranks": world}
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
                if t.progress:
                    log.info("step %d/%d  loss %.3f (ce %.3f, coord ce %.3f, ciou %.3f)  %.0f s", step + 1, t.max_steps,
                             sums["total"], sums["ce"], sums["coord_ce"], sums["bbox_ciou"], time.monotonic() - started)
            if budget.out_of_time:
                log.info("training.max_train_seconds=%.0f spent after step %d of %d: saving (the lr schedule, planned "
                         "for %d steps, stops at %.2g)", t.max_train_seconds, steps, t.max_steps, t.max_steps,
                         scheduler.get_last_lr()[0])
                break
    finally:
        data.close()
        if metrics is not None:
            metrics.close()
    counts = [data.counters[k] for k in COUNTERS]
    if dist is not None:
        counts = [int(v) for v in dist.all_reduce(counts, "sum", "the warm start's data counters")]
    if out_tmp is not None:
        model.eval()
        model.save_pretrained(out_tmp)
        copy_model_side_files(Path(cfg.model.path), out_tmp)
    return {"steps": steps, "seconds": round(time.monotonic() - started, 1), "final": last, "ranks": world,
            **dict(zip(COUNTERS, counts))}


def ensure_warm_start(cfg: Any, out: str | os.PathLike[str], *, force: bool = False,
                      dist: Any = None) -> tuple[Path, bool]:
    """The warm-started model at ``out`` (built unless it already holds this build); returns (path, built_now).

    Built once and atomically (:func:`common.runs.build_dir.build_once`): a concurrent caller or a killed
    build never leaves a half-written model; a folder this command did not write is never replaced. Under
    torchrun (``dist``) the ranks decide alike from the same folder (one node), train together, and rank 0
    writes; the others wait for it at a barrier.
    """
    out = Path(out)
    params = build_params(cfg)
    if not force and is_built(out, params):
        return out, False
    if out.resolve() == Path(cfg.model.path).resolve():
        raise FileExistsError(f"--out {out} is model.path itself; write the warm start to a new directory")
    if dist is not None and not dist.is_main:
        train(cfg, None, dist)
        dist.barrier("rank 0 writing the warm start")
        return out, True

    def write(tmp: Path) -> None:
        result = train(cfg, tmp, dist)
        (tmp / BUILD_FILE).write_text(json.dumps({"params": params, "result": result}, indent=1) + "\n")  # last

    built = build_once(out, marker=BUILD_FILE, is_built=lambda d: is_built(d, params), write=write,
                       owner="learner.warm_start", force=force)
    if dist is not None:
        dist.barrier("rank 0 writing the warm start")
    return built


def main(argv: list[str] | None = None) -> int:
    parser = cli.config_parser("python -m learner.warm_start", __doc__,
                               config_help="YAML config (e.g. configs/warm_start_cpu.yaml)")
    parser.add_argument("--out", required=True, help="directory of the warm-started model (created)")
    parser.add_argument("--force", action="store_true", help="rebuild even if --out holds this build")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; 1 for a plain process
    if (cfg := cli.load(args.config, args.overrides, world_size=world)) is None:
        return cli.EXIT_USAGE
    if problems := check_config(cfg):
        print(f"{len(problems)} problem(s) in {args.config} for a warm start:\n  - " + "\n  - ".join(problems),
              file=sys.stderr)
        return cli.EXIT_USAGE
    cli.setup_process("warm_start", int(os.environ.get("RANK", "0")) if world > 1 else None)
    dist = None
    try:
        if world > 1:
            from learner.distributed import Dist

            dist = Dist(cfg.learner.backend, cfg.learner.collective_timeout_s)
        path, built = ensure_warm_start(cfg, args.out, force=args.force, dist=dist)
    except FileExistsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist is not None:
            dist.close()
    if dist is not None and not dist.is_main:
        return 0
    info = json.loads((path / BUILD_FILE).read_text())
    result = info.get("result", {})
    state = "built" if built else "up to date"
    print(f"warm start: {path} ({state}; {result.get('steps')} steps in {result.get('seconds')} s, "
          f"final loss {result.get('final', {}).get('loss/total', float('nan')):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
