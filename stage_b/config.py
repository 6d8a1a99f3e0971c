"""The Stage-B configuration schema (docs/stage_b.md), loaded through the common loader.

``load_stage_b_config(path, overrides)`` reads one YAML plus dotted ``key=value`` overrides and
reports every problem together in one :class:`common.config.load.ConfigError` (unknown keys, wrong
types, and the rules in :meth:`StageBConfig.validate`), each naming the dotted key and the fix.

Stage-B has its own schema, separate from the actor/learner one: it is a different job (no
training, no rollout server) that happens to reuse the ``hf`` engine in-process.

What this module does not know: torch, processes, or the world size (per-rank batch sizes are
per rank by definition; the global batch is computed at run time).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from common.config.fields import doc
from common.config.load import load_config


@dataclass
class StageBModelConfig:
    """The judge model every rank loads in full (Stage-B is data-parallel over tickets)."""

    path: str = doc("Model directory loaded with from_pretrained (e.g. artifacts/tiny-model, built by `make tiny-model`).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = doc("auto = bfloat16 on CUDA, float32 on CPU.", "auto")
    device_map: str = doc(
        "auto = every rank loads the whole model on its local device (cuda:LOCAL_RANK) when WORLD_SIZE > 1 "
        "(forced: no cross-rank sharding); a single process loads onto its GPU (transformers' 'auto' "
        "placement when it sees several); cpu without CUDA. Or an explicit device such as cpu or cuda:0.",
        "auto",
    )
    attn_implementation: Literal["sdpa", "eager"] = doc("Attention kernel for generate.", "sdpa")


@dataclass
class DemoTicketsConfig:
    """The deterministic demo ticket set (used when tickets.path is null)."""

    num_groups: int = doc("Tickets to generate.", 16)
    images_per_group: int = doc("Per-image summaries per ticket.", 2)
    fail_share: float = doc("Share of tickets labelled fail, in [0, 1].", 0.5)
    seed: int = doc("Generator seed: same seed, same tickets, on every rank.", 0)


@dataclass
class TicketsConfig:
    """Where the tickets come from (JSONL: group_id, label pass|fail, summaries, mission, uid?)."""

    path: str | None = doc(
        "Ticket JSONL; null = generate the demo set in memory (tickets.demo), identically on every rank.", None
    )
    mission: str | None = doc(
        "Expected mission; null = the single mission found in the tickets (more than one is an error).", None
    )
    demo: DemoTicketsConfig = doc("Demo ticket generator.", factory=DemoTicketsConfig)


@dataclass
class DecodeConfig:
    """One entry of the decode grid: every ticket gets samples_per_decode samples per entry."""

    temperature: float = doc("0 = greedy; > 0 samples.", 0.7)
    top_p: float = doc("Nucleus mass in (0, 1].", 0.9)
    max_new_tokens: int = doc("Generation cap per sample.", 64)
    seed: int | None = doc("Sample j of this entry uses seed + j; null = unseeded (not reproducible).", None)
    repetition_penalty: float = doc("> 0; 1.0 = off.", 1.0)


@dataclass
class ScriptedConfig:
    """The scripted judge (sampler.backend: scripted). A deterministic test/demo peer, never production."""

    verdict: Literal["pass", "fail", "hash"] = doc(
        "pass / fail: every well-formed answer says that; hash: a stable hash of prompt and seed decides.", "hash"
    )
    malformed_share: float = doc("Share of answers returned malformed (stable hash), in [0, 1].", 0.0)


@dataclass
class SamplerConfig:
    """Rollout: one prompt per ticket (summaries + the batch's guidance snapshot) × the decode grid."""

    backend: Literal["hf", "scripted"] = doc(
        "hf = the real model through the hf engine, in-process (production, demo). scripted = a "
        "deterministic peer that answers by rule without a model, for tests that need well-formed "
        "answers; not what production or the demo uses.",
        "hf",
    )
    grid: list[DecodeConfig] = doc("Decode configs; each ticket is sampled under every entry.",
                                   factory=lambda: [DecodeConfig()])
    samples_per_decode: int = doc("Samples per ticket per grid entry.", 1)
    generate_batch_size: int = doc("Prompts per generate call (a rank's shard is split into chunks of this size).", 8)
    scripted: ScriptedConfig = doc("Scripted peer knobs (backend: scripted only).", factory=ScriptedConfig)


@dataclass
class SelectionConfig:
    """Majority vote over a ticket's well-formed candidates."""

    tie_break: Literal["lowest_temperature", "prefer_fail", "prefer_pass"] = doc(
        "Equal votes: lowest_temperature = the verdict of the lowest-temperature candidate (earliest on a tie); "
        "prefer_fail / prefer_pass = that verdict.",
        "lowest_temperature",
    )
    min_verdict_agreement: float = doc(
        "vote_strength (share of candidates with the chosen verdict) below this is low agreement: learnable.", 0.67
    )


@dataclass
class ReflectionConfig:
    """Rank-0 reflection: the model proposes guidance operations for a batch of learnable tickets."""

    batch_size: int = doc("Reflect once this many learnable tickets are pending GLOBALLY (rank 0, after gather).", 16)
    max_attempts: int = doc("Attempts per cycle; attempt a sends max(1, batch_size // 2**a) records.", 3)
    max_new_tokens: int = doc("Generation cap of one reflection answer.", 256)
    temperature: float = doc("Reflection decoding temperature (0 = greedy).", 0.0)
    seed: int = doc("Reflection sampling seed (used when temperature > 0).", 0)
    max_operations_per_cycle: int = doc("Operations applied per cycle at most; the rest are dropped and counted.", 4)


@dataclass
class GuidanceConfig:
    """The versioned mission guidance (experiences the rollout prompt shows)."""

    path: str | None = doc("Initial guidance JSON ({\"experiences\": {id: text}} or a list of texts); null = empty.", None)
    snapshot_retention: int = doc("Guidance snapshots kept under guidance_snapshots/ (newest first).", 5)


@dataclass
class RunnerConfig:
    """Batches, epochs and the distributed runtime."""

    per_rank_rollout_batch_size: int = doc("P: tickets per rank per rollout step; global batch = P × WORLD_SIZE.", 4)
    epochs: int = doc("Passes over the tickets.", 1)
    shuffle: bool = doc("Shuffle each epoch with Random(seed + epoch) (identical on every rank).", True)
    seed: int = doc("Run seed (ticket order).", 0)
    collective_timeout_s: float = doc(
        "Deadline of every collective (gloo). Must exceed the slowest rank's rollout of one batch.", 1800.0
    )
    progress: bool = doc("Log one line per global batch on rank 0.", True)


@dataclass
class OutputConfig:
    """Where rank 0 writes artifacts: {root}/{run_name}/{mission_slug}/."""

    root: str = doc("Artifacts root.", "runs/stage_b")
    overwrite: bool = doc("Clear an existing run directory at start (rank 0); false = fail if it has artifacts.", True)


@dataclass
class StageBConfig:
    """The whole Stage-B configuration."""

    model: StageBModelConfig = doc("The judge model.")
    run_name: str = doc("Run directory name under output.root.", "stage_b")
    tickets: TicketsConfig = doc("Ticket source.", factory=TicketsConfig)
    sampler: SamplerConfig = doc("Rollout sampling.", factory=SamplerConfig)
    selection: SelectionConfig = doc("Verdict selection.", factory=SelectionConfig)
    reflection: ReflectionConfig = doc("Rank-0 reflection.", factory=ReflectionConfig)
    guidance: GuidanceConfig = doc("Guidance store.", factory=GuidanceConfig)
    runner: RunnerConfig = doc("Batches and distribution.", factory=RunnerConfig)
    output: OutputConfig = doc("Artifacts.", factory=OutputConfig)

    def validate(self, problems: typing.Any) -> None:
        """Semantic rules (types are already checked); every problem is added, none raised."""

        def at_least(key: str, value: object, minimum: float) -> None:
            if isinstance(value, (int, float)) and value < minimum:
                problems.add(key, value, f"must be ≥ {minimum}", f"set {key} to at least {minimum}")

        def share(key: str, value: object) -> None:
            if isinstance(value, float) and not 0.0 <= value <= 1.0:
                problems.add(key, value, "outside [0, 1]", f"set {key} to a share between 0.0 and 1.0")

        r, s, refl = self.runner, self.sampler, self.reflection
        at_least("runner.per_rank_rollout_batch_size", r.per_rank_rollout_batch_size, 1)
        at_least("runner.epochs", r.epochs, 1)
        if isinstance(r.collective_timeout_s, float) and r.collective_timeout_s <= 0:
            problems.add("runner.collective_timeout_s", r.collective_timeout_s, "must be > 0", "use e.g. 1800")
        if not s.grid:
            problems.add("sampler.grid", [], "empty decode grid", "add at least one entry, e.g. - {temperature: 0.7}")
        for i, d in enumerate(s.grid):
            key = f"sampler.grid[{i}]"
            if isinstance(d.temperature, float) and d.temperature < 0:
                problems.add(f"{key}.temperature", d.temperature, "must be ≥ 0", "use 0 for greedy or e.g. 0.7")
            if isinstance(d.top_p, float) and not 0 < d.top_p <= 1:
                problems.add(f"{key}.top_p", d.top_p, "must be in (0, 1]", "use 1.0 (off) or e.g. 0.9")
            if isinstance(d.repetition_penalty, float) and d.repetition_penalty <= 0:
                problems.add(f"{key}.repetition_penalty", d.repetition_penalty, "must be > 0", "use 1.0 (off)")
            at_least(f"{key}.max_new_tokens", d.max_new_tokens, 1)
        at_least("sampler.samples_per_decode", s.samples_per_decode, 1)
        at_least("sampler.generate_batch_size", s.generate_batch_size, 1)
        share("sampler.scripted.malformed_share", s.scripted.malformed_share)
        share("selection.min_verdict_agreement", self.selection.min_verdict_agreement)
        at_least("reflection.batch_size", refl.batch_size, 1)
        at_least("reflection.max_attempts", refl.max_attempts, 1)
        at_least("reflection.max_new_tokens", refl.max_new_tokens, 1)
        at_least("reflection.max_operations_per_cycle", refl.max_operations_per_cycle, 1)
        at_least("reflection.temperature", refl.temperature, 0)
        at_least("guidance.snapshot_retention", self.guidance.snapshot_retention, 1)
        demo = self.tickets.demo
        at_least("tickets.demo.num_groups", demo.num_groups, 1)
        at_least("tickets.demo.images_per_group", demo.images_per_group, 1)
        share("tickets.demo.fail_share", demo.fail_share)
        if isinstance(self.tickets.path, str) and not Path(self.tickets.path).is_file():
            problems.add("tickets.path", self.tickets.path, "file not found",
                         "point it at a ticket JSONL (python tools/make_tickets.py --out PATH), or null for the demo set")
        if isinstance(self.guidance.path, str) and not Path(self.guidance.path).is_file():
            problems.add("guidance.path", self.guidance.path, "file not found", "point it at a guidance JSON or use null")
        dm = self.model.device_map
        if isinstance(dm, str) and dm not in ("auto", "cpu") and not dm.startswith("cuda"):
            problems.add("model.device_map", dm, "unknown placement", "use auto, cpu or cuda:N")
        for key in ("run_name",):
            v = getattr(self, key)
            if isinstance(v, str) and (not v or "/" in v or v in (".", "..")):
                problems.add(key, v, "not a plain directory name", "use letters, digits, - and _")


def load_stage_b_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> StageBConfig:
    """YAML + dotted overrides → a validated :class:`StageBConfig` (raises ConfigError with every problem)."""
    return load_config(path, overrides, schema=StageBConfig)
