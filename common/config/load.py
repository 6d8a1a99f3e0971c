"""Loading and validating the configuration: every process reads one YAML and takes its own part.

The schema (one dataclass per section, documented field by field) is :mod:`common.config.schema`; a section
with rules of its own keeps its dataclass and its rules in one module beside it (``common/config/server.py``,
``data.py``, ``learner.py``, ``run.py``, ``recipe.py``, ``weight_sync.py``). Load with :func:`load_config` (YAML +
OmegaConf dotted ``key=value`` overrides). Validation runs once and reports **every** problem together in one
:class:`ConfigError`, each naming the dotted key, the offending value and the fix.
``docs/config.md`` is generated from the field docs (``python -m common.config.docs --markdown``,
:mod:`common.config.docs`).

What this module does not know: torch, processes, or how a value is used beyond its rule.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

from common.config.schema import ServerEndpoint, Config, Derived
from common.config.migration import key_problems
from common.config.learner import check_learner_rules
from common.config.server import check_server_rules
from common.config.data import check_data_rules
from common.config.run import check_run_rules
from common.config.recipe import check_recipe_rules
from common.config.weight_sync import check_weight_sync_rules
from common.packing.schedule import exact_ratio

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------- errors


class ConfigError(ValueError):
    """Every problem found in a config, one per line: ``key = value: problem. Fix: ...``."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in {source}:\n{lines}")


class _Problems(list):
    def add(self, key: str, value: Any, problem: str, fix: str) -> None:
        self.append(f"{key} = {value!r}: {problem}. Fix: {fix}")


_MISSING_VALUE = "<missing>"


# --------------------------------------------------------------------------------------------- building


def _yaml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check/coerce a scalar against an annotation; returns (ok, coerced)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin is Literal:
        return (value in typing.get_args(tp)), value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None) and value is None:
                return True, None
        for arg in typing.get_args(tp):
            if arg is not type(None):
                ok, coerced = _type_ok(value, arg)
                if ok:
                    return True, coerced
        return False, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return (isinstance(value, int) and not isinstance(value, bool)), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    return False, value


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _build(cls: type, data: Any, prefix: str, problems: _Problems) -> Any:
    """Build dataclass ``cls`` from a plain dict, collecting every problem instead of stopping."""
    if not isinstance(data, dict):
        problems.add(prefix or "<root>", data, "expected a mapping", f"write {prefix or 'the file'} as key: value pairs")
        return None
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
    by_key = {_yaml_key(f): f for f in fields}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if (retired := key_problems(dotted, value)) is not None:  # retired keys, the origin's key paths
            for args in retired:
                problems.add(*args)
            continue
        if key not in by_key:
            close = difflib.get_close_matches(str(key), list(by_key), n=1)
            hint = f"did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else (
                f"remove it (known keys here: {', '.join(sorted(by_key))})"
            )
            problems.add(dotted, value, "unknown key", hint)
            continue
        f = by_key[key]
        kwargs[f.name] = _convert(hints[f.name], value, dotted, problems)
    for f in fields:
        if f.name in kwargs:
            continue
        dotted = f"{prefix}.{_yaml_key(f)}" if prefix else _yaml_key(f)
        if f.metadata.get("required") and dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], {}, dotted, problems)  # names the inner required keys
        elif f.metadata.get("required"):
            problems.add(dotted, _MISSING_VALUE, "required key is missing", f"set {dotted} ({f.metadata['doc']})")
            kwargs[f.name] = None
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            try:
                kwargs[f.name] = f.default_factory()  # type: ignore[misc]
            except TypeError:
                kwargs[f.name] = None
            sub = hints[f.name]
            if dataclasses.is_dataclass(sub):
                kwargs[f.name] = _build(sub, {}, dotted, problems)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, dotted: str, problems: _Problems) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, dotted, problems)
    if origin in (typing.Union, types.UnionType) and value is not None:
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and typing.get_origin(inner[0]) is list:
            return _convert(inner[0], value, dotted, problems)
        for arg in inner:  # an optional section (a mapping) or a str-or-list key given as a list
            if (dataclasses.is_dataclass(arg) and isinstance(value, dict)) or (
                    typing.get_origin(arg) is list and isinstance(value, list)):
                return _convert(arg, value, dotted, problems)
    if origin is list:
        if not isinstance(value, list):
            problems.add(dotted, value, f"expected a list of {_describe(args[0])}", f"write {dotted} as a YAML list")
            return []
        return [_convert(args[0], v, f"{dotted}[{i}]", problems) for i, v in enumerate(value)]
    ok, coerced = _type_ok(value, tp)
    if not ok:
        problems.add(dotted, value, f"expected {_describe(tp)}", f"set {dotted} to {_describe(tp)}")
        return value
    return coerced


# --------------------------------------------------------------------------------------------- rules


def _check_rules(cfg: Config, problems: _Problems, world_size: int | None) -> None:
    """Semantic fail-fast rules across fields (types are already checked); docs/config.md lists the keys."""
    t, ab, rm, srv = cfg.training, cfg.stage2_ab, cfg.rollout_matching, cfg.rollout_server
    cb = ab.channel_b
    a = cb.async_

    def positive(key: str, value: Any, minimum: float = 1) -> None:
        if isinstance(value, (int, float)) and value < minimum:
            problems.add(key, value, f"must be ≥ {minimum}", f"set {key} to at least {minimum}")

    b = ab.schedule.b_ratio
    if b is not None and isinstance(b, (int, float)):
        if not (0.0 <= b <= 1.0) or math.isnan(b):
            problems.add("stage2_ab.schedule.b_ratio", b, "outside [0, 1]", "use a share of steps between 0.0 and 1.0")

    if t.gradient_accumulation_steps is not None and t.effective_batch_size is not None:
        problems.add(
            "training.effective_batch_size", t.effective_batch_size,
            "set together with training.gradient_accumulation_steps",
            "keep one: GA is derived from effective_batch_size",
        )
    positive("training.per_device_train_batch_size", t.per_device_train_batch_size)
    positive("training.gradient_accumulation_steps", t.gradient_accumulation_steps)
    positive("training.effective_batch_size", t.effective_batch_size)
    positive("training.global_max_length", t.global_max_length, 16)
    positive("training.max_steps", t.max_steps, 0)
    if not t.packing:
        problems.add("training.packing", t.packing, "tandem trains packed rows only", "set training.packing: true")
    if isinstance(t.packing_min_fill_ratio, float) and not 0 <= t.packing_min_fill_ratio <= 1:
        problems.add("training.packing_min_fill_ratio", t.packing_min_fill_ratio, "outside [0, 1]", "use e.g. 0.65")

    dec = rm.decoding
    if isinstance(dec.temperature, float) and dec.temperature < 0:
        problems.add("rollout_matching.decoding.temperature", dec.temperature, "must be ≥ 0",
                     "use 0 for greedy or a small positive value such as 0.01")
    if isinstance(dec.top_p, float) and not 0 < dec.top_p <= 1:
        problems.add("rollout_matching.decoding.top_p", dec.top_p, "must be in (0, 1]", "use 1.0 (off) or e.g. 0.95")
    if isinstance(dec.top_k, int) and dec.top_k < -1:
        problems.add("rollout_matching.decoding.top_k", dec.top_k, "must be -1 (off) or ≥ 0", "use -1 to disable top-k")
    if isinstance(dec.repetition_penalty, float) and dec.repetition_penalty <= 0:
        problems.add("rollout_matching.decoding.repetition_penalty", dec.repetition_penalty, "must be > 0", "use 1.0 (off)")
    positive("rollout_matching.decoding.max_new_tokens", dec.max_new_tokens)
    if isinstance(rm.matching.gate, float) and not 0 <= rm.matching.gate <= 1:
        problems.add("rollout_matching.matching.gate", rm.matching.gate, "outside [0, 1]", "use an IoU such as 0.3")
    positive("rollout_matching.matching.candidate_top_k", rm.matching.candidate_top_k)

    # Every mode rolls out through rollout servers (common/config/migration.py refuses the origin's in-learner
    # generation and colocated vLLM with that fix).
    if cb.rollouts_per_step is not None and cb.mode != "step":
        problems.add("stage2_ab.channel_b.rollouts_per_step", cb.rollouts_per_step, f"only used by mode step, not {cb.mode}",
                     "remove it (async actors roll out what the credits ask for; micro: per_device × GA per B step)")
    if cfg.learner.pack_wait_s > 0 and cb.mode != "async":
        problems.add("learner.pack_wait_s", cfg.learner.pack_wait_s, f"only used by mode async, not {cb.mode}",
                     "remove it (step and micro roll out inside their own B steps)")
    if cb.enable_pipeline and cb.mode != "step":
        problems.add("stage2_ab.channel_b.enable_pipeline", True, f"only used by mode step, not {cb.mode}",
                     "remove it or set stage2_ab.channel_b.mode: step")
    if cb.mode in ("step", "micro") and world_size is not None and world_size > 1:
        problems.add("stage2_ab.channel_b.mode", cb.mode, f"{cb.mode} mode runs on one learner process, world_size is {world_size}",
                     "use stage2_ab.channel_b.mode: async for multi-GPU learners")
    lrn, sync_t = cfg.learner, cfg.weight_sync.timeout_s
    ranks = world_size if world_size is not None else lrn.nproc_per_node * lrn.nnodes
    if ranks > 1 and lrn.collective_timeout_s <= sync_t:  # checked here, before the launcher starts a server
        problems.add("learner.collective_timeout_s", lrn.collective_timeout_s,
                     f"must exceed weight_sync.timeout_s = {sync_t} with {ranks} learner ranks (the others wait at a "
                     "barrier while rank 0 pushes: every blocking sync, and in overlap mode the start-up sync and a "
                     "checkpoint's wait for the push in flight)", f"raise learner.collective_timeout_s above {sync_t}")
    positive("stage2_ab.channel_b.rollout_decode_batch_size", cb.rollout_decode_batch_size)
    positive("stage2_ab.channel_b.rollouts_per_step", cb.rollouts_per_step)
    positive("stage2_ab.channel_b.async.queue_limit", a.queue_limit)
    positive("stage2_ab.channel_b.async.prefetch_target_packs", a.prefetch_target_packs)
    positive("stage2_ab.channel_b.async.version_window", a.version_window, 0)
    if isinstance(a.prefetch_target_packs, int) and isinstance(a.queue_limit, int) and a.prefetch_target_packs > a.queue_limit:
        problems.add("stage2_ab.channel_b.async.prefetch_target_packs", a.prefetch_target_packs,
                     f"above queue_limit {a.queue_limit}: packs would be produced only to be dropped",
                     "lower prefetch_target_packs or raise queue_limit")
    if isinstance(cfg.transport.hwm, int) and isinstance(a.queue_limit, int) and cfg.transport.hwm < a.queue_limit:
        problems.add("transport.hwm", cfg.transport.hwm, f"below queue_limit {a.queue_limit}",
                     "set transport.hwm ≥ stage2_ab.channel_b.async.queue_limit")
    positive("training.eval_every_steps", t.eval_every_steps, 0)
    if isinstance(t.peak_tflops, (int, float)) and t.peak_tflops <= 0:
        problems.add("training.peak_tflops", t.peak_tflops, "must be > 0", "use null to measure it at start-up")
    if isinstance(t.max_train_seconds, (int, float)) and t.max_train_seconds <= 0:
        problems.add("training.max_train_seconds", t.max_train_seconds, "must be > 0", "use null for no time budget")
    positive("training.eval_max_images", t.eval_max_images)
    if isinstance(t.gradient_checkpointing_every, int) and t.gradient_checkpointing_every < 1:
        problems.add("training.gradient_checkpointing_every", t.gradient_checkpointing_every, "must be ≥ 1 (1 = every "
                     "layer)", "set training.gradient_checkpointing: false to checkpoint no layer")
    positive("data.num_records_checked_at_start", cfg.data.num_records_checked_at_start, 0)
    check_data_rules(cfg, problems)
    for key in ("desc_ce_weight", "bbox_smoothl1_weight", "bbox_ciou_weight", "coord_ce_weight"):
        v = getattr(ab, key)
        if isinstance(v, float) and v < 0:
            problems.add(f"stage2_ab.{key}", v, "must be ≥ 0", "use 0 to disable the term")
    if isinstance(ab.coord_temperature, float) and ab.coord_temperature <= 0:
        problems.add("stage2_ab.coord_temperature", ab.coord_temperature, "must be > 0", "use 1.0")
    if not rm.vllm.servers:
        problems.add("rollout_matching.vllm.servers", [], "no rollout server listed",
                     "add - base_url: http://127.0.0.1:8000")
    for i, s in enumerate(rm.vllm.servers):
        if isinstance(s, ServerEndpoint) and isinstance(s.base_url, str) and not s.base_url.startswith(("http://", "https://")):
            problems.add(f"rollout_matching.vllm.servers[{i}].base_url", s.base_url, "not an http(s) URL",
                         "write it as http://host:port")
    if srv.gpus and cfg.learner.gpus and set(srv.gpus) & set(cfg.learner.gpus) and not cfg.learner.share_gpus_with_server:
        problems.add("learner.gpus", cfg.learner.gpus, f"overlaps rollout_server.gpus {srv.gpus}",
                     "give the server and the learner disjoint GPU sets, or set learner.share_gpus_with_server: true")
    if srv.tensor_parallel_size and srv.gpus and len(srv.gpus) % srv.tensor_parallel_size:
        problems.add("rollout_server.tensor_parallel_size", srv.tensor_parallel_size,
                     f"does not divide len(rollout_server.gpus) = {len(srv.gpus)}", "make the GPU count a multiple of TP")
    if cfg.learner.gpus and cfg.learner.nproc_per_node > len(cfg.learner.gpus):
        problems.add("learner.nproc_per_node", cfg.learner.nproc_per_node, f"more ranks than learner.gpus {cfg.learner.gpus}",
                     "list one GPU per learner rank")
    _check_durations(cfg, "", problems)
    positive("rollout_server.port", srv.port)
    check_server_rules(srv, problems)
    check_weight_sync_rules(cfg, problems)
    check_learner_rules(cfg, problems)
    check_run_rules(cfg, problems)
    check_recipe_rules(cfg, problems)
    positive("transport.base_port", cfg.transport.base_port)


def _check_durations(obj: Any, prefix: str, problems: _Problems) -> None:
    """Every ``*_s`` field is a duration ≥ 0; every ``*timeout*_s`` is a deadline > 0."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = f"{prefix}.{_yaml_key(f)}" if prefix else _yaml_key(f)
        if dataclasses.is_dataclass(v):
            _check_durations(v, key, problems)
        elif f.name.endswith("_s") and isinstance(v, (int, float)) and not isinstance(v, bool):
            if "timeout" in f.name and v <= 0:
                problems.add(key, v, "a deadline must be > 0", f"set {key} to a positive number of seconds")
            elif v < 0:
                problems.add(key, v, "a duration cannot be negative", f"set {key} ≥ 0")


def derive(cfg: Config, world_size: int = 1) -> Derived:
    """Compute GA, effective batch and rollouts_per_step in one place (see Derived)."""
    t = cfg.training
    per_step = t.per_device_train_batch_size * world_size
    if t.effective_batch_size is not None:
        ga = max(1, math.ceil(t.effective_batch_size / per_step))
    else:
        ga = t.gradient_accumulation_steps or 1
    rps = cfg.stage2_ab.channel_b.rollouts_per_step or per_step * ga
    return Derived(
        world_size=world_size,
        gradient_accumulation_steps=ga,
        effective_batch_size=per_step * ga,
        rollouts_per_step=rps,
        packing_length=t.global_max_length,
        b_ratio_exact=str(exact_ratio(cfg.stage2_ab.schedule.b_ratio)),
    )


def _check_derived(cfg: Config, d: Derived, problems: _Problems) -> None:
    a = cfg.stage2_ab.channel_b.async_
    if cfg.stage2_ab.channel_b.mode != "async":
        return
    ga = d.gradient_accumulation_steps
    if a.queue_limit < ga:
        problems.add("stage2_ab.channel_b.async.queue_limit", a.queue_limit,
                     f"below gradient_accumulation_steps {ga}: a B step could never be feasible",
                     f"set queue_limit ≥ {ga}")
    if a.prefetch_target_packs < ga:
        problems.add("stage2_ab.channel_b.async.prefetch_target_packs", a.prefetch_target_packs,
                     f"below gradient_accumulation_steps {ga}: actors would never queue enough for a B step",
                     f"set prefetch_target_packs ≥ {ga}")


# --------------------------------------------------------------------------------------------- loading


def load_config(
    path: str | Path | None,
    overrides: typing.Sequence[str] = (),
    *,
    world_size: int | None = None,
    schema: type = Config,
) -> Any:
    """Load YAML + dotted overrides, validate once, and return the typed config.

    ``world_size`` (the learner's, when known) enables the rules that depend on it and the
    derived values; it defaults to ``learner.nproc_per_node``. Raises :class:`ConfigError`
    listing every problem.
    """
    from omegaconf import OmegaConf  # deferred: entry points print --help without it
    from omegaconf.errors import OmegaConfBaseException

    source = str(path) if path is not None else "overrides"
    problems = _Problems()
    try:
        base = OmegaConf.load(str(path)) if path is not None else OmegaConf.create({})
    except FileNotFoundError:
        raise ConfigError([f"--config {path}: file not found. Fix: pass an existing YAML (see configs/)"], source)
    except (OmegaConfBaseException, ValueError) as exc:
        raise ConfigError([f"--config {path}: not valid YAML ({exc}). Fix: correct the syntax"], source)
    for ov in overrides:
        if "=" not in ov:
            problems.append(f"override {ov!r}: expected key=value. Fix: write e.g. training.max_steps=10")
    if problems:
        raise ConfigError(problems, source)
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(merged, resolve=True)
    except (OmegaConfBaseException, TypeError, ValueError, KeyError) as exc:
        raise ConfigError([f"overrides {list(overrides)}: {exc}. Fix: use dotted key=value pairs that match "
                           "the YAML's structure (a list element is replaced as a whole list: key=[a,b])"], source)
    cfg = _build(schema, data if data is not None else {}, "", problems)
    if schema is Config and cfg is not None and not problems:
        ws = world_size if world_size is not None else cfg.learner.nproc_per_node * cfg.learner.nnodes
        _check_rules(cfg, problems, world_size)
        try:
            cfg.derived = derive(cfg, ws)
        except (TypeError, ValueError):  # already reported by the rules above
            pass
        else:
            _check_derived(cfg, cfg.derived, problems)
    elif schema is Config and cfg is not None:
        # Report semantic problems alongside structural ones where the structure allows it.
        try:
            _check_rules(cfg, problems, world_size)
        except (TypeError, AttributeError):
            pass
    elif cfg is not None and hasattr(cfg, "validate"):
        cfg.validate(problems)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain dict of a config (YAML key names), for logging and run records."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        key = _yaml_key(f)
        if dataclasses.is_dataclass(v):
            out[key] = to_dict(v)
        elif isinstance(v, list):
            out[key] = [to_dict(x) if dataclasses.is_dataclass(x) else x for x in v]
        else:
            out[key] = v
    return out

