"""The ``vllm`` engine: ``AsyncLLM`` (vLLM 0.20-0.26 API) behind the Engine interface.

Run on H200s with vLLM 0.26.0 (docs/gpu.md, docs/benchmarks.md). Importing this module never imports vLLM: vLLM is
imported in :meth:`VLLMEngine.start`, so ``import rollout_server.engines.vllm.engine`` works anywhere and selecting
the engine without vLLM fails with :class:`EngineUnavailable` naming the fix.

Mapping onto vLLM:

* ``start``: ``AsyncLLM.from_engine_args`` inside the app lifespan (AsyncLLM starts its output
  handler only under a running loop), workers spawned (CUDA cannot re-initialise in a fork),
  ``logprobs_mode=raw_logprobs`` (vLLM's default, named so it does not drift: the logprobs /infer
  returns are the raw model's, like the hf engine's, so a detection's score does not depend on the
  temperature or penalty it was decoded with), native weight transfer configured (``backend=nccl``).
* ``generate``: one ``AsyncLLM.generate`` per item (vLLM batches them continuously) with
  ``output_kind=FINAL_ONLY`` (one yield per request; the per-token detokenizing is vLLM's output
  processor, as in ``vllm serve``); text-only chat prompts go as token ids, tokenized once, here.
  Cancelling our task (a fence in abort mode, a client that disconnected) aborts every request id of
  the batch (``AsyncLLM.abort``; vLLM also aborts a request whose consumer is cancelled, the explicit
  call does not depend on it). A prompt vLLM refuses (too long, id outside the vocabulary) is an
  EngineInputError (400); a batch over ``rollout_server.max_request_tokens`` a 413 (image placeholders
  count as one token: vLLM expands them later and checks ``max_model_len`` itself). How items, sampling and
  outputs translate to vLLM's: :mod:`rollout_server.engines.vllm.convert`.
* Image size: ``data.min/max_pixels`` as ``mm_processor_kwargs``, as the encoder's (common/data/image_size.py).
* Fence hooks (the same semantics as the hf engine): our admission gate has already drained or
  cancelled every request when ``pause()`` runs ``pause_generation(mode="abort", clear_cache=True)``
  (never ``keep``: requests would straddle versions); ``resume()`` runs ``resume_generation``.
* Weights over NCCL: ``/sync/init`` -> ``init_weight_transfer_engine`` (blocks until learner rank 0
  joins; kept across syncs while the rendezvous is the same). The one ``/sync/update``, while the
  learner broadcasts packed chunks, takes one of two load paths (``rollout_server.weight_load``, or
  the session's ``weight_load``):

  - ``fast`` (default): ``collective_rpc("tandem_prepare")`` on every worker (records a copy plan the
    first time a layout is seen: :mod:`rollout_server.engines.vllm.load_plan`), then ``tandem_receive`` receives
    into persistent buffers and replays the plan's copies chunk by chunk
    (:mod:`rollout_server.engines.vllm.extension`). Once every worker planned a stream, later syncs
    of the same stream are one ``tandem_receive(layout=...)`` call (until a native update runs). A
    worker that cannot plan (quantized model, a loader that reads values) makes the engine fall back
    to native for good, logged with the reason;
  - ``native``: ``start_weight_update`` + ``update_weights(names, dtype_names, shapes, packed=True,
    packed_buffer_size_bytes=bucket_bytes)`` (layerwise reload through the model's loaders), and
    ``finish_weight_update`` at commit.

  ``/sync/commit`` then runs ``reset_prefix_cache`` (its bool checked: a False puts the server in
  error rather than serve stale caches), ``reset_mm_cache`` and ``reset_encoder_cache``.
* Weights over HTTP (no NCCL): each bucket staged in a /dev/shm file, loaded in place by every worker at
  commit; over ``ipc`` (the learner on the server's GPU): each bucket loaded by the workers straight from
  the learner's GPU memory (:mod:`rollout_server.engines.vllm.ipc`). Frozen names kept (``skip``: http, ipc)
  and ``adapter`` sessions (http; merged on CPU at commit): :mod:`rollout_server.engines.vllm.adapter`.
* ``fingerprint``: vLLM keeps fused weights in worker processes; the engine reports the fingerprint
  the learner sent with the last commit. That the weights really arrived is shown by greedy outputs
  matching the learner's own (tests/test_gpu_vllm.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

from common.data import image_size
from common.wire.http import InferItem, InferOutput, SamplingParams
from common.weight_sync.messages import SyncBucketHeader, SyncInitRequest, TensorSpec
from rollout_server.engines.base import (Engine, EngineInputError, EngineUnavailable, WeightUpdateError,
                                         check_token_budget)
from rollout_server.engines.vllm.adapter import AdapterReceiver
from rollout_server.engines.vllm.convert import infer_output, sampling_kwargs, stop_token_ids, vllm_prompt
from rollout_server.engines.vllm.ipc import IpcReceiver

log = logging.getLogger(__name__)

INSTALL_FIX = ("rollout_server.engine=vllm but vLLM is not installed in this environment. Fix: pip install "
               "'tandem[vllm]' (vllm>=0.20,<0.27, needs torch 2.11 + CUDA 13) on a GPU machine, or set "
               "rollout_server.engine=hf")

#: Images per prompt vLLM reserves encoder budget for.
MAX_IMAGES_PER_PROMPT = 8
#: Chunks in flight on each side of a packed NCCL transfer (must equal the learner's NUM_BUFFERS).
PACKED_NUM_BUFFERS = 2
#: Mixed into vLLM's workers: the fast load path and the weights digest.
WORKER_EXTENSION = "rollout_server.engines.vllm.extension.TandemWorkerExtension"


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


class VLLMEngine(AdapterReceiver, IpcReceiver, Engine):
    """AsyncLLM in this process's event loop (created in the app lifespan, as AsyncLLM requires)."""

    name = "vllm"
    transports = ("nccl", "http", "ipc")
    # updates_in_place, skip_refused_reason and the adapter terms: rollout_server/engines/vllm/adapter.py

    def __init__(self, model_path: str, srv: Any, *, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> None:
        if not vllm_available():
            raise EngineUnavailable(INSTALL_FIX)
        super().__init__(model_path)
        self.srv = srv
        self._pixels, self._mm_kwargs = image_size.for_engine(model_path, min_pixels, max_pixels)
        self.max_request_tokens = srv.max_request_tokens
        self.llm: Any = None
        self.tokenizer: Any = None
        self._dtype = "bfloat16" if srv.dtype == "auto" else srv.dtype
        self._staged: dict[str, Any] = {}  # HTTP: name -> index of its host bucket (ipc.py)
        self._host_buckets: list = []
        self._received: set[str] = set()
        self._nccl_updating = False
        self._fast_updated = False
        self._load_mode: str = srv.weight_load
        self._fast_refused: str | None = None  # why the fast path is off for good (first refusal)
        self._fast_key: str | None = None  # stream every worker holds a plan for: one RPC per sync
        self._session_timeout_s = 600.0
        self._group_key: tuple | None = None
        self._bucket_bytes = 512 << 20
        self._fingerprint = "unknown"
        self._gpu_uuids: list[str] = []
        self._stop_ids: list[int] = []
        self._vocab = 0
        self._dp = max(1, len(srv.gpus or []) // max(1, srv.tensor_parallel_size))

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # CUDA cannot re-init in a fork
        # vLLM's worker processes import WORKER_EXTENSION by name: make this checkout importable there too.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if root not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        from vllm import AsyncEngineArgs
        from vllm.config import WeightTransferConfig  # vLLM >= 0.16
        from vllm.v1.engine.async_llm import AsyncLLM

        srv = self.srv
        args: dict[str, Any] = dict(
            model=self.model_path, dtype=self._dtype, tensor_parallel_size=srv.tensor_parallel_size,
            gpu_memory_utilization=srv.gpu_memory_utilization, enable_prefix_caching=srv.enable_prefix_caching,
            logprobs_mode="raw_logprobs", limit_mm_per_prompt={"image": MAX_IMAGES_PER_PROMPT}, seed=0,
            enforce_eager=srv.enforce_eager, load_format=srv.load_format, mm_processor_kwargs=self._mm_kwargs or None,
            weight_transfer_config=WeightTransferConfig(backend="nccl"), worker_extension_cls=WORKER_EXTENSION,
        )
        if srv.max_model_len:
            args["max_model_len"] = srv.max_model_len
        if self._dp > 1:  # every GPU of rollout_server.gpus is used: len(gpus) / TP replicas in one engine
            args["data_parallel_size"] = self._dp
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        # What vLLM settled on (rollout_server.max_model_len, or the model's own): routes/infer.py refuses a token-id
        # prompt past it before admission.
        self.max_model_len = getattr(getattr(self.llm, "model_config", None), "max_model_len", None)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self._stop_ids = stop_token_ids(self.tokenizer)
        self._set_manifest(*await asyncio.to_thread(self._meta_manifest))
        await self._read_gpu_uuids()
        log.info("vllm engine ready: %s, tp %d, %s, %d tensors, load_format %s", self.model_path,
                 srv.tensor_parallel_size, self._dtype, len(self._manifest), srv.load_format)

    def _meta_manifest(self) -> tuple[list[TensorSpec], list[list[str]]]:
        """HF names, shapes and tied groups from the architecture on the meta device (no memory)."""
        import torch
        from transformers import AutoConfig, AutoModelForImageTextToText

        from common.weight_sync import weights as W

        config = AutoConfig.from_pretrained(self.model_path)
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config, dtype=getattr(torch, self._dtype))
        self._vocab = model.get_input_embeddings().num_embeddings
        return W.manifest_of(model)

    async def stop(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    # ---------------------------------------------------------------- serving

    def _sampling(self, s: SamplingParams) -> Any:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        return VSP(**sampling_kwargs(s, self._stop_ids), output_kind=RequestOutputKind.FINAL_ONLY)

    async def _one(self, prompt: dict[str, Any], sp: Any, item_id: str | None, row: int) -> InferOutput:
        final = None
        request_id = f"tandem-{uuid.uuid4().hex}"
        try:
            async for out in self.llm.generate(prompt, sp, request_id):
                final = out
        except ValueError as exc:  # vLLM's input checks: prompt too long, bad ids, image count
            raise EngineInputError(f"vLLM refused item {row}: {exc}", f"items.{row}") from None
        except asyncio.CancelledError:
            # Stop the engine computing for a caller that is gone (idempotent for an id vLLM already dropped).
            try:
                await self.llm.abort(request_id)
            except Exception as exc:  # noqa: BLE001 - best effort; we are cancelled anyway
                log.warning("aborting vLLM request %s failed: %s", request_id, exc)
            raise
        if final is None:  # pragma: no cover - vLLM always yields once with FINAL_ONLY
            raise RuntimeError("vLLM returned no output")
        return infer_output(final, item_id, with_logprobs=sp.logprobs is not None)

    def _tokenized(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """A text-only chat prompt as its token ids, tokenized once, here: the token budget needs the count,
        and vLLM would tokenize the same text again on this event loop. The rendered template carries its
        own special tokens, so none are added (as the hf engine and ``vllm serve``'s chat route do). A
        prompt with images stays text: vLLM expands its image placeholders itself."""
        if "prompt" not in prompt or "multi_modal_data" in prompt:
            return prompt
        return {"prompt_token_ids": list(self.tokenizer(prompt["prompt"], add_special_tokens=False)["input_ids"])}

    async def generate(self, items: Sequence[InferItem], sampling: SamplingParams) -> list[InferOutput]:
        prompts = [self._tokenized(vllm_prompt(it, i, self.tokenizer, self._vocab)) for i, it in enumerate(items)]
        if self.max_request_tokens is not None:
            check_token_budget([len(p["prompt_token_ids"]) if "prompt_token_ids" in p else
                                len(self.tokenizer(p["prompt"], add_special_tokens=False)["input_ids"])
                                for p in prompts], sampling.max_tokens, self.max_request_tokens)
        sp = self._sampling(sampling)
        if len(prompts) == 1:  # every /v1/completions call: no task and gather around the one request
            return [await self._one(prompts[0], sp, items[0].id, 0)]  # a cancel reaches _one, which aborts
        tasks = [asyncio.ensure_future(self._one(p, sp, it.id, i)) for i, (p, it) in enumerate(zip(prompts, items))]
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

    def serving_dtype(self) -> str:
        return self._dtype

    def world_size(self) -> int:
        """Workers that join the weight-transfer group: TP x DP (vLLM ranks them dp * tp + rank + offset)."""
        return int(self.srv.tensor_parallel_size) * self._dp

    async def pause(self) -> None:
        """``pause_generation(mode="abort", clear_cache=True)`` without its fixed 20 ms settle sleep.

        That sleep lets outputs of in-flight requests reach their callers before the call returns; our
        admission gate has already drained or cancelled every request, so nothing is left to settle and
        the sleep was over half of an idle server's fence. vLLM releases without the two calls it makes
        (``renderer.clear_mm_cache_async``, ``engine_core.pause_scheduler_async``) take the public path.
        """
        core, renderer = getattr(self.llm, "engine_core", None), getattr(self.llm, "renderer", None)
        pause = getattr(core, "pause_scheduler_async", None)
        clear = getattr(renderer, "clear_mm_cache_async", None)
        if pause is None or clear is None:
            await self.llm.pause_generation(mode="abort", clear_cache=True)
            return
        await clear()
        await pause(mode="abort", clear_cache=True)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    def _check(self, name: str, dtype: str, shape: list[int]) -> str:
        canonical, spec = self._spec_of(name)
        if list(shape) != spec.shape or dtype != spec.dtype:
            raise WeightUpdateError(f"{name!r} is {dtype} {list(shape)}, the server serves {spec.dtype} {spec.shape}",
                                    name)
        if canonical in self._received or canonical in self._staged:
            raise WeightUpdateError(f"{name!r} sent twice in this session", name)
        return canonical

    async def init_nccl(self, req: SyncInitRequest) -> None:
        """``init_weight_transfer_engine``: every worker joins learner rank 0's group (once per rendezvous); the
        session ``open_session`` opens next is an NCCL one (``_nccl_pending``: rollout_server/engines/vllm/adapter.py)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._bucket_bytes = req.bucket_bytes
        self._load_mode = req.weight_load or self.srv.weight_load
        self._session_timeout_s = req.timeout_s
        key = (req.master_addr, req.master_port, req.world_size, req.rank_offset)
        if key == self._group_key:
            self._nccl_pending = True
            return
        self._group_key = None
        info = {"master_address": req.master_addr, "master_port": req.master_port,
                "rank_offset": req.rank_offset, "world_size": req.world_size}
        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        self._group_key, self._nccl_pending = key, True

    async def receive_nccl(self, header: SyncBucketHeader) -> int:
        """All announced tensors, as packed broadcasts: fast path if every worker can plan it, else native."""
        names = [self._check(n, d, s) for n, d, s in zip(header.names, header.dtypes, header.shapes)]
        nbytes = sum(end - begin for begin, end in header.offsets)
        self._inplace = True  # from here a failure may leave the served weights partly new
        if self._load_mode == "fast" and self._fast_refused is None and not self._nccl_updating:
            if await self._receive_fast(header, nbytes):
                self._received.update(names)
                return nbytes
        return await self._receive_native(header, names, nbytes)

    async def _receive_fast(self, header: SyncBucketHeader, nbytes: int) -> bool:
        """False (nothing received) when a worker cannot plan this layout; raises if receiving fails."""
        from rollout_server.engines.vllm.load_plan import stream_key

        layout = {"names": list(header.names), "dtypes": list(header.dtypes), "shapes": header.shapes,
                  "offsets": [list(o) for o in header.offsets], "bucket_bytes": self._bucket_bytes}
        key = stream_key(layout)
        t0 = time.monotonic()
        if key == self._fast_key:  # every worker planned this stream: receive in one call
            plans = None
        else:
            plans = await self.llm.collective_rpc("tandem_prepare", timeout=self._session_timeout_s,
                                                  kwargs={"layout": layout})
            refused = [p for p in plans if not p.get("ok")]
            if refused:
                lasting = [p for p in refused if not p.get("transient")]
                if not lasting:
                    log.info("fast weight load deferred (%s)", refused[0].get("reason", "?"))
                    return False
                self._fast_refused = lasting[0].get("reason", "?")
                log.warning("fast weight load refused (%s); vLLM's native update_weights from now on",
                            self._fast_refused)
                return False
        t1 = time.monotonic()
        self._fast_updated = True  # from here the served weights are being overwritten in place
        kwargs: dict[str, Any] = {"timeout_s": self._session_timeout_s}
        if plans is None:
            kwargs["layout"] = layout
        self._fast_key = None  # until this receive succeeded on every worker
        outs = await self.llm.collective_rpc("tandem_receive", timeout=self._session_timeout_s + 5, kwargs=kwargs)
        t2 = time.monotonic()
        direct = [o for o in outs if o.get("path") == "direct"]
        if direct:
            self._fast_refused = f"a worker could not plan a known stream: {direct[0].get('reason', '?')}"
            log.warning("fast weight load: this sync went through the loaders (%s); native from now on",
                        self._fast_refused)
        else:
            self._fast_key = key
        worker = max(o["receive_s"] for o in outs)
        gpu = [o["gpu_s"] for o in outs if "gpu_s" in o]
        info = (f"prepare {t1 - t0:.4f}s{' (plan recorded)' if plans[0].get('recorded') else ''}, "
                f"{plans[0]['chunks']} chunks, {plans[0]['copies']} copies, {plans[0]['fills']} fills, "
                f"{plans[0]['params_untouched']} params untouched, replay {plans[0]['graphs']}"
                if plans else "one call (plan held by every worker)")
        log.info("fast update: %d tensors, %.2f GB: receive+copy %.4fs (%.1f GB/s; worker %.4fs, gpu %s); %s",
                 len(header.names), nbytes / 1e9, t2 - t1, nbytes / max(t2 - t1, 1e-9) / 1e9,
                 worker, f"{max(gpu):.4f}s" if gpu else "n/a", info)
        self.last_update_info = {"path": "fast", "rpc_s": t2 - t1, "prepare_s": t1 - t0,
                                 "worker_s": worker, "gpu_s": max(gpu) if gpu else None,
                                 "one_call": plans is None}
        return True

    async def _receive_native(self, header: SyncBucketHeader, names: list[str], nbytes: int) -> int:
        """vLLM's update_weights: the model's loaders under layerwise reload, chunk by chunk."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        t0 = time.monotonic()
        if not self._nccl_updating:
            await self.llm.start_weight_update()
            self._nccl_updating = True
        t1 = time.monotonic()
        info = {"names": list(header.names), "dtype_names": list(header.dtypes), "shapes": header.shapes,
                "packed": True, "packed_buffer_size_bytes": self._bucket_bytes,
                "packed_num_buffers": PACKED_NUM_BUFFERS}
        try:
            await self.llm.update_weights(WeightTransferUpdateRequest(update_info=info))
        except BaseException:
            self._nccl_updating = False  # the worker closed its session on the failure
            raise
        self._received.update(names)
        self._fast_key = None  # a native update may rewrap or move the parameters: plan again
        t2 = time.monotonic()
        self.last_update_info = {"path": "native", "rpc_s": t2 - t1, "prepare_s": t1 - t0}
        log.info("nccl update: %d tensors, %.2f GB: start_weight_update %.3fs, update_weights %.3fs (%.1f GB/s)",
                 len(names), nbytes / 1e9, t1 - t0, t2 - t1, nbytes / max(t2 - t1, 1e-9) / 1e9)
        return nbytes

    async def stage_bucket(self, tensors: dict[str, Any]) -> int:
        served, nbytes = self._take_adapter(tensors)  # an adapter session's tensors: kept apart, merged at commit
        canonical = {self._check(name, str(t.dtype).removeprefix("torch."), list(t.shape)): t
                     for name, t in served.items()}
        return nbytes + (self._stage_host(canonical) if canonical else 0)

    async def commit(self, expected_fingerprint: str | None = None) -> bool:
        await self._stage_merged()  # an adapter session: merged on CPU, then loaded as an HTTP bucket
        sent = self._received or set(self._staged)
        missing = [n for n in self._manifest if n not in sent and n not in self._skip]  # skipped: served as held
        if self._fast_updated or self._nccl_updating:
            if self._nccl_updating:  # every announced tensor is loaded; a partial update still has to be closed
                await self.llm.finish_weight_update()
            self._fast_updated = self._nccl_updating = False
            self._received = set()
            if missing:
                raise WeightUpdateError(f"{len(missing)} of {len(self._manifest)} parameters were not sent (first: "
                                        f"{missing[0]!r}); the served weights are now partly new")
        elif self._staged:  # HTTP: the staged buckets, loaded by the workers from this host's shared memory
            if missing:
                self._drop_staged()
                raise WeightUpdateError(f"{len(missing)} parameters were not sent (first: {missing[0]!r})")
            await self._load_staged()
            self._merge_loaded(len(sent))
        else:
            raise WeightUpdateError("nothing was sent in this session")
        # False while requests hold KV blocks; after our drain and pause it must be True. The three resets
        # are independent engine-core calls: issued together, their round trips (~5 ms each) overlap.
        ok, _, _ = await asyncio.gather(self.llm.reset_prefix_cache(), self.llm.reset_mm_cache(),
                                        self.llm.reset_encoder_cache())
        ok = bool(ok)
        if expected_fingerprint is not None:
            self._fingerprint = expected_fingerprint
        self._end_session(sent)  # names written: a later skip of them is refused (Engine.open_session)
        if not ok:
            log.error("reset_prefix_cache returned False after a weight update: cached prefixes may be stale")
        return ok

    async def discard(self) -> None:
        self._drop_staged()
        self._end_session()
        self._received = set()
        self._fast_updated = False
        if self._nccl_updating:  # start_weight_update refuses while a session is active: close it
            try:
                await self.llm.finish_weight_update()
            except Exception as exc:  # noqa: BLE001 - best effort; logged
                log.warning("finish_weight_update after an aborted sync failed: %s", exc)
            self._nccl_updating = False

    def fingerprint(self) -> str:
        return self._fingerprint

    async def weights_digest(self) -> list[str]:
        """One exact digest per worker (``tandem_digest``): equal loads give equal digests."""
        return [str(d) for d in await self.llm.collective_rpc("tandem_digest")]

    def health_info(self) -> dict[str, Any]:
        load = self._load_mode if self._fast_refused is None else f"native (fast refused: {self._fast_refused})"
        return {"tensor_parallel_size": self.srv.tensor_parallel_size, "data_parallel_size": self._dp,
                "dtype": self._dtype, "weight_load": load, "gpu_uuids": self._gpu_uuids,
                "image_pixels": self._pixels.as_dict() if self._pixels else None}


__all__ = ["VLLMEngine", "vllm_available", "INSTALL_FIX"]
