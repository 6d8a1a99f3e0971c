"""The ``hf`` engine: transformers ``generate`` with vLLM's sampling semantics, CPU or GPU.

Two layers:

* :class:`HFGenerator` — synchronous, no web dependencies. Turns prompts (chat messages with
  images, or token ids) into one left-padded batch through the model's own processor and chat
  template, and decodes with :mod:`rollout_server.engines.sampling` so that the knobs mean what they
  mean in vLLM. Stage-B reuses it in-process.
* :class:`HFEngine` — the :class:`~rollout_server.engines.base.Engine` the server runs: generation on
  one worker thread (the event loop stays free for /health, /metrics and the fence), cancellation
  by a flag checked after every token, and a staged weight update swapped in under the fence.
  On CUDA it also receives weights over NCCL with the same packed protocol as vLLM's native
  weight transfer (``/sync/init`` joins a stand-alone group with learner rank 0, one
  ``/sync/update`` announces every tensor, the learner broadcasts packed chunks), so the NCCL sync
  path is testable on a GPU box without vLLM.

Images are server-side file paths, ``data:image/...;base64,`` URIs, or (in-process) PIL images.
Token-id prompts with images may carry one ``<|image_pad|>`` per image (the chat template's form,
which vLLM expects and expands itself) or the processor's expanded form; both work here.

What this module does not know: HTTP, versions, the fence. It never re-tokenises generated text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from common.protocol import InferItem, InferOutput, SamplingParams, TensorSpec
from rollout_server import weights as W
from rollout_server.engines.base import Engine, EngineInputError, WeightUpdateError
from rollout_server.engines.hf_inputs import load_image, load_processor
from rollout_server.engines.sampling import CancelledGeneration, StopOnStrings, VLLMSampler, finish_row

log = logging.getLogger(__name__)

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
    carry no ``image`` of their own. Returns one :class:`~common.protocol.InferOutput` per prompt.

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
                            raise EngineInputError("more image parts than images", f"items.{row}.images")
                        parts.append({"type": "image"})
                    else:
                        parts.append({"type": "text", "text": p.get("text") or ""})
                content = parts
            hf_messages.append({"role": m["role"], "content": content})
        if queue:
            raise EngineInputError(f"{len(queue)} image(s) left without an image part", f"items.{row}.images")
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
            raise EngineInputError("this model's processor takes no images", f"items.{row}.images")
        kwargs = {"images": pil} if pil else {}
        enc = self.processor(text=[text], return_tensors="pt", **kwargs) if hasattr(self.processor, "image_processor") \
            else self.tokenizer([text], return_tensors="pt", add_special_tokens=False)
        return self._row_from(enc)

    def _encode_ids(self, ids: list[int], pil: list[Any], row: int) -> _Row:
        vocab = self.tokenizer.vocab_size + len(self.tokenizer.get_added_vocab())
        bad = [i for i in ids if not 0 <= i < max(vocab, self.model.get_input_embeddings().num_embeddings)]
        if bad:
            raise EngineInputError(f"token id {bad[0]} is outside the vocabulary", f"items.{row}.prompt_token_ids")
        enc: dict[str, Any] = {}
        if pil:
            image_id = getattr(self.processor, "image_token_id", None)
            merge = getattr(getattr(self.processor, "image_processor", None), "merge_size", None)
            if image_id is None or merge is None:
                raise EngineInputError("token-id prompts with images need a Qwen-VL style processor; send messages",
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
                raise EngineInputError(
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

    def prepare(self, prompts: Sequence[Prompt], images: Sequence[list[Any] | None] | None = None) -> list[_Row]:
        """Encode every prompt (load images, apply the template); raises EngineInputError early."""
        images = list(images) if images is not None else [None] * len(prompts)
        if len(images) != len(prompts):
            raise EngineInputError(f"{len(images)} image lists for {len(prompts)} prompts", "images")
        return [self._encode(p, im, i) for i, (p, im) in enumerate(zip(prompts, images))]

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
        rows = self.prepare(prompts, images)
        return self.generate_rows(rows, sampling, cancel=cancel, ids=ids)

    def generate_rows(self, rows: list[_Row], sampling: SamplingParams, *, cancel: threading.Event | None = None,
                      ids: Sequence[str | None] | None = None) -> list[InferOutput]:
        for i, r in enumerate(rows):
            if self.max_positions and len(r.input_ids) + sampling.max_tokens > self.max_positions:
                raise EngineInputError(
                    f"prompt of {len(r.input_ids)} tokens + max_tokens {sampling.max_tokens} exceeds the model's "
                    f"{self.max_positions} positions (item {i})", "sampling.max_tokens")
        outputs: list[InferOutput] = []
        for start in range(0, len(rows), self.max_batch):
            outputs += self._generate_batch(rows[start:start + self.max_batch], sampling, cancel)
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
        gen_config = GenerationConfig(
            max_new_tokens=sampling.max_tokens, do_sample=False, num_beams=1, use_cache=True, repetition_penalty=1.0,
            eos_token_id=self.stop_token_ids, pad_token_id=self.pad_id,
        )
        saved, self.model.generation_config = self.model.generation_config, self._clean_config
        try:
            seqs = self.model.generate(
                **inputs, generation_config=gen_config,
                logits_processor=LogitsProcessorList([sampler]),
                stopping_criteria=StoppingCriteriaList([stopper]),
            )
        finally:
            self.model.generation_config = saved
        if cancel is not None and cancel.is_set():
            raise CancelledGeneration()
        new = seqs[:, width:].tolist()
        logprobs = sampler.sampled_logprobs()  # one per step and row, or None
        if logprobs is not None and len(logprobs[0]) != len(new[0]):
            raise RuntimeError(f"the sampler ran {len(logprobs[0])} steps for {len(new[0])} generated tokens: "
                               "transformers generate called its logits processors an unexpected number of times")
        return [
            finish_row(self.tokenizer, r.input_ids, toks, self.stop_token_ids, sampling, self.pad_id,
                       logprobs=None if logprobs is None else logprobs[i])
            for i, (r, toks) in enumerate(zip(rows, new))
        ]


class HFEngine(Engine):
    """The server's hf engine: HFGenerator on one worker thread plus a staged weight update."""

    name = "hf"

    def __init__(self, model_path: str, *, dtype: str = "auto", device: str = "auto", max_batch: int = 16) -> None:
        super().__init__(model_path)
        self._dtype_cfg, self._device_cfg, self._max_batch = dtype, device, max_batch
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generate")
        self.gen: HFGenerator | None = None
        self._manifest: dict[str, TensorSpec] = {}
        self._tied: list[list[str]] = []
        self._alias: dict[str, str] = {}  # tied non-first name -> manifest name
        self._params: dict[str, torch.nn.Parameter] = {}
        self._staged: dict[str, torch.Tensor] = {}
        # NCCL receive (CUDA only): one thread for the blocking collectives, the group and its key.
        self._nccl_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-nccl")
        self._group: Any = None
        self._group_key: tuple | None = None
        self._group_timeout_s = 600.0
        self._bucket_bytes = 512 << 20

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        # A daemon thread, not the pool: a SIGTERM during a slow load must not wait for it at exit.
        loop = asyncio.get_running_loop()
        done: asyncio.Future[HFGenerator] = loop.create_future()

        def load() -> None:
            try:
                gen = self._load()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                loop.call_soon_threadsafe(lambda: done.done() or done.set_exception(exc))
            else:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(gen))

        threading.Thread(target=load, name="hf-load", daemon=True).start()
        self.gen = await done
        spec, self._tied = W.manifest_of(self.gen.model)
        self._manifest = {s.name: s for s in spec}
        self._alias = {n: g[0] for g in self._tied for n in g[1:]}
        self._params = {W.hf_name(n): p for n, p in self.gen.model.named_parameters()}
        log.info("hf engine ready: %s on %s, %s, %d tensors, fingerprint %s",
                 self.model_path, self.gen.device, self.serving_dtype(), len(self._manifest), self.fingerprint())

    def _load(self) -> HFGenerator:
        from transformers import AutoModelForImageTextToText

        device = self._device_cfg
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = self._dtype_cfg
        if dtype == "auto":
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        t0 = time.monotonic()
        try:
            model = AutoModelForImageTextToText.from_pretrained(self.model_path, dtype=getattr(torch, dtype))
        except ValueError:  # a text-only checkpoint
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, dtype))
        processor = load_processor(self.model_path)
        model.to(device)
        log.info("loaded %s in %.1fs", self.model_path, time.monotonic() - t0)
        return HFGenerator(model, processor, device=device, max_batch=self._max_batch)

    async def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._drop_group()
        self._nccl_pool.shutdown(wait=False, cancel_futures=True)
        self.gen = None

    # ---------------------------------------------------------------- serving

    async def generate(self, items: Sequence[InferItem], sampling: SamplingParams) -> list[InferOutput]:
        cancel = threading.Event()
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._generate_sync, list(items), sampling, cancel)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            # Return only once the worker thread stopped computing for us: the fence counts on it.
            cancel.set()
            try:
                await fut
            except BaseException:  # noqa: BLE001 - CancelledGeneration or a late error; we are cancelled anyway
                pass
            raise

    def _generate_sync(self, items: list[InferItem], sampling: SamplingParams, cancel: threading.Event) -> list[InferOutput]:
        if cancel.is_set():
            raise CancelledGeneration()
        assert self.gen is not None, "engine not started"
        prompts = [it.messages if it.messages is not None else it.prompt_token_ids for it in items]
        return self.gen.generate(prompts, [it.images for it in items], sampling, cancel=cancel, ids=[it.id for it in items])

    def encode_text(self, prompt: str) -> list[int]:
        assert self.gen is not None, "engine not started"
        return list(self.gen.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    # ---------------------------------------------------------------- weights

    def manifest(self) -> list[TensorSpec]:
        return list(self._manifest.values())

    def tied_groups(self) -> list[list[str]]:
        return [list(g) for g in self._tied]

    def serving_dtype(self) -> str:
        assert self.gen is not None, "engine not started"
        return W.dtype_name(next(self.gen.model.parameters()).dtype)

    async def stage_bucket(self, tensors: dict[str, Any]) -> int:
        nbytes = 0
        for name, t in tensors.items():
            canonical = self._alias.get(name, name)
            spec = self._manifest.get(canonical)
            if spec is None:
                raise WeightUpdateError(f"{name!r} is not a parameter of the served model "
                                        f"(send HF module names, e.g. {next(iter(self._manifest))!r})", name)
            if canonical in self._staged:
                raise WeightUpdateError(f"{name!r} sent twice in this session"
                                        + (f" (tied with {canonical!r})" if canonical != name else ""), name)
            if list(t.shape) != spec.shape:
                raise WeightUpdateError(f"{name!r} has shape {list(t.shape)}, the served model has {spec.shape}", name)
            if W.dtype_name(t.dtype) != spec.dtype:
                raise WeightUpdateError(f"{name!r} is {W.dtype_name(t.dtype)}, the server serves {spec.dtype}: "
                                        "cast on the learner before sending", name)
        for name, t in tensors.items():
            self._staged[self._alias.get(name, name)] = t
            nbytes += t.numel() * t.element_size()
        return nbytes

    async def commit(self, expected_fingerprint: str | None = None) -> bool:
        missing = [n for n in self._manifest if n not in self._staged]
        if missing:
            raise WeightUpdateError(f"{len(missing)} of {len(self._manifest)} parameters were not sent "
                                    f"(first: {missing[0]!r}); old weights kept")
        if expected_fingerprint is not None:
            got = W.fingerprint(self._staged.items())
            if got != expected_fingerprint:
                raise WeightUpdateError(f"staged weights fingerprint {got} != learner's {expected_fingerprint}; "
                                        "old weights kept", "fingerprint")
        staged, self._staged = self._staged, {}
        await asyncio.get_running_loop().run_in_executor(self._pool, self._apply, staged)
        return True  # transformers generate keeps no cache across calls: nothing to reset

    def _apply(self, staged: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, t in staged.items():
                self._params[name].copy_(t, non_blocking=False)

    async def discard(self) -> None:
        self._staged = {}

    # ---------------------------------------------------------------- collective receive (NCCL; gloo on CPU)

    #: ``nccl``: the collective transport, over NCCL on a GPU and over gloo on CPU (the learner's sender
    #: does the same with CPU tensors), so the whole protocol runs on machines without GPUs.
    transports = ("http", "nccl")

    def collective_backend(self) -> str:
        return "nccl" if self.gen is not None and self.gen.device.type == "cuda" else "gloo"

    async def init_nccl(self, req: Any) -> None:
        """Join learner rank 0's weight-transfer group (kept across syncs while the rendezvous is the same)."""
        key = (req.master_addr, req.master_port, req.world_size, req.rank_offset)
        self._bucket_bytes = req.bucket_bytes
        if self._group is not None and self._group_key == key:
            return
        self._drop_group()
        loop = asyncio.get_running_loop()
        self._group = await loop.run_in_executor(self._nccl_pool, self._join_group, req)
        self._group_key, self._group_timeout_s = key, req.timeout_s
        log.info("joined the weight-transfer group at %s:%d as rank %d of %d", req.master_addr, req.master_port,
                 req.rank_offset, req.world_size)

    def _join_group(self, req: Any) -> Any:
        assert self.gen is not None, "engine not started"
        # gloo for a CPU engine: the same protocol end to end on machines without GPUs (tests, CI)
        group = W.TorchTransferGroup(req.master_addr, req.master_port, req.rank_offset, req.world_size,
                                     backend=self.collective_backend(), timeout_s=req.timeout_s)
        warm = torch.zeros(1, device=self.gen.device)  # creates the communicator now, not in the first sync
        W.wait_work(group.broadcast(warm), req.timeout_s, "the group's first broadcast from learner rank 0")
        return group

    def _drop_group(self) -> None:
        pg, self._group, self._group_key = self._group, None, None
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.abort()

    async def receive_nccl(self, header: Any) -> int:
        """Receive every tensor ``header`` announces, as packed broadcasts from rank 0, into the staging dict."""
        if self._group is None:
            raise WeightUpdateError("no weight-transfer group: send /sync/init with transport nccl first")
        for name, dtype, shape in zip(header.names, header.dtypes, header.shapes):
            canonical = self._alias.get(name, name)
            spec = self._manifest.get(canonical)
            if spec is None or list(shape) != spec.shape or dtype != spec.dtype or canonical in self._staged:
                raise WeightUpdateError(f"{name!r} {dtype} {list(shape)} does not match the served model "
                                        f"({'a repeat' if canonical in self._staged else spec})", name)
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        try:
            received = await loop.run_in_executor(self._nccl_pool, self._receive, header)
        except Exception:
            self._drop_group()  # a failed or timed-out collective leaves the communicator unusable
            raise
        for name, t in received.items():
            self._staged[self._alias.get(name, name)] = t
        self.last_update_info = {"path": "staged", "worker_s": time.monotonic() - t0}  # swapped in at commit
        return sum(end - begin for begin, end in header.offsets)

    def _receive(self, header: Any) -> dict[str, torch.Tensor]:
        assert self.gen is not None
        sizes = [end - begin for begin, end in header.offsets]
        out: dict[str, torch.Tensor] = {}
        for idx in W.packed_chunks(sizes, self._bucket_bytes):
            buf = torch.empty(sum(sizes[i] for i in idx), dtype=torch.uint8, device=self.gen.device)
            W.wait_work(self._group.broadcast(buf), self._group_timeout_s,
                        f"a packed weight chunk of {buf.numel()} bytes from learner rank 0")
            pos = 0
            for i in idx:
                view = buf[pos:pos + sizes[i]].view(W.torch_dtype(header.dtypes[i])).view(header.shapes[i])
                out[header.names[i]] = view
                pos += sizes[i]
        return out

    def fingerprint(self) -> str:
        return W.fingerprint((n, self._params[n]) for n in self._manifest)

    async def weights_digest(self) -> list[str]:
        """One worker: the exact digest of the served parameters, under the names and set ``fingerprint`` uses.

        Runs on the generate/commit worker thread: it reads every element (seconds for a big model on
        CPU) without blocking the event loop, and never overlaps a commit's copy into the weights.
        """
        assert self.gen is not None, "engine not started"
        loop = asyncio.get_running_loop()
        return [await loop.run_in_executor(self._pool, self._digest)]

    def _digest(self) -> str:
        with torch.no_grad():
            return W.exact_digest((n, self._params[n]) for n in self._manifest)

    def health_info(self) -> dict[str, Any]:
        if self.gen is None:
            return {}
        return {"device": str(self.gen.device), "dtype": self.serving_dtype(), "n_tensors": len(self._manifest),
                "n_params": sum(p.numel() for p in self._params.values())}
