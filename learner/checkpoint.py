"""Checkpoints: everything a resumed run needs to continue the same A/B sequence and data streams.

Layout (``{training.output_dir}/checkpoints/<global_step>/``; single node: every rank writes there)::

    model/                     HF model directory (save_pretrained: config + safetensors, tied weights
                               once) plus the tokenizer/processor files of model.path: servable as is,
                               and what a resumed learner loads its weights from
    optimizer.pt               AdamW state (replicated under DDP: rank 0 writes it, every rank reads it)
    scheduler.pt               LR scheduler state
    trainer_state.json         run_id (the run that wrote it: ``auto`` resume takes only its own run's),
                               global_step, ver, counters (steps, skips, syncs), world_size
    rank<r>.json               rank r: Channel-A sampler position + carry, queue counters, forward counts
    rng_rank<r>.pt             rank r: python, numpy, torch (and CUDA) RNG states
    b_ledger_rank<r>.json      rank r: {"rank": r, "trained_ids": [B sample ids trained so far]}
                               read by the learner (duplicate guard) and the actor (common/checkpoints.py
                               read_b_ledger: its stream skips these keys on resume)

Write protocol: every rank writes into ``checkpoints/.tmp-<step>``; barrier; rank 0 renames it to
``checkpoints/<step>``; barrier. A crash mid-write leaves only the dot-directory, which ``auto``
resume ignores (it takes the highest integer directory of the run's own run id).

Queues are not checkpointed: packs waiting at save time are re-produced by the actors after a
resume (their keys are not in the ledger). The saved queue counters therefore drop ``in_queue`` and
``reserved`` from ``received``, so the conservation identity still holds after a resume.

What this module does not know: how the state is used (train.py restores it).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.checkpoints import checkpoints_root, read_b_ledger, write_b_ledger
from learner.distributed import Dist
from learner.sync.boundary import unwrap

log = logging.getLogger(__name__)

_MODEL_SIDE_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "config.json",
                     "generation_config.json", "tandem_build.json")


def copy_model_side_files(src: Path, dst: Path) -> None:
    """Copy ``src``'s tokenizer, chat template and processor files into the saved model ``dst`` (its weights,
    config and build record are ``dst``'s own), so ``dst`` is servable and loadable as is."""
    for f in Path(src).iterdir():
        if f.is_file() and f.name not in _MODEL_SIDE_FILES and not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(
    output_dir: str | Path,
    step: int,
    dist: Dist,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    model_path: str,
    trainer_state: dict[str, Any],
    rank_state: dict[str, Any],
    trained_ids: set[str],
) -> Path:
    """Write checkpoint ``step`` (every rank calls this at the same boundary); returns its directory."""
    root = checkpoints_root(output_dir)
    tmp, final = root / f".tmp-{step}", root / str(step)
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(f"checkpoint {step}: directory created")
    r = dist.rank
    (tmp / f"rank{r}.json").write_text(json.dumps(rank_state, indent=1))
    write_b_ledger(tmp, r, trained_ids)
    torch.save(rng_state(), tmp / f"rng_rank{r}.pt")
    if dist.is_main:
        hf = unwrap(model)
        hf.save_pretrained(tmp / "model")
        copy_model_side_files(Path(model_path), tmp / "model")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "trainer_state.json").write_text(json.dumps({**trainer_state, "world_size": dist.world_size}, indent=1))
    dist.barrier(f"checkpoint {step}: every rank wrote its files")
    if dist.is_main:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        log.info("checkpoint %s written", final)
    dist.barrier(f"checkpoint {step}: renamed into place")
    return final


def load(
    ckpt: Path, dist: Dist, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
    """Restore optimizer/scheduler/RNG in place; return (trainer_state, this rank's state, B ledger).

    The weights are not loaded here: the caller loads the model from ``ckpt/model`` with
    ``from_pretrained`` (transformers maps its saved key names back, which a raw state-dict load
    would not), before building the optimizer whose state this restores.
    """
    state = json.loads((ckpt / "trainer_state.json").read_text())
    if state.get("world_size") != dist.world_size:
        raise ValueError(
            f"checkpoint {ckpt} was written by {state.get('world_size')} learner ranks, this run has {dist.world_size}: "
            "per-rank data streams and B ledgers would not line up. Fix: resume with the same --nproc_per_node, "
            "or start fresh (training.resume: null) from its model/ directory as model.path"
        )
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location=next(model.parameters()).device))
    scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt"))
    r = dist.rank
    rank_state = json.loads((ckpt / f"rank{r}.json").read_text())
    set_rng_state(torch.load(ckpt / f"rng_rank{r}.pt", weights_only=False))  # our own file, written by save()
    return state, rank_state, read_b_ledger(ckpt, r)
