"""Per-rank rollout: the rank's shard × the decode grid × samples, parsed into candidates.

Every rank loads the whole judge model (Stage-B is data-parallel over tickets) and generates
in-process through the ``hf`` engine's synchronous generator (``common.generation.generator``), the
same code the rollout server runs, so a prompt is templated and decoded the same way in both::

    shard tickets ──rollout_messages(summaries, batch snapshot)──► prompts
    for entry d in sampler.grid, sample j < samples_per_decode:
        SamplingParams(d, seed = d.seed + j) ──generate(chunk of ≤ generate_batch_size prompts)──► texts
        text ──parse_verdict──► Candidate(verdict, reason, format_ok, guidance_step, rank, ...)

``sampler.backend: scripted`` swaps the generator for :class:`stage_b.scripted.ScriptedGenerator`
(tests only; see there).

What this module does not know: other ranks, selection, files.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from common.wire.http import InferOutput, SamplingParams
from stage_b.config import ReflectionConfig, SamplerConfig, StageBModelConfig
from stage_b.distributed import Placement
from stage_b.guidance import GuidanceSnapshot
from stage_b.prompts import parse_verdict, rollout_messages
from stage_b.selection import Candidate
from stage_b.tickets import Ticket

log = logging.getLogger(__name__)


class Generator(Protocol):
    """The hf engine's synchronous generator interface (``HFGenerator.generate``)."""

    def generate(self, prompts: Sequence[Any], images: Any, sampling: SamplingParams) -> list[InferOutput]: ...


def load_judge(cfg: StageBModelConfig, placement: Placement) -> tuple[Any, Any]:
    """(model, tokenizer) for this rank; the whole model on ``placement``.

    Stage-B prompts are text only (the per-image Stage-A summaries stand in for the images), so the
    judge needs the tokenizer and its chat template, not the image processor (which would also pull
    in torchvision for the Qwen-VL video processor).
    """
    path = Path(cfg.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path {cfg.path!r} is not a model directory (no config.json). "
            f"Fix: build the tiny model with `make tiny-model` (python tools/make_tiny_model.py --out {cfg.path}) "
            "or point model.path at a checkpoint"
        )
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    cuda = placement.device.startswith("cuda")
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": cfg.attn_implementation}
    if placement.device_map is not None:
        kwargs["device_map"] = placement.device_map
    model = AutoModelForImageTextToText.from_pretrained(str(path), **kwargs)
    if placement.device_map is None:
        model.to(placement.device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    log.info("judge loaded from %s on %s (%s)", path, placement.device, dtype)
    return model, tokenizer


def build_generator(sampler: SamplerConfig, model_cfg: StageBModelConfig, placement: Placement) -> Generator:
    """The configured backend: the real model through the hf engine, or the scripted peer."""
    if sampler.backend == "scripted":
        from stage_b.scripted import ScriptedGenerator

        log.warning("sampler.backend=scripted: answers come from a rule-based peer, not a model (tests only)")
        return ScriptedGenerator(sampler.scripted)
    from common.generation.generator import HFGenerator

    model, tokenizer = load_judge(model_cfg, placement)
    return HFGenerator(model, tokenizer, placement.device, max_batch=sampler.generate_batch_size)


class RolloutSampler:
    """Generates every candidate of a rank's shard under one guidance snapshot."""

    def __init__(self, generator: Generator, cfg: SamplerConfig, mission: str, rank: int) -> None:
        self.generator, self.cfg, self.mission, self.rank = generator, cfg, mission, rank

    def generate_for_batch(self, tickets: Sequence[Ticket], snapshot: GuidanceSnapshot) -> dict[str, list[Candidate]]:
        """{ticket key: candidates in grid × sample order} for ``tickets`` (may be empty)."""
        out: dict[str, list[Candidate]] = {t.key: [] for t in tickets}
        if not tickets:
            return out
        prompts = [rollout_messages(self.mission, t.summaries, snapshot.step, snapshot.experiences) for t in tickets]
        bs = self.cfg.generate_batch_size
        for d_idx, d in enumerate(self.cfg.grid):
            for j in range(self.cfg.samples_per_decode):
                seed = None if d.seed is None else d.seed + j
                sampling = SamplingParams(temperature=d.temperature, top_p=d.top_p, max_tokens=d.max_new_tokens,
                                          seed=seed, repetition_penalty=d.repetition_penalty)
                for lo in range(0, len(tickets), bs):
                    chunk = range(lo, min(lo + bs, len(tickets)))
                    results = self.generator.generate([prompts[i] for i in chunk], None, sampling)
                    if len(results) != len(chunk):
                        raise RuntimeError(f"generator returned {len(results)} outputs for {len(chunk)} prompts")
                    for i, res in zip(chunk, results):
                        v = parse_verdict(res.text)
                        out[tickets[i].key].append(Candidate(
                            ticket_key=tickets[i].key, rank=self.rank, guidance_step=snapshot.step,
                            decode_index=d_idx, sample_index=j, temperature=d.temperature, top_p=d.top_p,
                            max_new_tokens=d.max_new_tokens, seed=seed, text=res.text,
                            finish_reason=res.finish_reason, verdict=v.verdict, reason=v.reason,
                            format_ok=v.format_ok,
                        ))
        return out


def reflection_completer(generator: Generator, cfg: ReflectionConfig) -> Callable[[list[dict[str, str]]], str]:
    """Chat messages → one answer text, with the reflection decoding knobs."""
    sampling = SamplingParams(temperature=cfg.temperature, top_p=1.0, max_tokens=cfg.max_new_tokens,
                              seed=cfg.seed if cfg.temperature > 0 else None)

    def complete(messages: list[dict[str, str]]) -> str:
        return generator.generate([messages], None, sampling)[0].text

    return complete
