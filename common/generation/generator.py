"""Batched, cancellable generation over a transformers model with vLLM's sampling semantics.

:class:`HFGenerator` is synchronous and has no web dependencies. It turns prompts (chat messages
with images, or token ids) into one left-padded batch through the model's own processor and chat
template, and decodes with :mod:`common.generation.sampling` so that the knobs mean what they mean in
vLLM. Two processes use it: the rollout server's ``hf`` engine (``rollout_server/engines/hf.py``,
on a worker thread) and Stage-B's in-process sampler (``stage_b/rollout.py``).

Images are file paths, ``data:image/...;base64,`` URIs, or PIL images (:func:`common.data.images.load_image`).
Token-id prompts with images may carry one ``<|image_pad|>`` per image (the chat template's form,
which vLLM expects and expands itself) or the processor's expanded form; both work here. A prompt
that cannot be served as given raises :class:`common.data.images.InputError` naming the request field.

What this module does not know: HTTP, versions, the fence, weight updates. It never re-tokenises
generated text.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from common.data.images import InputError, load_image
from common.wire.http import InferOutput, SamplingParams
from common.generation.sampling import CancelledGeneration, StopOnStrings, VLLMSampler, finish_row

Prompt = Sequence[int] | Sequence[dict[str, Any]]


@dataclass
class _Row:
    """One encoded prompt: ids as the model sees them plus its share of the vision inputs."""

    input_ids: list[int]
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)  # shape (len(input_ids),)
    vision: dict[str, torch.Tensor] = field(default_factory=dict)  # concatenated on dim 0 in a batch


class HFGenerator:
    """Batched, cancellable generation over a transformers model with vLLM sampling semantics.

    ``generate(prompts, images, sampling)``: ``prompts[i]`` is a list of chat messages (HF or
    protocol style: ``{"role", "content": str | [{"type": "text", "text"}, {"type": "image",
    "image"?: ref}]}``) or a list of token ids; ``images[i]`` fills, in order, the image parts that
    carry no ``image`` of their own. Returns one :class:`~common.wire.http.InferOutput` per prompt.

    Seeds: every row draws from its own ``torch.Generator`` (seeded with ``sampling.seed``, or from
    the OS when None), so a seeded row gives the same tokens whatever else shares its batch, as in
    vLLM — up to float differences of the padded batch on near-ties.

    Not thread-safe: one generate at a time per instance (the engine runs it on one thread).
    """

    def __init__(self, model: Any, processor: Any, device: str | torch.device | None = None, max_batch: int = 16) -> None:
        from transformers import GenerationConfig

        self.model = model.eval()
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.max_batch = max(1, int(max_batch))
        tok = self.tokenizer
        stop = set()
        for src in (getattr(model, "generation_config", None), tok):
            eos = getattr(src, "eos_token_id", None)
            stop.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        im_end = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None
        if im_end is not None:
            stop.add(im_end)
        self.stop_token_ids = sorted(int(i) for i in stop)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.stop_token_ids[0]
        cfg = getattr(model.config, "text_config", model.config)
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        # A clean generation config: the checkpoint's own defaults (repetition_penalty, top_k, ...)
        # must not leak into a request; transformers fills unset fields from model.generation_config.
        self._clean_config = GenerationConfig(eos_token_id=self.stop_token_ids, pad_token_id=self.pad_id)
        self._clean_no_eos = GenerationConfig(pad_token_id=self.pad_id)  # sampling.ignore_eos

    # ------------------------------------------------------------------ encoding

    def _chat_text(self, messages: Sequence[Any], row: int, images: list[Any]) -> tuple[str, list[Any]]:
        """Render the chat template; returns the text and the image refs in slot order."""
        hf_messages, refs, queue = [], [], list(images or [])
        for m in messages:
            m = m.model_dump() if hasattr(m, "model_dump") else dict(m)
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for p in content:
                    p = p.model_dump() if hasattr(p, "model_dump") else dict(p)
                    if p.get("type") == "image":
                        if p.get("image") is not None:
                            refs.append(p["image"])
                        elif queue:
                            refs.append(queue.pop(0))
                        else:
                            raise InputError("more image parts than images", f"items.{row}.images")
                        parts.append({"type": "image"})
                    else:
                        parts.append({"type": "text", "text": p.get("text") or ""})
                content = parts
            hf_messages.append({"role": m["role"], "content": content})
        if queue:
            raise InputError(f"{len(queue)} image(s) left without an image part", f"items.{row}.images")
        templater = self.processor if hasattr(self.processor, "apply_chat_template") else self.tokenizer
        text = templater.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True)
        return text, refs

    def _encode(self, prompt: Prompt, images: list[Any] | None, row: int) -> _Row:
        images = list(images or [])
        if prompt and isinstance(prompt[0], int):
            ids = [int(i) for i in prompt]
            refs = images
            pil = [load_image(r, f"items.{row}.images.{j}") for j, r in enumerate(refs)]
            return self._encode_ids(ids, pil, row)
        text, refs = self._chat_text(prompt, row, images)
        pil = [load_image(r, f"items.{row}.images.{j}") for j, r in enumerate(refs)]
        if pil and not hasattr(self.processor, "image_processor"):
            raise InputError("this model's processor takes no images", f"items.{row}.images")
        kwargs = {"images": pil} if pil else {}
        enc = self.processor(text=[text], return_tensors="pt", **kwargs) if hasattr(self.processor, "image_processor") \
            else self.tokenizer([text], return_tensors="pt", add_special_tokens=False)
        return self._row_from(enc)

    def _encode_ids(self, ids: list[int], pil: list[Any], row: int) -> _Row:
        vocab = self.tokenizer.vocab_size + len(self.tokenizer.get_added_vocab())
        bad = [i for i in ids if not 0 <= i < max(vocab, self.model.get_input_embeddings().num_embeddings)]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary", f"items.{row}.prompt_token_ids")
        enc: dict[str, Any] = {}
        if pil:
            image_id = getattr(self.processor, "image_token_id", None)
            merge = getattr(getattr(self.processor, "image_processor", None), "merge_size", None)
            if image_id is None or merge is None:
                raise InputError("token-id prompts with images need a Qwen-VL style processor; send messages",
                                       f"items.{row}.prompt_token_ids")
            vis = self.processor.image_processor(images=pil, return_tensors="pt")
            counts = [int(g.prod()) // merge**2 for g in vis["image_grid_thw"]]
            slots = [k for k, t in enumerate(ids) if t == image_id]
            if len(slots) == len(pil):  # template form: expand each pad to the image's token count
                out: list[int] = []
                it = iter(counts)
                for t in ids:
                    out.extend([t] * next(it) if t == image_id else [t])
                ids = out
            elif len(slots) != sum(counts):
                raise InputError(
                    f"{len(slots)} image pad tokens for {len(pil)} image(s) needing {counts} tokens; "
                    "send one pad per image (chat-template form) or the expanded form",
                    f"items.{row}.prompt_token_ids")
            enc.update(vis)
        enc["input_ids"] = torch.tensor([ids])
        if hasattr(self.processor, "create_mm_token_type_ids") and getattr(self.processor, "return_mm_token_type_ids", False):
            enc["mm_token_type_ids"] = torch.as_tensor(self.processor.create_mm_token_type_ids([ids]))
        return self._row_from(enc)

    @staticmethod
    def _row_from(enc: Any) -> _Row:
        ids = enc["input_ids"][0]
        row = _Row(input_ids=[int(i) for i in ids])
        for k, v in dict(enc).items():
            if k in ("input_ids", "attention_mask") or not isinstance(v, torch.Tensor):
                continue
            if v.dim() == 2 and v.shape == (1, len(ids)):
                row.per_token[k] = v[0]
            else:
                row.vision[k] = v
        return row

    def prepare(self, prompts: Sequence[Prompt], images: Sequence[list[Any] | None] | None = None, *,
                cancel: threading.Event | None = None) -> list[_Row]:
        """Encode every prompt (load images, apply the template); raises InputError early, and
        CancelledGeneration between prompts once ``cancel`` is set."""
        images = list(images) if images is not None else [None] * len(prompts)
        if len(images) != len(prompts):
            raise InputError(f"{len(images)} image lists for {len(prompts)} prompts", "images")
        rows = []
        for i, (p, im) in enumerate(zip(prompts, images)):
            if cancel is not None and cancel.is_set():
                raise CancelledGeneration(0)
            rows.append(self._encode(p, im, i))
        return rows

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: Sequence[Prompt],
        images: Sequence[list[Any] | None] | None,
        sampling: SamplingParams,
        *,
        cancel: threading.Event | None = None,
        ids: Sequence[str | None] | None = None,
    ) -> list[InferOutput]:
        """Complete every prompt; raises CancelledGeneration if ``cancel`` is set meanwhile."""
        rows = self.prepare(prompts, images, cancel=cancel)
        return self.generate_rows(rows, sampling, cancel=cancel, ids=ids)

    def generate_rows(self, rows: list[_Row], sampling: SamplingParams, *, cancel: threading.Event | None = None,
                      ids: Sequence[str | None] | None = None) -> list[InferOutput]:
        """Complete encoded rows (:meth:`prepare`), ``max_batch`` at a time; ``cancel`` as in :meth:`generate`."""
        for i, r in enumerate(rows):
            if self.max_positions and len(r.input_ids) + sampling.max_tokens > self.max_positions:
                raise InputError(
                    f"prompt of {len(r.input_ids)} tokens + max_tokens {sampling.max_tokens} exceeds the model's "
                    f"{self.max_positions} positions (item {i})", "sampling.max_tokens")
        outputs: list[InferOutput] = []
        for start in range(0, len(rows), self.max_batch):
            try:
                outputs += self._generate_batch(rows[start:start + self.max_batch], sampling, cancel)
            except CancelledGeneration as exc:  # the chunks already done were generated too
                raise CancelledGeneration(exc.tokens + sum(len(o.token_ids) for o in outputs)) from None
        if ids is not None:
            outputs = [o.model_copy(update={"id": i}) for o, i in zip(outputs, ids)]
        return outputs

    @torch.inference_mode()
    def _generate_batch(self, rows: list[_Row], sampling: SamplingParams, cancel: threading.Event | None) -> list[InferOutput]:
        if cancel is not None and cancel.is_set():
            raise CancelledGeneration()
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        width = max(len(r.input_ids) for r in rows)
        pads = [width - len(r.input_ids) for r in rows]
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        extra: dict[str, torch.Tensor] = {}
        per_token_keys = sorted({k for r in rows for k in r.per_token})
        for k in per_token_keys:
            dtype = next(r.per_token[k].dtype for r in rows if k in r.per_token)
            extra[k] = torch.zeros((len(rows), width), dtype=dtype)
        for i, (r, p) in enumerate(zip(rows, pads)):
            input_ids[i, p:] = torch.tensor(r.input_ids)
            attention[i, p:] = 1
            for k in per_token_keys:
                if k in r.per_token:
                    extra[k][i, p:] = r.per_token[k]
        for k in sorted({k for r in rows for k in r.vision}):
            extra[k] = torch.cat([r.vision[k] for r in rows if k in r.vision], dim=0)
        model_dtype = next(self.model.parameters()).dtype
        inputs = {"input_ids": input_ids, "attention_mask": attention, **extra}
        inputs = {k: (v.to(self.device, model_dtype) if v.is_floating_point() else v.to(self.device)) for k, v in inputs.items()}

        sampler = VLLMSampler(sampling, pads, len(rows), self.device)
        stopper = StopOnStrings(self.tokenizer, sampling.stop, width, cancel)
        stop_ids = [] if sampling.ignore_eos else self.stop_token_ids
        gen_config = GenerationConfig(
            max_new_tokens=sampling.max_tokens, do_sample=False, num_beams=1, use_cache=True, repetition_penalty=1.0,
            eos_token_id=stop_ids or None, pad_token_id=self.pad_id,
        )
        clean = self._clean_config if stop_ids else self._clean_no_eos
        saved, self.model.generation_config = self.model.generation_config, clean
        try:
            seqs = self.model.generate(
                **inputs, generation_config=gen_config,
                logits_processor=LogitsProcessorList([sampler]),
                stopping_criteria=StoppingCriteriaList([stopper]),
            )
        finally:
            self.model.generation_config = saved
        if cancel is not None and cancel.is_set():
            # The stopping criterion ended generate at the first token after the flag was set: count what
            # the rows generated until then (rows that finished earlier are padded after their end).
            raise CancelledGeneration(int((seqs[:, width:] != self.pad_id).sum()))
        new = seqs[:, width:].tolist()
        logprobs = sampler.sampled_logprobs()  # one per step and row, or None
        if logprobs is not None and len(logprobs[0]) != len(new[0]):
            raise RuntimeError(f"the sampler ran {len(logprobs[0])} steps for {len(new[0])} generated tokens: "
                               "transformers generate called its logits processors an unexpected number of times")
        return [
            finish_row(self.tokenizer, r.input_ids, toks, stop_ids, sampling, self.pad_id,
                       logprobs=None if logprobs is None else logprobs[i])
            for i, (r, toks) in enumerate(zip(rows, new))
        ]
