"""vLLM's sampling semantics on top of transformers ``generate`` (used by the hf engine).

transformers' own knobs differ from vLLM's in ways that change rollouts: ``top_k`` defaults to 50
(vLLM: off), the checkpoint's ``generation_config`` may add a repetition penalty, there is no
per-request seed, and the repetition penalty also counts left-padding tokens. So the hf engine runs
``generate`` greedily with one :class:`VLLMSampler` as the last logits processor, which does the
whole decision per row and returns scores whose argmax is the chosen token:

    repetition penalty (prompt + output tokens, padding excluded; >0 logits divided, <0 multiplied)
    -> temperature < 1e-5: argmax (greedy; top-k/top-p ignored, as in vLLM)
    -> else logits / temperature -> top-k (k <= 0 = off) -> top-p (vLLM's mask: sorted ascending,
       drop while cumulative mass <= 1 - p, always keep the top token) -> one multinomial draw from
       this row's own torch.Generator

Stop: the turn-end / eos ids (kept as the last token; not with ``ignore_eos``), ``stop`` strings (the
text is cut before the string, the token that completed it is the last token), or ``max_tokens`` (``length``).

Logprobs (``sampling.logprobs``): the sampler also records, each step, log_softmax of the scores it
was handed (the model's raw logits: the clean generation config adds no processor before it) at the
token it chose — vLLM's ``raw_logprobs``. They stay on the device until the batch ends (one
transfer, not one sync per step); ``finish_row`` cuts them with the row's tokens.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from typing import Any

import torch

from common.wire.http import InferOutput, SamplingParams

#: vLLM treats temperatures below this as greedy.
GREEDY_EPS = 1e-5
_SEED_SOURCE = random.SystemRandom()


class CancelledGeneration(Exception):
    """The generation was stopped by its cancel flag (a fence in abort mode, or a disconnect).

    ``tokens``: what was generated before it stopped, over every row (work done and thrown away; the
    server still counts it in ``rollout_generated_tokens_total``)."""

    def __init__(self, tokens: int = 0) -> None:
        super().__init__(tokens)
        self.tokens = tokens


class VLLMSampler:
    """A transformers LogitsProcessor that samples each row like vLLM and returns a one-hot choice."""

    def __init__(self, sampling: SamplingParams, pads: Sequence[int], batch: int, device: torch.device) -> None:
        self.s = sampling
        self.pads = list(pads)
        self.greedy = sampling.temperature < GREEDY_EPS
        self.batch = batch
        self._logprobs: list[torch.Tensor] | None = [] if sampling.logprobs else None  # one (batch,) per step
        self.generators: list[torch.Generator] = []
        if not self.greedy:
            for _ in range(batch):
                g = torch.Generator(device=device)
                g.manual_seed(sampling.seed if sampling.seed is not None else _SEED_SOURCE.randrange(2**63))
                self.generators.append(g)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logits = scores.float()
        # Before the penalty, which edits `logits` (for float32 scores, `scores` itself) in place.
        raw = logits.log_softmax(dim=-1) if self._logprobs is not None else None
        if self.s.repetition_penalty != 1.0:
            rp = self.s.repetition_penalty
            for i, pad in enumerate(self.pads):
                seen = input_ids[i, pad:]
                vals = logits[i].gather(0, seen)
                logits[i].scatter_(0, seen, torch.where(vals > 0, vals / rp, vals * rp))
        if self.greedy:
            chosen = logits.argmax(dim=-1)
        else:
            logits = logits / self.s.temperature
            vocab = logits.shape[-1]
            if 0 < self.s.top_k < vocab:
                kth = logits.topk(self.s.top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            if self.s.top_p < 1.0:
                sorted_logits, order = logits.sort(dim=-1, descending=False)
                cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
                drop = cum <= 1.0 - self.s.top_p
                drop[:, -1] = False
                sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
                logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
            probs = logits.softmax(dim=-1)
            chosen = torch.stack([
                torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(self.generators)
            ])
        if raw is not None:
            self._logprobs.append(raw.gather(-1, chosen.unsqueeze(-1)).squeeze(-1))
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(-1, chosen.unsqueeze(-1), 0.0)
        return out

    def sampled_logprobs(self) -> list[list[float]] | None:
        """Per row, the raw logprob of the token chosen at each step so far (rows finished early keep
        entries for the padding steps; ``finish_row`` drops them); None when not requested."""
        if self._logprobs is None:
            return None
        if not self._logprobs:
            return [[] for _ in range(self.batch)]
        return torch.stack(self._logprobs, dim=1).tolist()


class StopOnStrings:
    """A transformers StoppingCriteria: per-row stop strings, plus everything when ``cancel`` is set."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], prompt_width: int, cancel: threading.Event | None) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.width = prompt_width
        self.cancel = cancel

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        batch = input_ids.shape[0]
        if self.cancel is not None and self.cancel.is_set():
            return torch.ones(batch, dtype=torch.bool, device=input_ids.device)
        done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        if self.stops:
            for i in range(batch):
                text = self.tokenizer.decode(input_ids[i, self.width:], skip_special_tokens=False)
                done[i] = any(s in text for s in self.stops)
        return done


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def finish_row(
    tokenizer: Any, prompt_ids: list[int], toks: list[int], stop_ids: Sequence[int], sampling: SamplingParams, pad_id: int,
    logprobs: Sequence[float] | None = None,
) -> InferOutput:
    """Cut one row's generated ids at its first stop (turn end, stop string) and name the reason.

    ``logprobs`` (one per entry of ``toks``, or None) is cut to the same length as the ids kept.
    """
    ids, text, reason = _cut(tokenizer, toks, stop_ids, sampling)
    return InferOutput(token_ids=ids, text=text, finish_reason=reason, prompt_token_ids=prompt_ids,
                       logprobs=None if logprobs is None else [float(x) for x in logprobs[: len(ids)]])


def _cut(tokenizer: Any, toks: list[int], stop_ids: Sequence[int], sampling: SamplingParams
         ) -> tuple[list[int], str, str]:
    stop_set = set(stop_ids)
    end = next((k for k, t in enumerate(toks) if t in stop_set), None)
    body = toks[:end] if end is not None else toks
    stops = [s for s in sampling.stop if s]
    if stops and any(s in _decode(tokenizer, body) for s in stops):
        for k in range(len(body)):
            text = _decode(tokenizer, body[: k + 1])
            hits = [text.find(s) for s in stops if s in text]
            if hits:
                return body[: k + 1], text[: min(hits)], "stop"
    if end is not None:
        return toks[: end + 1], _decode(tokenizer, body), "stop"
    # No stop: the row ran to max_tokens (rows never end early without a stop).
    return toks, _decode(tokenizer, toks), "length"
