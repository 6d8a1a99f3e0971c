"""The configuration schema: one dataclass per YAML section, each field documented where it is declared.

``doc(text, default)`` attaches a field's documentation; ``docs/config.md`` is generated from it
(``python -m common.config.docs --markdown``). Loading, coercion and the cross-field rules live in
:mod:`common.config.load`; a section with rules of its own has its dataclass beside them in its own module
(``server.py``, ``data.py``, ``learner.py``, ``run.py``, ``recipe.py``, ``weight_sync.py`` here), which
:class:`Config` imports.

Naming: counts are ``num_*`` or carry their unit (``*_s``, ``*_mb``, ``*_steps``).
Rollouts always come from tandem rollout servers (``rollout_matching.vllm.servers``), whatever their engine
(``rollout_server.engine: vllm|hf``); the section is named ``vllm`` for the vLLM-compatible protocol the servers speak.

What this module does not know: YAML, validation, torch, or how a value is used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from common.config.data import DataConfig
from common.config.fields import doc
from common.config.learner import LearnerConfig
from common.config.recipe import AdapterConfig, LrGroups
from common.config.run import TrainingRunKeys
from common.config.server import RolloutServerConfig
from common.config.weight_sync import WeightSyncConfig

# --------------------------------------------------------------------------------------------- schema


@dataclass
class ModelConfig:
    """The policy model (a transformers model directory)."""

    path: str = doc("Model directory loaded with from_pretrained (e.g. artifacts/tiny-model).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = doc(
        "Learner dtype. auto = bfloat16 on CUDA, float32 on CPU.", "auto"
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "varlen"] = doc(
        "Attention kernel; packed segments stay apart by a [T, T] block mask (sdpa, eager) or by their boundaries: "
        "flash_attention_2 (flash-attn package) or varlen (torch's varlen_attn, one call per layer in the LM and the "
        "vision tower; the fast one on GPUs; a per-segment sdpa reference on the CPU; learner/attention.py).",
        "sdpa",
    )
    coord_tokens: bool = doc("Require the 1000 <|coord_k|> tokens in the tokenizer (fail at start if absent).", True)
    freeze: list[Literal["vision", "merger", "llm"]] = doc(
        "Module groups that do not train (common/config/recipe.py names them): no gradients, no AdamW state, and "
        "bit-identical weights through the run. Any subset of vision, merger, llm.", factory=list)
    adapter: AdapterConfig | None = doc("peft LoRA/DoRA adapter (docs/models.md); null = full fine-tuning.", None)


@dataclass
class TrainingConfig(TrainingRunKeys):
    """Learner optimisation, packing and run bookkeeping (checkpoint retention, trackers: common/config/run.py)."""

    per_device_train_batch_size: int = doc(
        "Nominal samples per micro-step per rank: sets GA (effective_batch_size), rollouts_per_step and the micro "
        "mode's rollouts. Channel-A packs ignore it: they hold as many whole samples as fit global_max_length.", 1)
    gradient_accumulation_steps: int | None = doc(
        "Micro-steps per optimizer step (GA). Set this or effective_batch_size, not both.", None
    )
    effective_batch_size: int | None = doc(
        "Nominal global samples per optimizer step; GA = ceil(effective / (per_device × world)).", None
    )
    packing: bool = doc("Pack segments into one row per forward (required: true).", True)
    global_max_length: int = doc("packing_length: max tokens per pack; a longer segment is dropped and counted.", 4096)
    packing_min_fill_ratio: float = doc("A pack is sent once fill ≥ this × packing_length ...", 0.65)
    pack_max_wait_s: float = doc("... or once its oldest segment waited this long (sent underfilled, counted).", 2.0)
    lr: float = doc("Peak learning rate (AdamW).", 1.0e-5)
    weight_decay: float = doc("AdamW weight decay.", 0.0)
    lr_groups: LrGroups = doc("Per-module-group lr and weight decay (vision, merger, llm); train/lr_<group> in the "
                              "metrics. A group left out trains at lr / weight_decay.", factory=LrGroups)
    adamw_impl: Literal["auto", "fused", "foreach"] = doc(
        "torch.optim.AdamW implementation. fused: one kernel per parameter group pass, on CUDA and on the CPU (where "
        "learner.fsdp.cpu_offload runs the step: ~6x faster than foreach there for bf16); foreach: torch's "
        "multi-tensor default. auto = fused where every trainable parameter's device and dtype supports it, else "
        "foreach. The two differ only in float rounding.", "auto")
    warmup_steps: int = doc("Linear warmup optimizer steps, then cosine decay to min_lr_ratio × lr.", 0)
    min_lr_ratio: float = doc("Final learning rate as a share of lr.", 0.0)
    max_grad_norm: float = doc("Gradient clipping norm; 0 disables.", 1.0)
    gradient_checkpointing: bool = doc("Recompute activations in backward to save memory.", False)
    gradient_checkpointing_every: int = doc(
        "With gradient_checkpointing: recompute every Nth layer (vision blocks and decoder layers counted in order, "
        "transformers' every_n_layers); the others keep their activations. 1 = every layer (least memory); 2 = "
        "half the recomputation for ~half the saving (a 3b step at 12000 tokens on an H200: 1.05 -> 0.92 s, peak "
        "31 -> 65 GiB, docs/benchmarks.md section 20). The launcher's memory estimate counts it.", 1)
    loss_head: Literal["plain", "chunked"] = doc(
        "How the loss reads the LM head over the N supervised rows of a pack. plain: the model returns the logits "
        "[N, vocab] (model.dtype) and the loss upcasts them to float32 (2.4 GB at N = 4,000 rows of a 151,936-row "
        "vocabulary, held for backward, then as much again for its gradient). chunked: the LM head does not project; the cross-entropies "
        "run over vocabulary slices of its weight with the logits recomputed in backward (torch only, "
        "learner/loss.py linear_cross_entropy; at most ~256 MiB of float32 logits at a time), and the geometry "
        "terms read the 1000 coord columns exactly as plain does. Same loss and gradients up to float rounding "
        "(docs/learner.md, Loss head).", "plain")
    compile: Literal["none", "blocks"] = doc(
        "blocks: torch.compile each vision block's and decoder layer's forward (regional; learner/blocks.py): the "
        "elementwise work between matmuls fuses (a 3b step at 12000 tokens: 1.82 -> 1.11 s on an H100, "
        "docs/benchmarks.md section 20); the first steps pay the compilation (and each new pack length, until the token "
        "count is dynamic). Also under FSDP2 and DDP: 7b on 2 x H200, 2.43 -> 1.80 s a step under FSDP2. none: eager.",
        "none")
    peak_tflops: float | None = doc(
        "The dense matmul rate of one learner device in TFLOP/s (e.g. a datasheet's bf16 figure), the peak that "
        "throughput/mfu divides by (learner/throughput.py). None = measured at start-up on rank 0's device: an "
        "8192³ matmul in the model's dtype on a GPU (~0.1 s), 1024³ on a CPU.", None)
    max_steps: int = doc("Optimizer steps to run.", 100)
    max_train_seconds: float | None = doc(
        "Also stop after the optimizer step at which this process has trained this long (the sum of time/step: "
        "forward/backward, waits and sync stalls; rank 0's clock, broadcast each step), not counting the process's "
        "first step (one-time start-up: the start-up sync and CUDA initialisation): an equal learner-time budget "
        "for comparisons (bench/bench_quality.py). The warm start (python -m learner.warm_start) honours it too and "
        "saves what it trained: a stage that must end by a deadline. None = max_steps only. Restarts on resume.", None
    )
    seed: int = doc("Base seed (learner data order, rollout seeds, actor streams).", 0)
    output_dir: str = doc("Run directory: metrics.jsonl, checkpoints, logs.", "runs/default")
    resume: str | None = doc(
        "None = fresh; auto = the latest checkpoint of this output_dir's run (its run id, run_info.json) if any; "
        "or a checkpoint path.", None
    )
    overwrite: bool = doc(
        "A start that resumes nothing into an output_dir holding a run (metrics.jsonl, run_info.json or "
        "checkpoints/<step>) is refused (exit 2) unless this is true: then that run is moved, whole, to "
        "<output_dir>.old-<its start time> first. Nothing is ever deleted (docs/learner.md, Run directory).", False
    )
    save_every_steps: int = doc("Checkpoint every N optimizer steps (0 = only at the end).", 0)
    save_final: bool = doc(
        "Also checkpoint after the last step. false: a run that is measured, not kept (a benchmark), writes no "
        "final checkpoint (a 7B sharded one is ~40 GiB of weights and AdamW state).", True)
    log_every_steps: int = doc(
        "Warm start only (python -m learner.warm_start): a log line and a warm_start_metrics.jsonl record every N "
        "steps. The Stage-2 learner writes a metrics.jsonl record every optimizer step (the summary, the plot and "
        "the conservation checks read every one) and refuses another value at start.", 1
    )
    progress: bool = doc("Progress bar on rank 0.", True)
    eval_every_steps: int = doc(
        "Evaluate on data.val_jsonl every N optimizer steps (greedy rollouts through the rollout server, on a "
        "rank-0 thread the learner never waits for) and once at the end; 0 = at the start and the end only. "
        "Ignored without data.val_jsonl (docs/evaluation.md).",
        0,
    )
    eval_max_images: int | None = doc("Evaluate on the first N records of data.val_jsonl; None = all.", None)
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
    prefetch_target_packs: int = doc("Credits per rank: actors keep in-flight + queued ≤ this. GA ≤ it ≤ queue_limit.", 4)


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
    coord_ce_weight: float = doc(
        "Stage-1 warm start: weight of a full-vocabulary cross-entropy on the coord tokens of Channel-A packs "
        "(target <|coord_k|> of the GT bin, per coord slot). 0 = Stage-2 semantics (coords get geometry only, as in "
        "the origin). Channel-B packs never get it. `python -m learner.warm_start` requires it > 0 "
        "(docs/warm_start.md). In Stage-2 on the tiny detector (5 seeds, 90 learner s), 1.0 on A steps ended A-only "
        "0.018 val F1 above the warm start, 0 ended it 0.027 below (docs/benchmarks.md section 21); "
        "configs/demo_cpu.yaml uses 1.0.",
        0.0,
    )


@dataclass
class ServerEndpoint:
    """One rollout server."""

    base_url: str = doc("http://host:port of a rollout server.")


@dataclass
class VLLMConfig:
    """Server-mode rollouts."""

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

    vllm: VLLMConfig = doc("Server-mode rollouts.", factory=VLLMConfig)
    decoding: DecodingConfig = doc("Sampling knobs.", factory=DecodingConfig)
    matching: MatchingConfig = doc("Matching knobs.", factory=MatchingConfig)


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
    max_frame_mb: int | None = doc(
        "Largest frame a learner rank's pack socket accepts (zmq.MAXMSGSIZE): ZMQ drops a peer that sends a bigger "
        "one, unread. None = training.global_max_length × 8 KiB + 1 MiB, room for any legal pack of the Qwen-VL "
        "family; the learner checks at start that its model's biggest legal frame fits.", None
    )


@dataclass
class LauncherConfig:
    """The launcher's supervision (`python -m launcher`): which dead processes it starts again."""

    max_actor_restarts: int = doc(
        "Restarts granted to each actor process over the run. An actor that exits non-zero is started again "
        "(after restart_backoff_s) while its budget lasts; then it stays down, logged, and the run goes on without "
        "it (the learner trains A steps where B packs are short). An actor that exits 0 is not restarted. "
        "The learner dying ends the run.", 3
    )
    max_server_restarts: int = doc(
        "Restarts granted to the rollout server the launcher started. Meanwhile the learner trains A steps (its "
        "syncs fail fast) and actors back off; the restarted server gets the learner's weights at the next due "
        "sync, ver moving on from the learner's. Past the budget, the server's death ends the run. 0 = it always does.",
        3,
    )
    restart_backoff_s: float = doc(
        "Pause before a process's first restart; doubled for each further restart of that process, at most 60 s.", 2.0
    )
    node_rank: int | None = doc(
        "Which learner node this launcher starts (learner.nnodes > 1 needs it, passed per node on the command line: "
        "launcher.node_rank=k). Node k gets torchrun for its ranks k·nproc_per_node .. (k+1)·nproc_per_node − 1 "
        "(static rendezvous at learner.rdzv_endpoint), the actors feeding them, and, on node 0 only, the rollout "
        "server; logs go to {output_dir}/logs/node{k}/. None = one node: the whole topology, as without multi-node.",
        None,
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
    weight_sync: WeightSyncConfig = doc("Weight sync, learner → rollout servers.", factory=WeightSyncConfig)
    actor: ActorConfig = doc("Actor processes.", factory=ActorConfig)
    transport: TransportConfig = doc("Actor ↔ learner links.", factory=TransportConfig)
    learner: LearnerConfig = doc("Learner process.", factory=LearnerConfig)
    launcher: LauncherConfig = doc("Launcher supervision.", factory=LauncherConfig)
    run_name: str = doc("Name of the run, recorded in run_info.json.", "tandem")

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
