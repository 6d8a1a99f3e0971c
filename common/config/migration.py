"""Keys a config may not hold, each with what to write instead: retired tandem keys and sections (fields that
took one value only among them), and the origin's key paths.

:mod:`common.config.load` asks :func:`key_problems` about every key before it looks the key up in the
schema, so a config written for the origin trainer (``custom.extra.rollout_matching.*``,
``custom.trainer_variant``) fails with one line per key naming the tandem key it maps to, not a generic
"unknown key custom".

Example: ``custom: {extra: {rollout_matching: {temperature: 0.7}}}`` →
``custom.extra.rollout_matching.temperature = 0.7: the origin trainer's key path. Fix: write it as
rollout_matching.decoding.temperature``.

What this module does not know: YAML, the cross-field rules, or how a value is used.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from common.config.schema import Config

#: Keys that used to exist: (dotted key) -> fix.
RETIRED_KEYS = {
    "stage2_ab.schedule.pattern": "remove it and set stage2_ab.schedule.b_ratio (e.g. pattern [A, B] → b_ratio: 0.5)",
    "rollout_matching.temperature": "move it to rollout_matching.decoding.temperature",
    "rollout_matching.top_p": "move it to rollout_matching.decoding.top_p",
    "rollout_matching.top_k": "move it to rollout_matching.decoding.top_k",
    "rollout_matching.rollout_buffer": "remove it: rollout reuse is gone; async prefetch "
    "(stage2_ab.channel_b.mode: async) replaces it",
    "rollout_matching.max_new_tokens": "move it to rollout_matching.decoding.max_new_tokens",
    "training.packing_length": "remove it: packing_length is training.global_max_length",
    "training.tensorboard": "write training.report_to: [tensorboard] instead of true (it also takes wandb and "
    "mlflow); remove it where it was false",
    # fields that took one value only
    "rollout_matching.rollout_backend": "remove it: rollouts always come from tandem rollout servers "
    "(rollout_matching.vllm.servers), whatever their engine; for transformers generation (the origin's hf) set "
    "rollout_server.engine: hf (in-learner generation is not implemented)",
    "rollout_matching.vllm.mode": "remove it: rollouts always come from dedicated rollout servers (vLLM colocated "
    "inside the learner is not implemented); on a box with one GPU, share it (learner.share_gpus_with_server: true, "
    "a low rollout_server.gpu_memory_utilization)",
    "rollout_matching.vllm.sync.mode": "remove it: every sync pushes the whole served model (model.adapter.sync: "
    "adapter sends the adapter alone)",
    # weight sync in one section
    "rollout_matching.vllm.sync.transport": "move it to weight_sync.transport",
    "rollout_matching.vllm.sync.bucket_mb": "move it to weight_sync.bucket_mb",
    "rollout_matching.vllm.sync.timeout_s": "move it to weight_sync.timeout_s",
    "rollout_matching.vllm.sync.fence": "move it to weight_sync.fence",
    "rollout_matching.vllm.sync.master_addr": "move it to weight_sync.master_addr",
    "stage2_ab.channel_b.async.sync_mode": "move it to weight_sync.mode",
    "stage2_ab.channel_b.async.sync_every_steps": "move it to weight_sync.every_steps",
}

#: Sections that used to exist: (dotted section) -> the section its keys moved to. Each key below one gets its
#: own line: its entry in RETIRED_KEYS, or a pointer to the new section.
RETIRED_SECTIONS = {"rollout_matching.vllm.sync": "weight_sync"}

#: The origin's ``custom`` section: its sub-key -> the tandem key it became (None: no tandem key).
ORIGIN_KEYS = {
    "custom.trainer_variant": None,  # tandem's learner is the stage2_ab trainer; Stage-1 is learner.warm_start
}
ORIGIN_PREFIX = "custom.extra."  # custom.extra.<tandem key>: the origin nested the run's keys here


def key_problems(dotted: str, value: Any) -> list[tuple[str, Any, str, str]] | None:
    """``[(key, value, problem, fix), ...]`` if ``dotted`` may not appear in a config, None if it may.

    The origin's ``custom`` tree gets one entry per leaf below it, each naming the tandem key it maps to.
    """
    if dotted in RETIRED_KEYS:
        return [(dotted, value, "this key is no longer supported", RETIRED_KEYS[dotted])]
    if dotted in RETIRED_SECTIONS:
        moved = f"move it under {RETIRED_SECTIONS[dotted]} (docs/config.md lists its keys)"
        return [(key, v, "this key is no longer supported", RETIRED_KEYS.get(key, moved))
                for key, v in _leaves(value, dotted)]
    if dotted != "custom":
        return None
    return [(key, v, "the origin trainer's key path, not tandem's", _origin_fix(key, v))
            for key, v in _leaves(value, dotted)]


def _origin_fix(key: str, value: Any) -> str:
    if key == "custom.trainer_variant":
        return ("remove it: tandem's learner is the Stage-2 AB trainer (python -m launcher, learner/main.py); "
                "the Stage-1 warm start is python -m learner.warm_start")
    if key in ORIGIN_KEYS:
        return "remove it: it has no tandem equivalent (docs/config.md lists every key)"
    if key.startswith(ORIGIN_PREFIX):
        target = key[len(ORIGIN_PREFIX):]
        parts = target.split(".")
        for retired in (".".join(parts[:n]) for n in range(1, len(parts) + 1)):
            if retired in RETIRED_KEYS:
                return f"its tandem path {retired} is retired too: {RETIRED_KEYS[retired]}"
        for section, moved_to in RETIRED_SECTIONS.items():
            if target.startswith(section + "."):
                return f"its tandem path {target} is retired too: move it under {moved_to}"
        if _schema_has(target):
            return f"write it as {target}"
    return "remove it: it has no tandem equivalent (docs/config.md lists every key)"


def _leaves(value: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{prefix}.{k}")]
    return [(prefix, value)]


def _schema_has(dotted: str) -> bool:
    """Whether ``dotted`` names a field of :class:`Config` (a section or a leaf)."""
    cls: Any = Config
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        hints = typing.get_type_hints(cls)
        by_key = {f.metadata.get("key", f.name): f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
        if part not in by_key:
            return False
        cls = hints[by_key[part].name]
        if typing.get_origin(cls) is list:
            cls = typing.get_args(cls)[0]
    return True
