"""The ``vllm`` engine: ``AsyncLLM`` (vLLM 0.20-0.26 API) behind the Engine interface.

STATUS: a sketch written against the vLLM 0.26.0 sources as summarised in
``/work/shared/reference/vllm.md`` (sections 1, 3.2, 6, 7). Nothing below the import guard has run
yet; its GPU validation is a separate issue. Parts marked ``UNTESTED`` are the ones most likely to
need changes there. Importing this module never imports vLLM: it is imported in :meth:`start`, so
``import rollout_server.engines.vllm`` works anywhere and selecting the engine without vLLM fails
with :class:`EngineUnavailable` naming the fix.

Mapping onto vLLM:

* ``generate``: one ``AsyncLLM.generate`` per item (vLLM batches them continuously), with
  ``output_kind=FINAL_ONLY``; cancelling our task makes AsyncLLM abort the request. Chat prompts
  are rendered with the checkpoint's chat template and sent as text plus PIL images, so vLLM
  expands the image placeholders itself (token-id prompts must carry one pad per image).
* Sampling: vLLM defaults differ from ours (``max_tokens`` 16, ``top_k`` 0/-1), so every field is
  passed explicitly; ``top_k <= 0`` becomes -1 (off in every supported release).
* Fence hooks: ``pause()`` -> ``pause_generation`` (our own gate has already drained or aborted
  every request), ``resume()`` -> ``resume_generation``.
* Weights, NCCL (the GPU path): ``/sync/init`` -> ``init_weight_transfer_engine`` (blocks until
  the learner joins: the learner issues it from a thread), first ``/sync/update`` ->
  ``start_weight_update``, each ``/sync/update`` -> ``update_weights(names, dtype_names, shapes,
  packed=True)`` while the learner broadcasts, ``/sync/commit`` -> ``finish_weight_update`` ->
  ``reset_prefix_cache`` (its bool checked) + mm/encoder cache resets.
* Weights, HTTP (no NCCL): buckets staged in CPU memory, written as one safetensors directory at
  commit and loaded with ``collective_rpc("reload_weights", ...)``. UNTESTED.
* ``fingerprint``: vLLM keeps weights in worker processes; the engine reports the fingerprint the
  learner sent with the last commit (or of the checkpoint's sampled tensors at start).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import logging
import os
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any

from common.protocol import InferItem, InferOutput, SamplingParams, SyncBucketHeader, SyncInitRequest, TensorSpec
from rollout_server.engines.base import Engine, EngineUnavailable, WeightUpdateError

log = logging.getLogger(__name__)

INSTALL_FIX = ("rollout_server.engine=vllm but vLLM is not installed in this environment. Fix: pip install "
               "'tandem[vllm]' (vllm>=0.20,<0.27, needs torch 2.11 + CUDA 13) on a GPU machine, or set "
               "rollout_server.engine=hf")


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _call_with_supported(fn: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the subset of ``kwargs`` its signature takes (APIs moved between releases)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


class VLLMEngine(Engine):
    """AsyncLLM in this process's event loop (created in the app lifespan, as AsyncLLM requires)."""

    name = "vllm"
    transports = ("nccl", "http")

    def __init__(self, model_path: str, srv: Any) -> None:
        if not vllm_available():
            raise EngineUnavailable(INSTALL_FIX)
        super().__init__(model_path)
        self.srv = srv
        self.llm: Any = None
        self.tokenizer: Any = None
        self._manifest: list[TensorSpec] = []
        self._tied: list[list[str]] = []
        self._dtype = "bfloat16" if srv.dtype == "auto" else srv.dtype
        self._staged: dict[str, Any] = {}
        self._nccl_updating = False
        self._fingerprint = "unknown"
        self._stop_ids: list[int] = []

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # CUDA cannot re-init in a fork
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            from vllm.config import WeightTransferConfig  # vLLM >= 0.16

            transfer: Any = WeightTransferConfig(backend="nccl")
        except ImportError:  # pragma: no cover - older than supported
            transfer = None
        args: dict[str, Any] = dict(
            model=self.model_path, dtype=self._dtype, tensor_parallel_size=self.srv.tensor_parallel_size,
            gpu_memory_utilization=self.srv.gpu_memory_utilization, enable_prefix_caching=self.srv.enable_prefix_caching,
            logprobs_mode="processed_logprobs", limit_mm_per_prompt={"image": 8}, seed=0,
        )
        if self.srv.max_model_len:
            args["max_model_len"] = self.srv.max_model_len
        if transfer is not None:
            args["weight_transfer_config"] = transfer
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        stop = {self.tokenizer.eos_token_id}
        if "<|im_end|>" in self.tokenizer.get_vocab():
            stop.add(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self._stop_ids = sorted(i for i in stop if i is not None)
        self._manifest, self._tied = await asyncio.to_thread(self._meta_manifest)
        log.info("vllm engine ready: %s, tp %d, %d tensors", self.model_path, self.srv.tensor_parallel_size,
                 len(self._manifest))

    def _meta_manifest(self) -> tuple[list[TensorSpec], list[list[str]]]:
        """HF names, shapes and tied groups from the architecture on the meta device (no memory)."""
        import torch
        from transformers import AutoConfig, AutoModelForImageTextToText

        from rollout_server import weights as W

        config = AutoConfig.from_pretrained(self.model_path)
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config, dtype=getattr(torch, self._dtype))
        return W.manifest_of(model)

    async def stop(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    # ---------------------------------------------------------------- serving

    def _sampling(self, s: SamplingParams) -> Any:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        return VSP(n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else -1,
                   max_tokens=s.max_tokens, seed=s.seed, stop=list(s.stop), stop_token_ids=self._stop_ids,
                   repetition_penalty=s.repetition_penalty, skip_special_tokens=False,
                   output_kind=RequestOutputKind.FINAL_ONLY)

    def _prompt(self, item: InferItem, row: int) -> dict[str, Any]:
        from rollout_server.engines.hf_inputs import load_image

        images = list(item.images or [])
        if item.prompt_token_ids is not None:
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
                        refs.append(p.image if p.image is not None else queue.pop(0))
                        parts.append({"type": "image"})
                    else:
                        parts.append({"type": "text", "text": p.text})
                msgs.append({"role": m.role, "content": parts})
            prompt = {"prompt": self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)}
        if refs:
            prompt["multi_modal_data"] = {"image": [load_image(r, f"items.{row}.images.{j}") for j, r in enumerate(refs)]}
        return prompt

    async def _one(self, prompt: dict[str, Any], sp: Any, item_id: str | None) -> InferOutput:
        final = None
        async for out in self.llm.generate(prompt, sp, f"tandem-{uuid.uuid4().hex}"):
            final = out
        if final is None:  # pragma: no cover - vLLM always yields once with FINAL_ONLY
            raise RuntimeError("vLLM returned no output")
        c = final.outputs[0]
        reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
        return InferOutput(id=item_id, token_ids=list(c.token_ids), text=c.text, finish_reason=reason,
                           prompt_token_ids=list(final.prompt_token_ids or []))

    async def generate(self, items: Sequence[InferItem], sampling: SamplingParams) -> list[InferOutput]:
        sp = self._sampling(sampling)
        prompts = [self._prompt(it, i) for i, it in enumerate(items)]
        tasks = [asyncio.ensure_future(self._one(p, sp, it.id)) for p, it in zip(prompts, items)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()  # AsyncLLM aborts a request whose consumer is cancelled
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def encode_text(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    # ---------------------------------------------------------------- weights

    def manifest(self) -> list[TensorSpec]:
        return list(self._manifest)

    def tied_groups(self) -> list[list[str]]:
        return [list(g) for g in self._tied]

    def serving_dtype(self) -> str:
        return self._dtype

    def world_size(self) -> int:
        return int(self.srv.tensor_parallel_size)

    async def pause(self) -> None:
        # Our gate already drained or cancelled every request; this also stops vLLM's scheduler and
        # clears its caches once idle. Never mode="keep": requests would straddle versions.
        await _call_with_supported(self.llm.pause_generation, mode="abort", clear_cache=True)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def init_nccl(self, req: SyncInitRequest) -> None:  # UNTESTED
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info = {"master_address": req.master_addr, "master_port": req.master_port,
                "rank_offset": req.rank_offset, "world_size": req.world_size}
        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def receive_nccl(self, header: SyncBucketHeader) -> int:  # UNTESTED
        """One packed NCCL bucket: announce names/dtypes/shapes; the learner broadcasts meanwhile."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if not self._nccl_updating:
            await _call_with_supported(self.llm.start_weight_update, is_checkpoint_format=True)
            self._nccl_updating = True
        info = {"names": header.names, "dtype_names": header.dtypes, "shapes": header.shapes, "packed": True}
        await self.llm.update_weights(WeightTransferUpdateRequest(update_info=info))
        return sum(end - begin for begin, end in header.offsets)

    async def stage_bucket(self, tensors: dict[str, Any]) -> int:
        specs = {s.name: s for s in self._manifest}
        alias = {n: g[0] for g in self._tied for n in g[1:]}
        for name, t in tensors.items():
            spec = specs.get(alias.get(name, name))
            if spec is None or list(t.shape) != spec.shape or str(t.dtype).removeprefix("torch.") != spec.dtype:
                raise WeightUpdateError(f"{name!r} {list(t.shape)} {t.dtype} does not match the served model "
                                        f"({spec.shape if spec else 'no such parameter'})", name)
        self._staged.update({alias.get(n, n): t for n, t in tensors.items()})
        return sum(t.numel() * t.element_size() for t in tensors.values())

    async def commit(self, expected_fingerprint: str | None = None) -> bool:
        if self._nccl_updating:  # UNTESTED
            await self.llm.finish_weight_update()
            self._nccl_updating = False
        elif self._staged:  # UNTESTED: HTTP path through a safetensors directory
            missing = [s.name for s in self._manifest if s.name not in self._staged]
            if missing:
                raise WeightUpdateError(f"{len(missing)} parameters were not sent (first: {missing[0]!r})")
            from safetensors.torch import save_file

            with tempfile.TemporaryDirectory(prefix="tandem-sync-") as d:
                save_file(self._staged, os.path.join(d, "model.safetensors"))
                await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": d})
            self._staged = {}
        else:
            raise WeightUpdateError("nothing was sent in this session")
        ok = False
        for _ in range(5):  # False while requests hold KV blocks; after our drain it must be True
            ok = bool(await self.llm.reset_prefix_cache())
            if ok:
                break
            await asyncio.sleep(0.2)
        for reset in ("reset_mm_cache", "reset_encoder_cache"):
            fn = getattr(self.llm, reset, None)
            if fn is not None:
                await fn()
        if expected_fingerprint is not None:
            self._fingerprint = expected_fingerprint
        return ok

    async def discard(self) -> None:
        self._staged = {}
        if self._nccl_updating:  # start_weight_update refuses while a session is active: close it
            try:
                await self.llm.finish_weight_update()
            except Exception as exc:  # noqa: BLE001 - best effort; logged
                log.warning("finish_weight_update after an aborted sync failed: %s", exc)
            self._nccl_updating = False

    def fingerprint(self) -> str:
        return self._fingerprint

    def health_info(self) -> dict[str, Any]:
        return {"tensor_parallel_size": self.srv.tensor_parallel_size, "dtype": self._dtype}


__all__ = ["VLLMEngine", "vllm_available", "INSTALL_FIX"]
