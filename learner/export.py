"""Export a learner checkpoint as an ordinary HF model directory (safetensors) for serving or a new run.

    python -m learner.export --checkpoint OUTPUT_DIR/checkpoints/<step> --out DIR

An fsdp checkpoint holds its weights as torch.distributed.checkpoint shards (``dcp/``, one file per
rank) beside the HF directory minus its weights (``model_config/``; learner/checkpoint.py draws the
layout). This rebuilds the model from ``model_config/`` (older ones: the run's ``model.path``, recorded
in trainer_state.json) with no weights allocated (the meta device), gives it empty CPU storage in the
dtype the shards were saved in, and lets DCP fill it in one process, no process group (``dcp.load``
with ``no_dist``: it reads every shard of each tensor and stitches them, whatever the world size that
wrote them). Then ``save_pretrained`` plus the tokenizer/processor files. Peak host memory: the model
once (the AdamW state in ``dcp/`` is never read). A ddp checkpoint's ``model/`` already is such a
directory: it is copied, unless the run trained a ``model.adapter``: then ``model/`` holds the base weights and
``adapter/`` the adapter, and the export is the merged model (``--adapter-only``: the adapter alone, in peft's
layout). An fsdp checkpoint of an adapter run holds base and adapter in ``dcp/`` under the injected names: the
model is rebuilt with the adapter of ``adapter/adapter_config.json`` injected (on ``meta``, before DCP fills it),
merged (learner/recipe.py ``merged_weights``) and saved as a plain model; ``--adapter-only`` copies its
``adapter/`` as for ddp.

The result loads with ``AutoModelForImageTextToText.from_pretrained``, serves with the hf and vLLM
engines, and works as ``model.path`` for a new run (e.g. with another number of ranks). ``DIR`` is
written atomically (a temporary sibling renamed into place) and never over an existing non-empty one.

What this module does not know: ranks, optimizers, or how a checkpoint is resumed (learner/checkpoint.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from common.runs import cli
from common.runs.checkpoints import NotACheckpoint, checkpoint_parallel
from learner.recipe import ADAPTER_DIR, write_merged

log = logging.getLogger(__name__)


class ExportError(ValueError):
    """An export that cannot be made; the text names the problem and the fix."""


def model_files(ckpt: Path) -> Path:
    """The HF directory (config, tokenizer, processor) the exported model is built from."""
    own = ckpt / "model_config"
    if (own / "config.json").is_file():
        return own
    recorded = json.loads((ckpt / "trainer_state.json").read_text()).get("model_path")
    if recorded and (Path(recorded) / "config.json").is_file():
        log.warning("%s has no model_config/: building from the run's model.path %s", ckpt, recorded)
        return Path(recorded)
    raise ExportError(f"{ckpt} has no model_config/config.json and its recorded model.path ({recorded}) holds no "
                      "config.json. Fix: copy the whole checkpoint directory, or put the run's model.path back")


def export(checkpoint: str | Path, out: str | Path, adapter_only: bool = False) -> Path:
    """Write the HF model directory of ``checkpoint`` to ``out``; returns ``out``. A checkpoint of a run with
    ``model.adapter`` (an ``adapter/`` beside ``model/``): the adapter merged into the weights, or with
    ``adapter_only`` the adapter alone (peft's layout: ``peft.PeftModel.from_pretrained(base, out)``)."""
    ckpt, out = Path(checkpoint), Path(out)
    kind = checkpoint_parallel(ckpt)  # NotACheckpoint names what ckpt is instead
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty directory. Fix: choose a new directory, or remove it")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        adapter = ckpt / ADAPTER_DIR
        if adapter_only and not adapter.is_dir():
            raise ExportError(f"--adapter-only: {ckpt} holds no {ADAPTER_DIR}/ (its run trained without "
                              "model.adapter). Fix: drop --adapter-only to export the whole model")
        if adapter_only:
            shutil.copytree(adapter, tmp)
        elif kind == "ddp" and adapter.is_dir():
            from learner.checkpoint import copy_model_side_files

            write_merged(ckpt / "model", adapter, tmp)
            copy_model_side_files(ckpt / "model", tmp)
        elif kind == "ddp":
            shutil.copytree(ckpt / "model", tmp)
        else:
            write_from_shards(ckpt, tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported %s (%s checkpoint) to %s", ckpt, kind, out)
    return out


def write_from_shards(ckpt: Path, dst: Path) -> None:
    """``dst``: the HF directory of an fsdp checkpoint's ``dcp/`` weights and ``model_config/`` (or model.path)."""
    import torch.distributed.checkpoint as dcp

    from learner.checkpoint import DCP_DIR, copy_model_side_files

    src = model_files(ckpt)
    saved = dcp.FileSystemReader(str(ckpt / DCP_DIR)).read_metadata().state_dict_metadata
    weights = {k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")}
    if not weights:
        raise ExportError(f"{ckpt / DCP_DIR} holds no model weights (no model.* keys). Fix: pass a checkpoint the "
                          "learner wrote")
    dtype = next(iter(weights.values())).properties.dtype
    adapter = ckpt / ADAPTER_DIR
    model = _empty_model(src, dtype, adapter if adapter.is_dir() else None)
    state = {"model": model.state_dict()}
    missing = sorted(set(state["model"]) - set(weights))
    if missing:
        raise ExportError(f"{ckpt / DCP_DIR} lacks {len(missing)} weight(s) of the model {src} describes, e.g. "
                          f"{missing[:3]}: the checkpoint is of another model. Fix: restore the checkpoint's own "
                          "model_config/ (or model.path)")
    dcp.load(state, checkpoint_id=ckpt / DCP_DIR, no_dist=True)
    model.load_state_dict(state["model"])
    if adapter.is_dir():  # the served model: every adapted layer merged, peft's wrappers gone
        from learner.recipe import merged_weights

        merged = dict(merged_weights(model))
        model = _empty_model(src, dtype, None)
        model.load_state_dict(merged, strict=False)
        missing = [n for n, _ in model.named_parameters() if n not in merged]
        if missing:
            raise ExportError(f"{adapter} does not merge into the model of {src} ({len(missing)} weight(s) missing, "
                              f"e.g. {missing[:3]}). Fix: export a checkpoint the learner wrote, whole")
    model.save_pretrained(dst)
    copy_model_side_files(src, dst)


def _empty_model(src: Path, dtype: Any, adapter: Path | None) -> Any:
    """The model ``src`` describes with uninitialised CPU storage (no random init), ``adapter``'s peft config
    injected if given (the tree an adapter run's ``dcp/`` was written from)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):  # no memory, no random init: the caller fills every tensor
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(src), dtype=dtype)
        if adapter is not None:
            from peft import LoraConfig, inject_adapter_in_model

            with torch.random.fork_rng(devices=[]):
                inject_adapter_in_model(LoraConfig.from_pretrained(str(adapter)), model)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives every parameter its own storage; tied ones must share it again
    return model


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser("python -m learner.export", __doc__)
    ap.add_argument("--checkpoint", required=True, help="a checkpoint directory, OUTPUT_DIR/checkpoints/<step>")
    ap.add_argument("--out", required=True, help="the HF model directory to write (new, or empty)")
    ap.add_argument("--adapter-only", action="store_true",
                    help="a model.adapter run's checkpoint: write the adapter alone (peft's layout), not the merged model")
    args = ap.parse_args(argv)
    cli.setup_process("export")
    try:
        out = export(args.checkpoint, args.out, adapter_only=args.adapter_only)
    except (NotACheckpoint, ExportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return cli.EXIT_USAGE
    print(f"exported {args.checkpoint} -> {out} (load it with from_pretrained, or serve it as model.path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
