"""What produced a run, kept in its directory: written by learner rank 0 at start (``learner/main.py``).

    {training.output_dir}/run_config.yaml   the resolved config: every key, defaults included, in YAML that
                                            ``--config`` takes back (the derived values sit in its header
                                            comment: load_config recomputes them and refuses them as keys)
    {training.output_dir}/run_info.json     seeds and the rules that spread them, rollout and evaluation
                                            decoding, world size, derived values, model and data provenance
                                            (``tandem_build.json``, ``manifest.json``), the image size in use
                                            (``image_pixels``: data.min/max_pixels over the model's), package
                                            versions, git commit, start time (UTC)

A fresh start makes the run id (``run_id``, uuid4 hex; ``common/runs/checkpoints.py``); resumes keep it and
never rewrite the first start's files: ``run_config.yaml`` is written once, and every resume appends
one entry to ``run_info.json``'s ``resumes`` list (its own versions, world size, git commit, the step
it resumed from, and ``config_changes``: the keys whose value differs from ``run_config.yaml``).
A fresh start never meets another run's record (``common/runs/output_dir.py`` refuses the directory or moves
that run aside first); if it did, it would rename the earlier record to ``*.replaced-<its start
time>.*`` rather than overwrite it.

``rollout_server.auth_token`` is never written (set to null, listed under ``redacted``): a run directory
gets copied around; a bearer token should not travel with it.

What this module does not know: torch (versions come from package metadata), ranks (the caller writes
on rank 0 only), or how training uses any of these values.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import uuid
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from common.config.load import to_dict

log = logging.getLogger(__name__)

CONFIG_FILE = "run_config.yaml"
INFO_FILE = "run_info.json"
REPO_ROOT = Path(__file__).resolve().parents[1]

#: How every process turns ``training.seed`` into its own randomness (mirrors the code named in each rule).
SEEDING_RULES = {
    "learner": "torch.manual_seed(training.seed) on every rank at start (learner/rank.py); a resume "
               "restores each rank's python/numpy/torch RNG states from the checkpoint's rng_rank<r>.pt",
    "channel_a_order": "torch DistributedSampler(num_replicas=world_size, rank, shuffle=True, "
                       "seed=training.seed, drop_last=True).set_epoch(epoch) (learner/data.py)",
    "channel_b_stream": "numpy default_rng(stream_seed) permutation of the actor's shard per epoch, stream_seed = "
                        "first 8 bytes (little endian) of sha256('tandem/channel-b/{seed}/{rank}/{index}/{epoch}') "
                        "(actor/stream.py)",
    "rollout_sampling": "per /infer batch: first 4 bytes (little endian) & 0x7FFFFFFF of "
                        "sha256('tandem/rollout/{seed}/' + '|'.join(sample keys)) (actor/pipeline.py)",
}


def start_run(cfg: Any, world_size: int) -> str | None:
    """Rank 0, before anything else is written: why this start is refused (bad records under
    ``data.on_bad_record: fail``, common/data/check.py; ``common/runs/output_dir.py``: exit 2), or None once the record
    of this start (fresh or resumed) is kept; ``training.overwrite`` moves an old run aside."""
    from common.runs.checkpoints import checkpoint_run_id, resolve_resume_checkpoint
    from common.data.check import start_problems
    from common.runs.output_dir import StartRefused, prepare_start

    try:
        prepare_start(cfg, move=False)  # the run directory's refusals first: they need no data
        if problems := start_problems(cfg):  # before an old run is moved aside (training.overwrite) or torch imported
            return "bad training data:\n" + "\n".join(f"  - {p}" for p in problems)
        prepare_start(cfg)
    except StartRefused as exc:
        return str(exc)
    ckpt = resolve_resume_checkpoint(cfg.training.resume, cfg.training.output_dir)
    write_run_record(cfg, cfg.training.output_dir, world_size=world_size, resumed_from_step=_step_of(ckpt),
                     run_id=checkpoint_run_id(ckpt) if ckpt is not None else None)
    return None


def write_run_record(cfg: Any, output_dir: str | Path, *, world_size: int,
                     resumed_from_step: int | None, run_id: str | None = None) -> dict[str, Any]:
    """Write (fresh start) or extend (resume) the run record; returns this start's ``run_info`` entry.

    ``run_id``: on a resume into a directory without a run record, the resumed checkpoint's run id.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_path, info_path = out / CONFIG_FILE, out / INFO_FILE
    entry = run_info(cfg, world_size=world_size, resumed_from_step=resumed_from_step)
    resolved = config_dict(cfg)
    if resumed_from_step is None:
        _set_aside_earlier_record(config_path, info_path)
        entry = {"run_id": uuid.uuid4().hex, **entry}
        _write_atomic(config_path, config_yaml(cfg))
        _write_atomic(info_path, json.dumps({**entry, "resumes": []}, indent=1, default=str) + "\n")
        return entry
    if config_path.exists():
        first = yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}
        entry["config_changes"] = config_changes(first, resolved)
    else:  # the first start predates run records: this start's config is the best there is
        _write_atomic(config_path, config_yaml(cfg))
        entry["config_changes"] = {}
        entry["note"] = f"{CONFIG_FILE} written at this resume: the run's first start left none"
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        info = None
    if not isinstance(info, dict):
        info = {"run_id": run_id, **entry, "resumes": []}
    else:
        info.setdefault("resumes", []).append(entry)
    _write_atomic(info_path, json.dumps(info, indent=1, default=str) + "\n")
    return entry


def _step_of(ckpt: Path | None) -> int | None:
    """Optimizer steps done in a checkpoint (None: no checkpoint, a fresh start)."""
    if ckpt is None:
        return None
    try:
        return int(json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8"))["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return int(ckpt.name) if ckpt.name.isdigit() else 0


# --------------------------------------------------------------------------------------------- contents


def config_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data with YAML key names, without ``derived`` and without secrets."""
    data = to_dict(cfg)
    data.pop("derived", None)
    if (data.get("rollout_server") or {}).get("auth_token"):
        data["rollout_server"]["auth_token"] = None
    return data


def config_yaml(cfg: Any) -> str:
    """``run_config.yaml``: a header comment with the derived values, then the config."""
    derived = to_dict(cfg.derived) if getattr(cfg, "derived", None) is not None else {}
    header = [
        "# tandem run config: the resolved configuration of this run, every key (defaults included).",
        "# Start the same run with: --config run_config.yaml",
    ]
    if getattr(cfg.rollout_server, "auth_token", None):
        header.append("# rollout_server.auth_token was set and is not written here: set it again.")
    header.append("# Derived at start (recomputed from the keys below and the world size; not keys):")
    header += [f"#   {k}: {v}" for k, v in derived.items()]
    body = yaml.safe_dump(config_dict(cfg), sort_keys=False, allow_unicode=True, default_flow_style=False)
    return "\n".join(header) + "\n" + body


def run_info(cfg: Any, *, world_size: int, resumed_from_step: int | None) -> dict[str, Any]:
    """This start's facts (the top level of ``run_info.json``, or one entry of its ``resumes``)."""
    dec = cfg.rollout_matching.decoding
    info: dict[str, Any] = {
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "run_name": cfg.run_name,
        "resumed_from_step": resumed_from_step,
        "resume": cfg.training.resume,
        "world_size": world_size,
        "derived": to_dict(cfg.derived) if getattr(cfg, "derived", None) is not None else None,
        "seeds": {"training.seed": cfg.training.seed, "rules": SEEDING_RULES},
        "decoding": {
            "rollout": {k: getattr(dec, k) for k in ("temperature", "top_p", "top_k", "max_new_tokens",
                                                     "repetition_penalty")},
            "eval": {"greedy": True, "temperature": 0.0, "max_new_tokens": dec.max_new_tokens,
                     "enabled": bool(cfg.data.val_jsonl)},
        },
        "model": {"path": cfg.model.path, "abs_path": _abs(cfg.model.path),
                  "tandem_build": _read_json(Path(cfg.model.path) / "tandem_build.json")},
        "data": _data_info(cfg.data),
        "image_pixels": _image_pixels(cfg),
        "versions": {"python": platform.python_version(),
                     **{name: _version(name) for name in ("torch", "transformers", "tandem")}},
        "git": _git(),
        "host": platform.node(),
    }
    if getattr(cfg.rollout_server, "auth_token", None):
        info["redacted"] = ["rollout_server.auth_token"]
    return info


def config_changes(first: dict[str, Any], now: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Dotted keys whose value differs between two config dicts: ``{key: {"first": a, "now": b}}``."""
    a, b = _flatten(first), _flatten(now)
    return {k: {"first": a.get(k), "now": b.get(k)} for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _image_pixels(cfg: Any) -> dict[str, Any] | None:
    """What images are resized with: data.min_pixels / data.max_pixels over model.path's own (common/data/image_size.py)."""
    from common.data.image_size import ImageSizeError, resolve

    try:
        pixels = resolve(cfg.model.path, cfg.data.min_pixels, cfg.data.max_pixels)
    except ImageSizeError:  # the config check refused it already; the encoder raises it with the fix
        return None
    if pixels is None:
        return None
    return {**pixels.as_dict(), "data.min_pixels": cfg.data.min_pixels, "data.max_pixels": cfg.data.max_pixels}


def _data_info(data: Any) -> dict[str, Any]:
    """The data paths and, per directory holding one, the ``manifest.json`` parameters (``common.data.synthetic``)."""
    paths = {"train_jsonl": data.train_jsonl, "val_jsonl": data.val_jsonl, "image_root": data.image_root}
    manifests = {}
    for p in (data.train_jsonl, data.val_jsonl):
        if p:
            d = Path(p).parent
            manifest = _read_json(d / "manifest.json")
            if manifest is not None:
                manifests[str(d)] = manifest.get("params", manifest) if isinstance(manifest, dict) else manifest
    return {**paths, "manifests": manifests}


def _read_json(path: Path) -> Any:
    """A small JSON file's content; None when absent, the error text when unreadable."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"unreadable: {exc}"


def _abs(path: str) -> str:
    return str(Path(path).resolve())


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git() -> dict[str, Any] | None:
    """The repo's commit and whether tracked files differ from it; None outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return None
    try:
        dirty: bool | None = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        dirty = None
    return {"commit": commit, "dirty": dirty}


def _set_aside_earlier_record(config_path: Path, info_path: Path) -> None:
    """A fresh start into a used directory: rename the earlier record, never overwrite it."""
    if not config_path.exists() and not info_path.exists():
        return
    earlier = _read_json(info_path)
    stamp = earlier.get("started_utc") if isinstance(earlier, dict) else None
    stamp = str(stamp or datetime.now(timezone.utc).isoformat(timespec="seconds")).replace(":", "")
    for path in (config_path, info_path):
        if path.exists():
            aside = path.with_name(f"{path.stem}.replaced-{stamp}{path.suffix}")
            os.replace(path, aside)
            log.warning("fresh start in %s: the earlier run's %s kept as %s", path.parent, path.name, aside.name)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
