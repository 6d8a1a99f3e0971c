"""Checkpoints: everything a resumed run needs to continue the same A/B sequence and data streams.

Layout (``{training.output_dir}/checkpoints/<global_step>/``; every rank writes there, so a multi-node
run needs it on a filesystem every node shares)::

    learner.parallel: ddp (and one process)
    model/                     HF model directory (save_pretrained: config + safetensors, tied weights
                               once) plus the tokenizer/processor files of model.path: servable as is,
                               and what a resumed learner loads its weights from
    optimizer.pt               AdamW state (replicated under DDP: rank 0 writes it, every rank reads it)
    adapter/                   model.adapter only: the peft adapter (adapter_config.json, adapter_model.safetensors;
                               learner/recipe.py); model/ then holds the base weights it adapts, and a resumed
                               learner injects the adapter into model/ and loads this into it

    learner.parallel: fsdp (the whole model is never gathered on one device)
    dcp/                       weights + AdamW state, sharded: torch.distributed.checkpoint (.metadata +
                               __<rank>_0.distcp, each rank its own shards); keys model.<HF name>,
                               optim.state.<HF name>.<step|exp_avg|exp_avg_sq>, optim.param_groups (with
                               model.adapter the names are the injected tree's: <layer>.base_layer.weight,
                               <layer>.lora_A.default.weight, ...: the base and the adapter both, what resume loads)
    model_config/              config.json, generation_config.json and the tokenizer/processor files of
                               model.path: the HF directory minus its weights (``python -m learner.export``
                               adds them from dcp/ to make a servable directory)
    adapter/                   model.adapter only: the adapter gathered whole, as under ddp (peft's layout; small):
                               what ``learner.export --adapter-only`` copies and a resumed learner's config is
                               checked against; resume reads the adapter's values from dcp/ (the same tensors)

    either
    scheduler.pt               LR scheduler state
    trainer_state.json         run_id (the run that wrote it: ``auto`` resume takes only its own run's),
                               global_step, ver, counters (steps, skips, syncs), world_size, parallel
                               (ddp | fsdp), model_path (the run's model.path)
    rank<r>.json               rank r: Channel-A sampler position + carry, queue counters, forward counts
    rng_rank<r>.pt             rank r: python, numpy, torch (and CUDA) RNG states
    b_ledger_rank<r>.json      rank r: {"rank": r, "trained_ids": [B sample ids trained so far]}
                               read by the learner (duplicate guard) and the actor (common/runs/checkpoints.py
                               read_b_ledger: its stream skips these keys on resume)

Why DCP and not a hand-written gather: ``torch.distributed.checkpoint`` writes each rank's shards in
parallel with no rank holding more than its own, records the global shape of every tensor, and
reshards on load: the same ``dcp/`` loads into FSDP2 shards (``get_state_dict``/``set_state_dict``
with sharded state dicts), into a DDP or one-process model (every rank reads whole tensors), and on
the CPU with no process group at all (export). A gather to rank 0 would put a 7B model plus its
AdamW state (~16 bytes a parameter) in one process, and resharding would be ours to write.

What loads which (:func:`load`): a ``dcp/`` checkpoint restores weights and optimizer into the
sharded model (fsdp) or the plain one (ddp, one process); a ``model/`` checkpoint's weights come from
``from_pretrained`` (learner/rank.py, before wrapping) and its ``optimizer.pt`` is loaded here, into
a DDP model as it is, into an FSDP2 model by sharding each rank's full copy. The world-size check
holds for every pair: per-rank data streams and B ledgers must line up, whatever the sharding.

Write protocol: every rank writes into ``checkpoints/.tmp-<step>``; barrier; rank 0 renames it to
``checkpoints/<step>``; barrier. A crash mid-write leaves only the dot-directory, which ``auto``
resume ignores (it takes the highest integer directory of the run's own run id).

Retention (``training.save_total_limit``, ``training.keep_best``): after save() returns on every rank, rank 0
alone deletes the checkpoints the rule drops (``learner/checkpointer.py``, common/runs/retention.py); no other
rank reads an older checkpoint, so nothing waits for it.

What this module does not know: when a checkpoint is due or what the learner's state means
(``learner/checkpointer.py`` decides both and restores it).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)

from common.runs.checkpoints import checkpoints_root, read_b_ledger, write_b_ledger
from learner.distributed import Dist
from learner.parallel import is_fsdp
from learner.recipe import ADAPTER_DIR, adapter_state, base_state, has_adapter, save_adapter
from learner.weight_sync.served import unwrap

log = logging.getLogger(__name__)

DCP_DIR = "dcp"  # fsdp: the sharded weights + AdamW state
MODEL_CONFIG_DIR = "model_config"  # fsdp: the HF directory minus its weights

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
    """Write checkpoint ``step`` (every rank calls this at the same boundary); returns its directory.

    ``model``: as trained (DDP-wrapped, FSDP2-sharded or plain); a sharded one is written to ``dcp/``.
    """
    root = checkpoints_root(output_dir)
    tmp, final = root / f".tmp-{step}", root / str(step)
    sharded = is_fsdp(model)
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(f"checkpoint {step}: directory created")
    r = dist.rank
    (tmp / f"rank{r}.json").write_text(json.dumps(rank_state, indent=1))
    write_b_ledger(tmp, r, trained_ids)
    torch.save(rng_state(), tmp / f"rng_rank{r}.pt")
    hf = unwrap(model)
    adapter = None
    if sharded:  # every rank: its own shards (DCP's plan exchange is a collective)
        _dcp(dist, f"checkpoint {step}: writing the sharded weights and AdamW state to {tmp / DCP_DIR}",
             lambda: dcp.save(_dcp_state(model, optimizer), checkpoint_id=tmp / DCP_DIR))
        if has_adapter(hf):  # gathered whole on every rank (small), written by rank 0 in peft's layout
            adapter = adapter_state(hf)
    if dist.is_main:
        if sharded:
            save_model_config(hf, Path(model_path), tmp / MODEL_CONFIG_DIR)
            if adapter is not None:
                save_adapter(hf, tmp / ADAPTER_DIR, adapter)
        else:
            if has_adapter(hf):  # model/ stays a plain HF directory of the base weights; the adapter beside it
                hf.save_pretrained(tmp / "model", state_dict=base_state(hf))
                save_adapter(hf, tmp / ADAPTER_DIR)
            else:
                hf.save_pretrained(tmp / "model")
            copy_model_side_files(Path(model_path), tmp / "model")
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "trainer_state.json").write_text(json.dumps({
            **trainer_state, "world_size": dist.world_size, "parallel": "fsdp" if sharded else "ddp",
            "model_path": str(model_path)}, indent=1))
    dist.barrier(f"checkpoint {step}: every rank wrote its files")
    if dist.is_main:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        log.info("checkpoint %s written", final)
    dist.barrier(f"checkpoint {step}: renamed into place")
    return final


def save_model_config(hf: torch.nn.Module, model_path: Path, dst: Path) -> None:
    """``dst``: the HF directory of ``hf`` without its weights (config, generation config, tokenizer, processor)."""
    dst.mkdir(parents=True)
    hf.config.save_pretrained(dst)
    if getattr(hf, "generation_config", None) is not None:
        hf.generation_config.save_pretrained(dst)
    copy_model_side_files(model_path, dst)


def load(
    ckpt: Path, dist: Dist, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
    """Restore optimizer/scheduler/RNG (and a ``dcp/`` checkpoint's weights) in place; return (trainer_state,
    this rank's state, B ledger). Every rank calls it (loading ``dcp/`` is a collective).

    ``model``: as trained (DDP-wrapped, FSDP2-sharded or plain), ``optimizer`` built over it. A ``model/``
    checkpoint's weights are not loaded here: the caller loads them with ``from_pretrained`` (transformers
    maps its saved key names back, which a raw state-dict load would not) before building the optimizer.
    """
    state = json.loads((ckpt / "trainer_state.json").read_text())
    if state.get("world_size") != dist.world_size:
        raise ValueError(
            f"checkpoint {ckpt} was written by {state.get('world_size')} learner ranks, this run has {dist.world_size}: "
            "per-rank data streams and B ledgers would not line up. Fix: resume with the same --nproc_per_node, "
            "or start fresh (training.resume: null) from its weights as model.path (a dcp/ checkpoint: "
            f"python -m learner.export --checkpoint {ckpt} --out DIR first)"
        )
    if (ckpt / DCP_DIR).is_dir():
        _dcp(dist, f"resume: reading the weights and AdamW state of {ckpt / DCP_DIR}",
             lambda: _load_dcp(ckpt / DCP_DIR, model, optimizer))
    else:
        full = torch.load(ckpt / "optimizer.pt", map_location=_device_of(optimizer))
        if is_fsdp(model):
            _shard_full_optimizer_state(model, optimizer, full)
        else:
            optimizer.load_state_dict(full)
    scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt"))
    r = dist.rank
    rank_state = json.loads((ckpt / f"rank{r}.json").read_text())
    set_rng_state(torch.load(ckpt / f"rng_rank{r}.pt", weights_only=False))  # our own file, written by save()
    return state, rank_state, read_b_ledger(ckpt, r)


# -- the sharded (DCP) part ---------------------------------------------------------------------


def _dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """{"model": ..., "optim": ...} keyed by HF names: DTensor shards under FSDP2, whole tensors otherwise
    (``get_state_dict`` first gives a fresh AdamW its state, so there is something to load into)."""
    msd, osd = get_state_dict(unwrap(model), optimizer)
    return {"model": msd, "optim": osd}


def _load_dcp(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    state = _dcp_state(model, optimizer)
    dcp.load(state, checkpoint_id=path)  # each rank reads what its tensors cover: its shards, or whole tensors
    set_state_dict(unwrap(model), optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _shard_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, full: dict[str, Any]) -> None:
    """A DDP checkpoint's ``optimizer.pt`` (keyed by parameter index) into an FSDP2 model's optimizer: re-keyed
    by HF name (``build_optimizer``'s order: its parameter groups in turn, learner/recipe.py), then each
    rank keeps its shard of every tensor (``set_optimizer_state_dict`` with a full state dict)."""
    name_of = {id(p): n for n, p in unwrap(model).named_parameters()}
    names = [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]
    by_name = {
        "state": {names[i]: s for i, s in full["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in full["param_groups"]],
    }
    set_optimizer_state_dict(unwrap(model), optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _dcp(dist: Dist, what: str, fn: Callable[[], None]) -> None:
    """Run a DCP save or load; a failure names what it was doing on which rank and the likely causes."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - DCP wraps every rank's error in its own types; re-raised with context
        raise RuntimeError(
            f"{dist.where}: {what} failed: {err}. Likely causes: another rank died or timed out "
            f"(learner.collective_timeout_s={dist.timeout_s:.0f}s, see its log); the disk is full, or the "
            "checkpoint directory is not on a filesystem every rank shares; on resume, a checkpoint of another "
            "model than model.path (a missing key)"
        ) from err


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    return next(p.device for g in optimizer.param_groups for p in g["params"])
