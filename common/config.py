"""The single configuration schema: every process reads one YAML and takes its own part.

Load with :func:`load_config` (YAML + OmegaConf dotted ``key=value`` overrides). Validation runs
once and reports **every** problem together in one :class:`ConfigError`, each naming the dotted
key, the offending value and the fix. Field documentation lives next to each field
(``doc(...)``); ``docs/config.md`` is generated from it (``python -m common.config --markdown``).

Naming: counts are ``num_*`` or carry their unit (``*_s``, ``*_mb``, ``*_steps``).
``rollout_matching.rollout_backend: vllm`` means "rollouts come from a tandem rollout server"
(the vLLM-protocol server), whatever that server's engine is (``rollout_server.engine: vllm|hf``).

What this module does not know: torch, processes, or how a value is used beyond its rule.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from common.schedule import exact_ratio

log = logging.getLogger(__name__)

REQUIRED = dataclasses.MISSING


def doc(text: str, default: Any = REQUIRED, *, factory: Any = None) -> Any:
    """A dataclass field with its documentation attached (read by the config reference)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": text})
    if default is REQUIRED:
        return field(metadata={"doc": text, "required": True})
    return field(default=default, metadata={"doc": text})


# --------------------------------------------------------------------------------------------- schema


@dataclass
class ModelConfig:
    """The policy model (a transformers model directory)."""

    path: str = doc("Model directory loaded with from_pretrained (e.g. artifacts/tiny-model).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = doc(
        "Learner dtype. auto = bfloat16 on CUDA, float32 on CPU.", "auto"
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = doc(
        "Attention kernel. Packed segments are isolated with a block-diagonal mask (sdpa/eager) "
        "or cu_seqlens (flash_attention_2).",
        "sdpa",
    )
    coord_tokens: bool = doc("Require the 1000 <|coord_k|> tokens in the tokenizer (fail at start if absent).", True)


@dataclass
class DataConfig:
    """Training data in the JSONL contract of design section 2."""

    train_jsonl: str = doc("Training records (JSONL).")
    val_jsonl: str | None = doc("Validation records (JSONL); None = no evaluation.", None)
    image_root: str | None = doc("Directory relative image paths resolve against; None = the JSONL's directory.", None)


@dataclass
class TrainingConfig:
    """Learner optimisation, packing and run bookkeeping."""

    per_device_train_batch_size: int = doc("Raw samples per micro-step per rank for Channel-A.", 1)
    gradient_accumulation_steps: int | None = doc(
        "Micro-steps per optimizer step (GA). Set this or effective_batch_size, not both.", None
    )
    effective_batch_size: int | None = doc(
        "Global samples per optimizer step; GA = ceil(effective / (per_device × world)).", None
    )
    packing: bool = doc("Pack segments into one row per forward (required: true).", True)
    global_max_length: int = doc("packing_length: max tokens per pack; a longer segment is dropped and counted.", 4096)
    packing_min_fill_ratio: float = doc("A pack is sent once fill ≥ this × packing_length ...", 0.65)
    pack_max_wait_s: float = doc("... or once its oldest segment waited this long (sent underfilled, counted).", 2.0)
    lr: float = doc("Peak learning rate (AdamW).", 1.0e-5)
    weight_decay: float = doc("AdamW weight decay.", 0.0)
    warmup_steps: int = doc("Linear warmup optimizer steps, then cosine decay to min_lr_ratio × lr.", 0)
    min_lr_ratio: float = doc("Final learning rate as a share of lr.", 0.0)
    max_grad_norm: float = doc("Gradient clipping norm; 0 disables.", 1.0)
    gradient_checkpointing: bool = doc("Recompute activations in backward to save memory.", False)
    max_steps: int = doc("Optimizer steps to run.", 100)
    seed: int = doc("Base seed (learner data order, rollout seeds, actor streams).", 0)
    output_dir: str = doc("Run directory: metrics.jsonl, checkpoints, logs.", "runs/default")
    resume: str | None = doc("None = fresh; auto = latest checkpoint in output_dir if any; or a checkpoint path.", None)
    save_every_steps: int = doc("Checkpoint every N optimizer steps (0 = only at the end).", 0)
    log_every_steps: int = doc("Metrics record every N optimizer steps (rank 0).", 1)
    tensorboard: bool = doc("Also write TensorBoard events (needs the tensorboard package).", False)
    progress: bool = doc("Progress bar on rank 0.", True)
    trace_micro_steps: bool = doc(
        "Each learner rank appends one JSON line per micro-step (kind, pack vers, sample ids, forwards) to "
        "output_dir/trace_rank<r>.jsonl: audits and tests.",
        False,
    )


@dataclass
class ScheduleConfig:
    """Which optimizer steps want Channel-B."""

    b_ratio: float = doc("Required. Share of optimizer steps that want B: B at s iff floor((s+1)b) > floor(sb).")


@dataclass
class AsyncConfig:
    """Per-rank ready queues of the async actor-learner mode."""

    queue_limit: int = doc("Ready packs held per learner rank; overflow drops the oldest (counted). ≥ GA.", 8)
    version_window: int = doc("Packs with ver < ver_current - version_window are stale: dropped, counted.", 2)
    sync_every_steps: int = doc("Push weights to the server (ver += 1) every N optimizer steps.", 1)
    prefetch_target_packs: int = doc("Credits per rank: actors keep in-flight + queued ≤ this. GA ≤ it ≤ queue_limit.", 4)
    sync_mode: Literal["blocking", "overlap"] = doc(
        "blocking = barrier → rank 0 push → barrier (every rank stalls for the push); overlap = rank 0 pushes a "
        "snapshot from a background thread while every rank trains on, the new ver adopted at the first step "
        "boundary after the commit (mode async only; docs/learner.md).",
        "blocking",
    )


@dataclass
class ChannelBConfig:
    """How Channel-B samples are produced and consumed."""

    mode: Literal["micro", "step", "async"] = doc("async (any world size) | step, micro (world size 1).", "async")
    target: Literal["reordered_gt", "rollout_prefix"] = doc(
        "reordered_gt: matched GT in predicted order + FN; rollout_prefix: rollout tokens + FN appended.",
        "reordered_gt",
    )
    rollouts_per_step: int | None = doc("step mode: raw rollouts per optimizer step; None = per_device × world × GA.", None)
    rollout_decode_batch_size: int = doc("Samples per /infer call, independent of the learner micro-batch.", 2)
    enable_pipeline: bool = doc("step mode: overlap rollout and learning through a bounded queue (server rollouts).", False)
    desc_ce_weight_matched: float | None = doc("CE weight of matched objects' desc tokens; None = desc_ce_weight.", None)
    fn_geometry: bool = doc("rollout_prefix target: also supervise geometry of appended FN objects.", True)
    async_: AsyncConfig = field(default_factory=AsyncConfig, metadata={"doc": "Async queues.", "key": "async"})


@dataclass
class Stage2ABConfig:
    """Channel mixing and loss weights."""

    schedule: ScheduleConfig = doc("A/B schedule.", factory=lambda: None)  # built from {} so b_ratio is reported
    channel_b: ChannelBConfig = doc("Channel-B production.", factory=ChannelBConfig)
    desc_ce_weight: float = doc("CE weight of desc value tokens (other supervised tokens weigh 1).", 1.0)
    bbox_smoothl1_weight: float = doc("Weight of SmoothL1 on expectation-decoded coordinates.", 1.0)
    bbox_ciou_weight: float = doc("Weight of (1 - CIoU) on expectation-decoded boxes.", 1.0)
    coord_temperature: float = doc("τ in c = Σ softmax(z/τ)_k · k/999 over the 1000 coord logits.", 1.0)


@dataclass
class ServerEndpoint:
    """One rollout server."""

    base_url: str = doc("http://host:port of a rollout server.")


@dataclass
class SyncConfig:
    """Weight sync to the rollout servers."""

    mode: Literal["full"] = doc("full = push every weight each sync (the only mode in v1).", "full")
    transport: Literal["auto", "http", "nccl"] = doc(
        "http = safetensors buckets over HTTP (CPU); nccl = NCCL broadcast (GPU); auto = nccl on CUDA.", "auto"
    )
    bucket_mb: int = doc("Bucket size for weight transfer.", 512)
    timeout_s: float = doc("Deadline for a whole sync (fence + wire + commit).", 300.0)
    fence: Literal["drain", "abort"] = doc("Server fence: drain in-flight /infer, or abort them (clients retry).", "drain")
    master_addr: str = doc(
        "nccl: address of learner rank 0 that the server workers reach for the weight-transfer rendezvous "
        "(a free port is picked per group).", "127.0.0.1"
    )


@dataclass
class VLLMConfig:
    """Server-mode rollouts."""

    mode: Literal["server", "colocate"] = doc("server = dedicated rollout servers (required by async).", "server")
    sync: SyncConfig = doc("Weight sync.", factory=SyncConfig)
    servers: list[ServerEndpoint] = doc(
        "Rollout servers; actors spread load over them.",
        factory=lambda: [ServerEndpoint(base_url="http://127.0.0.1:8000")],
    )
    timeout_s: float = doc("Deadline for a server to become healthy at start.", 240.0)
    infer_timeout_s: float = doc("Read timeout of one /infer call (then retry, then split).", 120.0)
    connect_timeout_s: float = doc("Connect timeout of one HTTP call.", 10.0)
    retry_backoff_s: float = doc("First retry delay of a failed /infer; doubles per attempt, ±50% jitter.", 0.5)
    retry_backoff_max_s: float = doc("Cap on one retry delay.", 10.0)
    balance: Literal["least_inflight", "round_robin"] = doc(
        "How actors spread /infer calls over servers: fewest calls in flight, or in turn.", "least_inflight"
    )


@dataclass
class DecodingConfig:
    """Sampling knobs for rollouts (mapped exactly onto the engine)."""

    temperature: float = doc("0 = greedy; > 0 samples. Runbook start: 0.01.", 0.0)
    top_p: float = doc("Nucleus mass in (0, 1]. Runbook start: 0.95.", 1.0)
    top_k: int = doc("Top-k; -1 (or 0) = off.", -1)
    max_new_tokens: int = doc("Generation cap per rollout.", 512)
    repetition_penalty: float = doc("> 0; 1.0 = off.", 1.0)


@dataclass
class MatchingConfig:
    """Hungarian matching of predicted to GT boxes."""

    candidate_top_k: int = doc("GT candidates per prediction by IoU (centre distance if all IoU are 0).", 10)
    gate: float = doc("Pairs with IoU < gate are infeasible.", 0.3)
    fp_cost: float = doc("Cost of leaving a prediction unmatched.", 1.0)
    fn_cost: float = doc("Cost of leaving a GT unmatched.", 1.0)


@dataclass
class RolloutMatchingConfig:
    """Where rollouts come from and how they are matched."""

    rollout_backend: Literal["vllm", "hf"] = doc(
        "vllm = a tandem rollout server (any engine); hf = in-learner generate (micro/step only).", "vllm"
    )
    vllm: VLLMConfig = doc("Server-mode rollouts.", factory=VLLMConfig)
    decoding: DecodingConfig = doc("Sampling knobs.", factory=DecodingConfig)
    matching: MatchingConfig = doc("Matching knobs.", factory=MatchingConfig)


@dataclass
class RolloutServerConfig:
    """The rollout server process (`python -m rollout_server`)."""

    engine: Literal["vllm", "hf"] = doc("vllm on GPUs; hf = transformers generate (CPU default, tests).", "hf")
    model_path: str | None = doc("Served model directory; None = model.path.", None)
    host: str = doc("Bind address (loopback unless told otherwise).", "127.0.0.1")
    port: int = doc("HTTP port.", 8000)
    auth_token: str | None = doc("Bearer token required on /sync/* when set.", None)
    gpus: list[int] | None = doc("GPU ids of the server (launcher sets CUDA_VISIBLE_DEVICES); must not overlap learner.gpus.", None)
    tensor_parallel_size: int = doc("vLLM tensor parallel size.", 1)
    gpu_memory_utilization: float = doc("vLLM KV-cache memory share.", 0.85)
    max_model_len: int | None = doc("vLLM context cap; None = model default.", None)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = doc("Serving dtype; auto = bf16 on CUDA, fp32 on CPU.", "auto")
    max_batch_items: int = doc("Largest /infer batch accepted (more is a 413 naming the limit).", 256)
    hf_max_batch: int = doc("hf engine: sequences per generate call.", 16)
    enable_prefix_caching: bool = doc("vLLM prefix caching (reset after every weight update).", True)
    enforce_eager: bool = doc("vLLM: no torch.compile, no CUDA graphs (starts in seconds, decodes slower).", False)
    load_format: Literal["auto", "dummy"] = doc(
        "vLLM weight loading: auto = model_path's safetensors; dummy = random weights of its config "
        "(benchmarks: the learner's first sync overwrites them).", "auto"
    )
    weight_load: Literal["fast", "native"] = doc(
        "vLLM NCCL sync: fast = receive into two persistent chunk buffers and replay a copy plan "
        "recorded once per weight layout (falls back to native, logged, when the model's loaders do "
        "more than copy; docs/gpu.md); native = vLLM's update_weights (layerwise reload).", "fast"
    )
    sync_idle_timeout_s: float = doc("A sync session idle this long is aborted (old weights kept).", 120.0)
    log_level: str = doc("Server log level.", "info")
    device: str = doc("hf engine device: auto (cuda if available, else cpu), cpu, cuda or cuda:N.", "auto")
    admission_timeout_s: float = doc(
        "Longest an /infer call waits at a closed fence (or for min_ver) before a 503 naming the wait.", 600.0
    )
    max_bucket_mb: int = doc("Largest /sync/bucket body accepted (bigger is a 413); ≥ the learner's bucket_mb.", 2048)
    shutdown_grace_s: float = doc("On SIGTERM, in-flight requests get this long to finish before they are cut.", 10.0)


@dataclass
class ActorConfig:
    """Actor processes (`python -m actor --rank N`)."""

    num_actors_per_rank: int = doc("Actors feeding each learner rank (the launcher starts them).", 1)
    flush_policy: Literal["flush", "drop"] = doc("On a ver advance, old-ver leftovers are packed (flush) or dropped.", "flush")
    learner_wait_timeout_s: float = doc("Deadline for the learner rank's credits to appear at start.", 300.0)
    metrics_every_s: float = doc("Actor metrics JSONL cadence.", 10.0)
    max_samples: int | None = doc("Stop after this many samples (tests); None = run until told to stop.", None)
    max_inflight_batches: int = doc(
        "Concurrent /infer calls per actor (each of rollout_decode_batch_size samples); credits bound them too.", 2
    )
    send_timeout_s: float = doc("Deadline of one pack send; a pack not accepted by then stays queued and is retried.", 0.5)
    learner_silence_s: float = doc(
        "Credits silent this long = the learner is gone: generation pauses; after learner_wait_timeout_s more the actor exits.",
        5.0,
    )
    lost_pack_timeout_s: float = doc(
        "Packs sent but never acknowledged by credits for this long are counted lost and their credit returned.", 60.0
    )
    server_backoff_max_s: float = doc("Longest pause between retries while the rollout server is down.", 30.0)
    stop_timeout_s: float = doc("On SIGTERM/SIGINT or max_samples: time allowed to finish rollouts and send packs.", 10.0)
    dump_pack_digests: bool = doc("Log the sha256 of every sent pack's tensors in the actor metrics JSONL (tests).", False)


@dataclass
class TransportConfig:
    """ZMQ links between actors and learner ranks."""

    host: str = doc("Learner host the actors connect to.", "127.0.0.1")
    base_port: int = doc("Rank r pulls packs on base_port + 2r and publishes credits on base_port + 2r + 1.", 5600)
    hwm: int = doc("ZMQ high-water mark (messages) on pack sockets; ≥ queue_limit.", 64)
    linger_ms: int = doc("ZMQ linger at close.", 0)
    credit_interval_s: float = doc("Learner publishes credits at least this often.", 0.2)


@dataclass
class LearnerConfig:
    """The torchrun learner."""

    gpus: list[int] | None = doc("GPU ids of the learner (launcher); must not overlap rollout_server.gpus.", None)
    nproc_per_node: int = doc("Learner ranks started by the launcher.", 1)
    backend: Literal["auto", "gloo", "nccl"] = doc("torch.distributed backend; auto = nccl on CUDA else gloo.", "auto")
    collective_timeout_s: float = doc("Deadline for barriers/collectives; a timeout names the awaited step.", 600.0)
    pack_wait_s: float = doc(
        "When the policy wants B but a rank holds fewer than GA eligible packs, re-check for up to this long "
        "before falling back to A (counted in time/wait_for_packs). 0 = never wait: fall back at once.",
        0.0,
    )


@dataclass
class Config:
    """The whole tandem configuration."""

    model: ModelConfig = doc("The policy model.")
    data: DataConfig = doc("Training data.")
    stage2_ab: Stage2ABConfig = doc("Channel mixing and loss.", factory=lambda: None)  # built from {}
    training: TrainingConfig = doc("Optimisation and bookkeeping.", factory=TrainingConfig)
    rollout_matching: RolloutMatchingConfig = doc("Rollouts and matching.", factory=RolloutMatchingConfig)
    rollout_server: RolloutServerConfig = doc("Rollout server process.", factory=RolloutServerConfig)
    actor: ActorConfig = doc("Actor processes.", factory=ActorConfig)
    transport: TransportConfig = doc("Actor ↔ learner links.", factory=TransportConfig)
    learner: LearnerConfig = doc("Learner process.", factory=LearnerConfig)
    run_name: str = doc("Name used in logs and process titles.", "tandem")

    # Filled by validation (never read from YAML): see derive().
    derived: "Derived" = field(default=None, metadata={"doc": "Computed values (not configurable).", "internal": True})  # type: ignore[assignment]


@dataclass
class Derived:
    """Values computed once from the config and the world size (logged at start)."""

    world_size: int
    gradient_accumulation_steps: int
    effective_batch_size: int
    rollouts_per_step: int
    packing_length: int
    b_ratio_exact: str


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

# Keys that used to exist: (dotted key) -> fix.
_LEGACY_KEYS = {
    "stage2_ab.schedule.pattern": "remove it and set stage2_ab.schedule.b_ratio (e.g. pattern [A, B] → b_ratio: 0.5)",
    "rollout_matching.temperature": "move it to rollout_matching.decoding.temperature",
    "rollout_matching.top_p": "move it to rollout_matching.decoding.top_p",
    "rollout_matching.top_k": "move it to rollout_matching.decoding.top_k",
    "rollout_matching.rollout_buffer": "remove it: rollout reuse is gone; async prefetch "
    "(stage2_ab.channel_b.mode: async) replaces it",
    "rollout_matching.max_new_tokens": "move it to rollout_matching.decoding.max_new_tokens",
    "training.packing_length": "remove it: packing_length is training.global_max_length",
}


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
        if dotted in _LEGACY_KEYS:
            problems.add(dotted, value, "this key is no longer supported", _LEGACY_KEYS[dotted])
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
    """Semantic fail-fast rules of design section 7 (types are already checked)."""
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

    server_rollouts = rm.rollout_backend == "vllm" and rm.vllm.mode == "server"
    if cb.mode == "async":
        if rm.rollout_backend != "vllm":
            problems.add("rollout_matching.rollout_backend", rm.rollout_backend, "async mode needs server rollouts",
                         "set rollout_matching.rollout_backend: vllm (a rollout server; its engine may be hf)")
        if rm.vllm.mode != "server":
            problems.add("rollout_matching.vllm.mode", rm.vllm.mode, "async mode needs dedicated rollout servers",
                         "set rollout_matching.vllm.mode: server")
        if rm.vllm.sync.mode != "full":
            problems.add("rollout_matching.vllm.sync.mode", rm.vllm.sync.mode, "async mode needs full weight sync",
                         "set rollout_matching.vllm.sync.mode: full")
    if cb.enable_pipeline and not server_rollouts:
        problems.add("stage2_ab.channel_b.enable_pipeline", True, "the pipeline needs server rollouts on their own GPUs",
                     "set rollout_matching.rollout_backend: vllm and rollout_matching.vllm.mode: server, or disable it")
    if cb.enable_pipeline and cb.mode != "step":
        problems.add("stage2_ab.channel_b.enable_pipeline", True, f"only used by mode step, not {cb.mode}",
                     "remove it or set stage2_ab.channel_b.mode: step")
    if cb.mode in ("step", "micro") and world_size is not None and world_size > 1:
        problems.add("stage2_ab.channel_b.mode", cb.mode, f"{cb.mode} mode runs on one learner process, world_size is {world_size}",
                     "use stage2_ab.channel_b.mode: async for multi-GPU learners")
    if a.sync_mode == "overlap" and cb.mode != "async":
        problems.add("stage2_ab.channel_b.async.sync_mode", a.sync_mode,
                     f"overlap is for mode async; {cb.mode} mode rolls out against the server inside its own B steps, "
                     "so they would wait at the server's sync fence for the push anyway (and step is the synchronous "
                     "baseline)", "use sync_mode: blocking, or stage2_ab.channel_b.mode: async")
    positive("stage2_ab.channel_b.rollout_decode_batch_size", cb.rollout_decode_batch_size)
    positive("stage2_ab.channel_b.rollouts_per_step", cb.rollouts_per_step)
    positive("stage2_ab.channel_b.async.queue_limit", a.queue_limit)
    positive("stage2_ab.channel_b.async.prefetch_target_packs", a.prefetch_target_packs)
    positive("stage2_ab.channel_b.async.sync_every_steps", a.sync_every_steps)
    positive("stage2_ab.channel_b.async.version_window", a.version_window, 0)
    if isinstance(a.prefetch_target_packs, int) and isinstance(a.queue_limit, int) and a.prefetch_target_packs > a.queue_limit:
        problems.add("stage2_ab.channel_b.async.prefetch_target_packs", a.prefetch_target_packs,
                     f"above queue_limit {a.queue_limit}: packs would be produced only to be dropped",
                     "lower prefetch_target_packs or raise queue_limit")
    if isinstance(cfg.transport.hwm, int) and isinstance(a.queue_limit, int) and cfg.transport.hwm < a.queue_limit:
        problems.add("transport.hwm", cfg.transport.hwm, f"below queue_limit {a.queue_limit}",
                     "set transport.hwm ≥ stage2_ab.channel_b.async.queue_limit")
    for key in ("desc_ce_weight", "bbox_smoothl1_weight", "bbox_ciou_weight"):
        v = getattr(ab, key)
        if isinstance(v, float) and v < 0:
            problems.add(f"stage2_ab.{key}", v, "must be ≥ 0", "use 0 to disable the term")
    if isinstance(ab.coord_temperature, float) and ab.coord_temperature <= 0:
        problems.add("stage2_ab.coord_temperature", ab.coord_temperature, "must be > 0", "use 1.0")
    if not rm.vllm.servers and server_rollouts:
        problems.add("rollout_matching.vllm.servers", [], "no rollout server listed",
                     "add - base_url: http://127.0.0.1:8000")
    for i, s in enumerate(rm.vllm.servers):
        if isinstance(s, ServerEndpoint) and isinstance(s.base_url, str) and not s.base_url.startswith(("http://", "https://")):
            problems.add(f"rollout_matching.vllm.servers[{i}].base_url", s.base_url, "not an http(s) URL",
                         "write it as http://host:port")
    if srv.gpus and cfg.learner.gpus and set(srv.gpus) & set(cfg.learner.gpus):
        problems.add("learner.gpus", cfg.learner.gpus, f"overlaps rollout_server.gpus {srv.gpus}",
                     "give the server and the learner disjoint GPU sets")
    if srv.tensor_parallel_size and srv.gpus and len(srv.gpus) % srv.tensor_parallel_size:
        problems.add("rollout_server.tensor_parallel_size", srv.tensor_parallel_size,
                     f"does not divide len(rollout_server.gpus) = {len(srv.gpus)}", "make the GPU count a multiple of TP")
    if cfg.learner.gpus and cfg.learner.nproc_per_node > len(cfg.learner.gpus):
        problems.add("learner.nproc_per_node", cfg.learner.nproc_per_node, f"more ranks than learner.gpus {cfg.learner.gpus}",
                     "list one GPU per learner rank")
    _check_durations(cfg, "", problems)
    if isinstance(srv.max_bucket_mb, int) and isinstance(rm.vllm.sync.bucket_mb, int) and srv.max_bucket_mb < rm.vllm.sync.bucket_mb:
        problems.add("rollout_server.max_bucket_mb", srv.max_bucket_mb,
                     f"below rollout_matching.vllm.sync.bucket_mb {rm.vllm.sync.bucket_mb}: every bucket would be refused",
                     "raise rollout_server.max_bucket_mb or lower the learner's bucket_mb")
    positive("rollout_server.port", srv.port)
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
        ws = world_size if world_size is not None else cfg.learner.nproc_per_node
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


def split_cli(argv: typing.Sequence[str]) -> tuple[str | None, list[str]]:
    """Split ``--config PATH key=value ...`` (the CLI every entry point takes)."""
    config, overrides, it = None, [], iter(argv)
    for arg in it:
        if arg == "--config":
            config = next(it, None)
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    return config, overrides


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


def markdown_reference(cls: type = Config, prefix: str = "") -> str:
    """The config reference (docs/config.md), generated from the field docs."""
    lines = [] if prefix else ["# Configuration reference", "", "Generated by `python -m common.config --markdown` "
                               "from `common/config.py`. Required keys have no default.", ""]
    hints = typing.get_type_hints(cls)
    rows, subs = [], []
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        key = f"{prefix}.{_yaml_key(f)}" if prefix else _yaml_key(f)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            subs.append((key, tp))
            continue
        if f.metadata.get("required"):
            default = "**required**"
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f"`{to_dict_value(f.default_factory())}`"  # type: ignore[misc]
        else:
            default = f"`{f.default!r}`"
        rows.append(f"| `{key}` | {_describe(tp).replace('|', '/')} | {default} | {f.metadata.get('doc', '')} |")
    if rows:
        lines += [f"## `{prefix or 'top level'}`", "", (cls.__doc__ or "").strip(), "",
                  "| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    for key, tp in subs:
        lines.append(markdown_reference(tp, key))
    return "\n".join(lines)


def to_dict_value(v: Any) -> Any:
    if isinstance(v, list):
        return [to_dict(x) if dataclasses.is_dataclass(x) else x for x in v]
    return to_dict(v) if dataclasses.is_dataclass(v) else v


if __name__ == "__main__":
    if "--markdown" in sys.argv:
        print(markdown_reference())
    else:
        path, ovs = split_cli(sys.argv[1:])
        try:
            print(to_dict(load_config(path, ovs)))
        except ConfigError as err:
            print(err, file=sys.stderr)
            sys.exit(2)
