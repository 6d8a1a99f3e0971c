"""Our ``/infer`` items and sampling ↔ vLLM's inputs and outputs, for :mod:`rollout_server.engines.vllm.engine`.

* Sampling (:func:`sampling_kwargs`, the fields of ``vllm.SamplingParams`` but ``output_kind``): every
  field passed explicitly, because vLLM's defaults differ from ours (``max_tokens`` 16): ``top_k <= 0``
  becomes -1 (off in every supported release), stops are the chat template's turn end and eos
  (:func:`stop_token_ids`; kept as the last token, as the hf engine does) plus the request's strings
  (``ignore_eos``: no stop ids, and vLLM's own ``ignore_eos`` so the checkpoint's eos ids do not stop either);
  ``logprobs=True`` becomes ``logprobs=0`` (the sampled token only), read back by :func:`sampled_logprobs`.
* Prompts (:func:`vllm_prompt`): chat prompts are rendered with the checkpoint's chat template and
  sent as text plus PIL images, so vLLM expands the image placeholders itself; token-id prompts carry
  one ``<|image_pad|>`` per image (the template's form). An id outside the vocabulary, or image parts
  and images that do not pair up, are an EngineInputError (400) naming the field.
* Outputs (:func:`infer_output`): vLLM's final ``RequestOutput`` as an ``InferOutput``; a finish
  reason other than ``stop`` or ``length`` is ``abort``.

This module never imports vLLM (it only knows the names of its fields), so it runs anywhere.

What this module does not know: ``AsyncLLM``, the event loop, weights or the fence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from common.wire.http import InferItem, InferOutput, SamplingParams
from rollout_server.engines.base import EngineInputError


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The ids generation stops at: eos and, where the vocabulary has it, the chat turn end."""
    stop = {tokenizer.eos_token_id}
    if "<|im_end|>" in tokenizer.get_vocab():
        stop.add(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return sorted(i for i in stop if i is not None)


def sampling_kwargs(s: SamplingParams, stop_ids: list[int]) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one request's items, all but ``output_kind``."""
    return dict(n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else -1,
                min_p=0.0, max_tokens=s.max_tokens, min_tokens=0, seed=s.seed, stop=list(s.stop),
                stop_token_ids=[] if s.ignore_eos else stop_ids, ignore_eos=s.ignore_eos,
                repetition_penalty=s.repetition_penalty, presence_penalty=0.0, frequency_penalty=0.0,
                skip_special_tokens=False,
                spaces_between_special_tokens=False, logprobs=0 if s.logprobs else None)


def vllm_prompt(item: InferItem, row: int, tokenizer: Any, vocab: int) -> dict[str, Any]:
    """The prompt dict ``AsyncLLM.generate`` takes for item ``row`` (images loaded here)."""
    from common.data.images import load_image

    images = list(item.images or [])
    if item.prompt_token_ids is not None:
        bad = [t for t in item.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise EngineInputError(f"token id {bad[0]} is outside the vocabulary", f"items.{row}.prompt_token_ids")
        prompt: dict[str, Any] = {"prompt_token_ids": list(item.prompt_token_ids)}
        refs = images
    else:
        msgs, refs, queue = [], [], list(images)
        for m in item.messages or []:
            if isinstance(m.content, str):
                msgs.append({"role": m.role, "content": m.content})
                continue
            parts = []
            for p in m.content:
                if p.type == "image":
                    if p.image is None and not queue:
                        raise EngineInputError("more image parts than images", f"items.{row}.images")
                    refs.append(p.image if p.image is not None else queue.pop(0))
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": p.text})
            msgs.append({"role": m.role, "content": parts})
        if queue:
            raise EngineInputError(f"{len(queue)} image(s) left without an image part", f"items.{row}.images")
        prompt = {"prompt": tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)}
    if refs:
        prompt["multi_modal_data"] = {"image": [load_image(r, f"items.{row}.images.{j}") for j, r in enumerate(refs)]}
    return prompt


def infer_output(final: Any, item_id: str | None, with_logprobs: bool) -> InferOutput:
    """vLLM's final ``RequestOutput`` of one item (``n=1``: its first completion) as ours."""
    c = final.outputs[0]
    reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
    token_ids = list(c.token_ids)
    return InferOutput(id=item_id, token_ids=token_ids, text=c.text, finish_reason=reason,
                       prompt_token_ids=list(final.prompt_token_ids or []),
                       logprobs=sampled_logprobs(token_ids, c.logprobs) if with_logprobs else None)


def sampled_logprobs(token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]] | None) -> list[float]:
    """The sampled token's logprob at each position of a ``CompletionOutput``.

    ``logprobs`` is vLLM's ``CompletionOutput.logprobs``: per generated token, a mapping token id ->
    ``Logprob`` (``.logprob``, ``.rank``, ``.decoded_token``) that holds the sampled token (with
    ``SamplingParams(logprobs=0)``, only it). A missing position, a missing token or a non-finite value
    means the request did not ask for logprobs or vLLM broke its contract: RuntimeError naming it.
    """
    if logprobs is None or len(logprobs) != len(token_ids):
        got = "no logprobs" if logprobs is None else f"{len(logprobs)} logprob entries"
        raise RuntimeError(f"vLLM returned {got} for {len(token_ids)} generated tokens")
    out = []
    for k, (tok, entry) in enumerate(zip(token_ids, logprobs)):
        lp = entry.get(tok) if entry is not None else None
        value = float(lp.logprob) if lp is not None else math.nan
        if not math.isfinite(value):
            raise RuntimeError(f"vLLM returned logprob {value} for sampled token {tok} at position {k}")
        out.append(value)
    return out
