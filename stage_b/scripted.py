"""The scripted judge: a deterministic stand-in for the model, chosen by ``sampler.backend: scripted``.

It exists so that tests (and anyone debugging the distributed runner) can drive selection and
reflection with well-formed answers; a random-weight tiny model answers garbage, which exercises
only the failure paths. It is never what production or the CPU demo runs (those use ``hf``).

It has the generator signature of the hf engine, ``generate(prompts, images, sampling) ->
list[InferOutput]``, and answers by rule:

  - a rollout prompt gets two lines, ``<verdict>`` and a reason; the verdict is
    ``sampler.scripted.verdict`` (``pass`` / ``fail``) or, for ``hash``, a stable hash of the prompt
    text and the sampling seed. A ``malformed_share`` of answers (stable hash) are one garbage line;
  - a reflection prompt (recognised by its system text) gets one ``upsert`` whose evidence is every
    ticket key listed in the prompt, so every reflection applies and the guidance step advances.

What this module does not know: tokenizers, torch, ranks. Token ids in its outputs are empty.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Sequence

from common.wire.http import InferOutput, SamplingParams
from stage_b.config import ScriptedConfig
from stage_b.prompts import REFLECTION_SYSTEM, REFLECTION_TICKET_PREFIX

_TICKET_LINE = re.compile(rf"^{re.escape(REFLECTION_TICKET_PREFIX)}(\S+): label=", re.MULTILINE)


def _unit(*parts: Any) -> float:
    """A stable number in [0, 1) from ``parts`` (no Python hash randomisation)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _text_of(messages: Any) -> tuple[str, str]:
    """(system text, everything else) of one chat prompt."""
    system, rest = "", []
    for m in messages:
        role = m["role"] if isinstance(m, dict) else m.role
        content = m["content"] if isinstance(m, dict) else m.content
        if not isinstance(content, str):
            content = "".join(getattr(p, "text", None) or (p.get("text") if isinstance(p, dict) else "") or ""
                              for p in content)
        if role == "system":
            system += content
        else:
            rest.append(content)
    return system, "\n".join(rest)


class ScriptedGenerator:
    """Rule-based answers with the hf engine's ``generate`` signature."""

    def __init__(self, cfg: ScriptedConfig) -> None:
        self.cfg = cfg
        self.calls = 0

    def generate(self, prompts: Sequence[Any], images: Any, sampling: SamplingParams) -> list[InferOutput]:
        self.calls += 1
        return [self._answer(p, sampling) for p in prompts]

    def _answer(self, messages: Any, sampling: SamplingParams) -> InferOutput:
        system, user = _text_of(messages)
        if system == REFLECTION_SYSTEM:
            keys = _TICKET_LINE.findall(user)
            text = json.dumps({"operations": [{
                "op": "upsert", "id": None, "evidence": keys,
                "text": f"Re-check the summaries of {len(keys)} ticket(s) such as {keys[0] if keys else '-'} "
                        "before deciding.",
            }]})
        elif _unit("malformed", user, sampling.seed) < self.cfg.malformed_share:
            text = "the packages look fine i think"
        else:
            verdict = self.cfg.verdict
            if verdict == "hash":
                verdict = "pass" if _unit("verdict", user, sampling.seed, sampling.temperature) < 0.5 else "fail"
            text = f"{verdict}\nscripted verdict from the image summaries"
        return InferOutput(token_ids=[], text=text, finish_reason="stop", prompt_token_ids=[])
