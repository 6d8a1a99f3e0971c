"""The ``hf`` engine: the rollout server's transformers backend, CPU or GPU.

:class:`HFEngine` is the :class:`~rollout_server.engines.base.Engine` the server runs around
:class:`common.generation.generator.HFGenerator` (prompts, batching, vLLM sampling semantics):
generation on one worker thread (the event loop stays free for /health, /metrics and the fence),
cancellation by a flag checked after every token, and a staged weight update swapped in under
the fence. On CUDA it also receives weights over NCCL with the same packed protocol as vLLM's
native weight transfer (``/sync/init`` joins a stand-alone group with learner rank 0, one
``/sync/update`` announces every tensor, the learner broadcasts packed chunks), so the NCCL sync
path is testable on a GPU box without vLLM.

What this module does not know: HTTP, versions, the fence, how prompts become batches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from common.data.image_size import processor_pixels
from common.wire.http import InferItem, InferOutput, SamplingParams
from common.data.processor import load_processor
from common.weight_sync import packed as P
from common.weight_sync import weights as W
from common.generation.generator import HFGenerator
from common.generation.sampling import CancelledGeneration
from common.weight_sync.shared import gpu_uuid, open_shared
from rollout_server.engines.adapter_merge import AdapterMerger, adapter_tensor_specs
from rollout_server.engines.base import Engine, WeightUpdateError, check_token_budget

log = logging.getLogger(__name__)


class HFEngine(Engine):
    """The server's hf engine: HFGenerator on one worker thread plus a staged weight update."""

    name = "hf"
    merges_adapters = True

    def __init__(self, model_path: str, *, dtype: str = "auto", device: str = "auto", max_batch: int = 16,
                 max_request_tokens: int | None = None, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> None:
        super().__init__(model_path)
        self.max_request_tokens = max_request_tokens
        self._pixels_cfg = {"min_pixels": min_pixels, "max_pixels": max_pixels}  # data.*; None = the model's own
        self._dtype_cfg, self._device_cfg, self._max_batch = dtype, device, max_batch
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generate")
        self.gen: HFGenerator | None = None
        self._params: dict[str, torch.nn.Parameter] = {}
        self._staged: dict[str, torch.Tensor] = {}
        # adapter sessions: the merger per adapter shape (kept: it holds the base copies), the open session's
        # merger and its adapter tensors' specs (rollout_server/engines/adapter_merge.py)
        self._mergers: dict[str, AdapterMerger] = {}
        self._merger: AdapterMerger | None = None
        self._adapter_specs: dict[str, Any] = {}
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
                err = exc  # NOTE: `exc` is unbound when the except block ends, before the loop runs the callback
                loop.call_soon_threadsafe(lambda: done.done() or done.set_exception(err))
            else:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(gen))

        threading.Thread(target=load, name="hf-load", daemon=True).start()
        self.gen = await done
        self.max_model_len = self.gen.max_positions
        self._set_manifest(*W.manifest_of(self.gen.model))
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
        processor = load_processor(self.model_path, **self._pixels_cfg)  # first: a bad data.*_pixels fails before the weights load
        try:
            model = AutoModelForImageTextToText.from_pretrained(self.model_path, dtype=getattr(torch, dtype))
        except ValueError:  # a text-only checkpoint
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, dtype))
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
            # Return only once the worker thread stopped computing for us: the fence (and a client that
            # disconnected) count on it. The flag is checked after every generated token.
            cancel.set()
            try:
                await fut
            except CancelledGeneration as exc:
                log.info("generation of %d item(s) cancelled after %d generated token(s) (max_tokens %d)",
                         len(items), exc.tokens, sampling.max_tokens)
                if self.on_cancelled_tokens is not None:
                    self.on_cancelled_tokens(exc.tokens)
            except BaseException:  # noqa: BLE001 - a late error; we are cancelled anyway
                pass
            raise

    def _generate_sync(self, items: list[InferItem], sampling: SamplingParams, cancel: threading.Event) -> list[InferOutput]:
        if cancel.is_set():
            raise CancelledGeneration()
        assert self.gen is not None, "engine not started"
        prompts = [it.messages if it.messages is not None else it.prompt_token_ids for it in items]
        rows = self.gen.prepare(prompts, [it.images for it in items], cancel=cancel)
        check_token_budget([len(r.input_ids) for r in rows], sampling.max_tokens, self.max_request_tokens)
        return self.gen.generate_rows(rows, sampling, cancel=cancel, ids=[it.id for it in items])

    def encode_text(self, prompt: str) -> list[int]:
        assert self.gen is not None, "engine not started"
        return list(self.gen.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    # ---------------------------------------------------------------- weights

    def serving_dtype(self) -> str:
        assert self.gen is not None, "engine not started"
        return W.dtype_name(next(self.gen.model.parameters()).dtype)

    def _open_adapter(self, adapter: Any) -> list[Any]:
        """An ``adapter`` session: every layer must be a served linear weight; its base copy is taken the first
        time this adapter shape is declared, from weights no sync has written (else they are not the base)."""
        shapes = {}
        for layer in adapter.layers:
            try:
                canonical, spec = self._spec_of(f"{layer}.weight")
            except WeightUpdateError as exc:
                raise WeightUpdateError(f"adapter layer {layer!r}: {exc}", "adapter") from None
            if len(spec.shape) != 2:
                raise WeightUpdateError(f"adapter layer {layer!r}: {canonical!r} is {spec.shape}, not a linear weight",
                                        "adapter")
            shapes[layer] = spec.shape
        key = adapter.model_dump_json()
        if key not in self._mergers:
            written = [f"{layer}.weight" for layer in adapter.layers if f"{layer}.weight" in self._written]
            if written:
                raise WeightUpdateError(f"adapter sync: {len(written)} adapted weight(s) were overwritten by an "
                                        f"earlier sync (first: {written[0]!r}), so the server no longer holds their base. "
                                        "Fix: restart the rollout server (it reloads the checkpoint), or use "
                                        "model.adapter.sync: merged", "adapter")
            assert self.gen is not None, "engine not started"
            self._mergers[key] = AdapterMerger(adapter, {layer: self._params[f"{layer}.weight"]
                                                         for layer in adapter.layers})
            log.info("adapter sync: base copies of %d %s layer(s) (rank %d) kept for server-side merges",
                     len(adapter.layers), adapter.type, adapter.rank)
        self._merger = self._mergers[key]
        specs = adapter_tensor_specs(adapter, shapes)
        self._adapter_specs = {s.name: s for s in specs}
        return specs

    def _incoming(self, name: str, dtype: str, shape: list[int]) -> str:
        """The staging key of one sent tensor, checked: a served name (tied names to their group's first) or,
        in an adapter session, an adapter tensor; never twice, never an adapted layer's weight (it is merged)."""
        spec = self._adapter_specs.get(name)
        canonical = name
        if spec is None:
            canonical, spec = self._spec_of(name)
            if self._merger is not None and canonical.removesuffix(".weight") in self._merger.layers:
                raise WeightUpdateError(f"{name!r} is an adapted layer's weight: in an adapter sync the server merges "
                                        "it from the adapter's tensors, send those instead", name)
        if canonical in self._staged:
            raise WeightUpdateError(f"{name!r} sent twice in this session"
                                    + (f" (tied with {canonical!r})" if canonical != name else ""), name)
        if list(shape) != spec.shape:
            raise WeightUpdateError(f"{name!r} has shape {list(shape)}, the server expects {spec.shape}", name)
        if dtype != spec.dtype:
            raise WeightUpdateError(f"{name!r} is {dtype}, the server expects {spec.dtype}: "
                                    "cast on the learner before sending", name)
        return canonical

    async def stage_bucket(self, tensors: dict[str, Any]) -> int:
        keys = [self._incoming(name, W.dtype_name(t.dtype), list(t.shape)) for name, t in tensors.items()]
        nbytes = 0
        for key, t in zip(keys, tensors.values()):
            self._staged[key] = t
            nbytes += t.numel() * t.element_size()
        return nbytes

    async def commit(self, expected_fingerprint: str | None = None) -> bool:
        staged = dict(self._staged)
        if self._merger is not None:  # adapter session: the adapted layers' weights merged from their base
            adapter = {n: staged.pop(n) for n in self._adapter_specs if n in staged}
            missing = [n for n in self._adapter_specs if n not in adapter]
            if missing:
                raise WeightUpdateError(f"{len(missing)} of {len(self._adapter_specs)} adapter tensors were not "
                                        f"sent (first: {missing[0]!r}); old weights kept")
            serving = W.torch_dtype(self.serving_dtype())
            staged.update(await asyncio.get_running_loop().run_in_executor(
                self._pool, self._merger.merge, adapter, serving))
        missing = [n for n in self._manifest if n not in staged and n not in self._skip]
        if missing:
            raise WeightUpdateError(f"{len(missing)} of {len(self._manifest)} parameters were not sent and not "
                                    f"declared frozen (first: {missing[0]!r}); old weights kept")
        if expected_fingerprint is not None:
            # the complete served model as it will be: the sent (or merged) tensors, the frozen ones as held
            got = W.fingerprint((n, staged[n] if n in staged else self._params[n]) for n in self._manifest)
            if got != expected_fingerprint:
                raise WeightUpdateError(f"staged weights fingerprint {got} != learner's {expected_fingerprint}; "
                                        "old weights kept", "fingerprint")
        self._staged = {}
        await asyncio.get_running_loop().run_in_executor(self._pool, self._apply, staged)
        self._end_session(set(staged))
        return True  # transformers generate keeps no cache across calls: nothing to reset

    def _end_session(self, committed: set[str] | None = None) -> None:
        super()._end_session(committed)
        self._merger, self._adapter_specs = None, {}

    def _apply(self, staged: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, t in staged.items():
                self._params[name].copy_(t, non_blocking=False)

    async def discard(self) -> None:
        self._staged = {}
        self._end_session()

    # ---------------------------------------------------------------- collective receive (NCCL; gloo on CPU)

    #: ``nccl``: the collective transport, over NCCL on a GPU and over gloo on CPU (the learner's sender
    #: does the same with CPU tensors), so the whole protocol runs on machines without GPUs.
    transports = ("http", "nccl", "ipc")

    async def receive_ipc(self, req: Any) -> int:
        """``/sync/ipc``: copy the bucket out of the learner's shared buffer and stage the copies (the learner
        reuses its buffer for the next bucket; the swap waits for commit, as for HTTP buckets)."""
        assert self.gen is not None, "engine not started"
        device = self.gen.device if self.gen.device.type == "cuda" else None
        return await self.stage_bucket(await asyncio.to_thread(self._copy_shared, req, device))  # loop stays free

    @staticmethod
    def _copy_shared(req: Any, device: torch.device | None) -> dict[str, torch.Tensor]:
        with open_shared(req.source, device) as src:
            views = P.unpack(src[:req.offsets[-1][1]], req.names, req.dtypes, req.shapes, req.offsets)
            copies = {n: t.clone() for n, t in views.items()}
            if device is not None:
                torch.cuda.synchronize(device)  # the copies are done before the learner may refill its buffer
        return copies

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
        keys = [self._incoming(name, dtype, list(shape))
                for name, dtype, shape in zip(header.names, header.dtypes, header.shapes)]
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        try:
            received = await loop.run_in_executor(self._nccl_pool, self._receive, header)
        except Exception:
            self._drop_group()  # a failed or timed-out collective leaves the communicator unusable
            raise
        for key, name in zip(keys, header.names):
            self._staged[key] = received[name]
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
        cuda = self.gen.device.type == "cuda"
        pixels = processor_pixels(getattr(self.gen.processor, "image_processor", None))
        return {"device": str(self.gen.device), "dtype": self.serving_dtype(), "n_tensors": len(self._manifest),
                "n_params": sum(p.numel() for p in self._params.values()),
                "gpu_uuids": [gpu_uuid(self.gen.device)] if cuda else [],
                "image_pixels": pixels.as_dict() if pixels else None}
