"""Every message that crosses a process boundary, grouped by link, with one schema version.

Links (direction headers below follow the same order)::

    actor ──HTTP /infer──────────────► rollout server      InferRequest -> InferResponse
    learner rank 0 ──HTTP /sync/*────► rollout server      SyncInit/Begin/Bucket/Commit/Abort
    ops / tests ──HTTP GET /sync/digest► rollout server   SyncDigestResponse (exact weight digests)
    anyone ──HTTP /health────────────► rollout server      HealthResponse
    actor ──ZMQ PUSH─────────────────► learner rank r      pack message (common.wire)
    learner rank r ──ZMQ back-channel► its actors          credits message (common.wire)

HTTP bodies are JSON validated by the pydantic models here (server and client import the same
classes); every model forbids unknown fields, so a typo is a 4xx naming the field, not a silent
default. Any 4xx/5xx body is an :class:`ErrorResponse`. The ZMQ codecs live in
:mod:`common.wire` and are re-exported here; their decoders raise only :class:`ProtocolError`.

What this module does not know: sockets, engines, tokenizers, torch. It imports pydantic,
msgpack and numpy only, so every process (and the CPU-only actor) can import it.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.wire import (  # noqa: F401  (re-exported: the ZMQ half of the contract)
    SCHEMA_VERSION,
    WIRE_DTYPES,
    Credits,
    PackMessage,
    ProtocolError,
    decode_credits,
    decode_pack_message,
    encode_credits,
    encode_pack_message,
    frames_to_pack,
    pack_to_frames,
)

#: Upper bound on ``SamplingParams.max_tokens``; larger values are a config mistake, not a request.
MAX_TOKENS_LIMIT = 32768
#: Upper bound on ``InferRequest.items``; clients split larger batches.
MAX_BATCH = 1024
#: HTTP request header carrying the JSON :class:`SyncBucketHeader` of a ``POST /sync/bucket`` body.
BUCKET_HEADER = "X-Tandem-Bucket"
#: Tensor dtypes of the weight-sync manifest and buckets (torch names), with their byte size.
SYNC_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "uint8": 1}
SyncDtype = Literal["bfloat16", "float16", "float32", "float64", "int64", "int32", "uint8"]


class _Message(BaseModel):
    # Field docstrings become the OpenAPI descriptions; NaN/inf are rejected everywhere.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)


# =============================================================================================
# actor -> rollout server (HTTP): POST /infer
# =============================================================================================


class SamplingParams(_Message):
    """Decoding knobs for one /infer batch; defaults are vLLM's, except ``max_tokens`` (required).

    Example:
        {"temperature": 0.01, "top_p": 0.95, "top_k": 0, "max_tokens": 1024, "seed": 7, "stop": [],
         "repetition_penalty": 1.05}
    """

    temperature: float = Field(1.0, ge=0.0)
    """Softmax temperature; 0 = greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus mass in (0, 1]; 1 = off."""
    top_k: int = 0
    """Keep the k most likely tokens; <= 0 = off."""
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    """New tokens to generate at most (required: the server has no safe default)."""
    seed: int | None = None
    """Per-request sampling seed; None = the engine's own randomness (not reproducible)."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings; generation always stops at the chat template's turn end."""
    repetition_penalty: float = Field(1.0, gt=0.0)
    """vLLM/HF repetition penalty; 1 = off."""


class ChatPart(_Message):
    """One part of a multimodal chat message (Qwen/OpenAI style).

    Example:
        {"type": "image", "text": null, "image": null}
    """

    type: Literal["text", "image"]
    """``text`` carries ``text``; ``image`` is an image slot."""
    text: str | None = None
    """The text of a ``text`` part; None for image parts."""
    image: str | None = None
    """An ``image`` part's image inline (path or data URI, as in ``InferItem.images``); None = take the
    next entry of ``InferItem.images``."""

    @model_validator(mode="after")
    def _matches_type(self) -> ChatPart:
        if self.type == "text" and (self.text is None or self.image is not None):
            raise ValueError("a text part needs 'text' and no 'image'")
        if self.type == "image" and self.text is not None:
            raise ValueError("an image part takes no 'text'")
        if self.image is not None:
            _check_image_ref(self.image)
        return self


class ChatMessage(_Message):
    """One chat turn.

    Example:
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Detect all objects."}]}
    """

    role: Literal["system", "user", "assistant"]
    """Speaker; the server applies the model's own chat template."""
    content: str | list[ChatPart]
    """Plain text, or a list of text/image parts in reading order."""


class InferItem(_Message):
    """One prompt: exactly one of ``messages`` or ``prompt_token_ids``.

    Example:
        {"id": "coco-17", "messages": [{"role": "user", "content": [{"type": "image"},
         {"type": "text", "text": "Detect all objects."}]}], "prompt_token_ids": null,
         "images": ["/data/train/000017.jpg"]}
    """

    id: str | None = None
    """Client tag echoed in ``InferOutput.id`` (e.g. the sample id); None = untagged."""
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    """Chat to continue with the assistant turn; None when ``prompt_token_ids`` is given."""
    prompt_token_ids: list[int] | None = Field(None, min_length=1)
    """Already-templated prompt token ids (vision pad tokens included); None when ``messages`` is given."""
    images: list[str] | None = None
    """Images for the image slots in order: server-side file paths or ``data:image/<fmt>;base64,...``
    URIs; None = no images besides inline ones."""

    @field_validator("images")
    @classmethod
    def _images_are_refs(cls, images: list[str] | None) -> list[str] | None:
        for ref in images or []:
            _check_image_ref(ref)
        return images

    @model_validator(mode="after")
    def _one_prompt(self) -> InferItem:
        if (self.messages is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of 'messages' or 'prompt_token_ids'")
        if self.messages is not None:
            slots = sum(
                1
                for m in self.messages
                if isinstance(m.content, list)
                for p in m.content
                if p.type == "image" and p.image is None
            )
            given = len(self.images or [])
            if slots != given:
                raise ValueError(f"'images' has {given} entries for {slots} image parts without 'image'")
        return self


class InferRequest(_Message):
    """Body of ``POST /infer``: a batch decoded under one weight version.

    Example:
        {"items": [{"id": "s1", "prompt_token_ids": [151644, 872, 198]}],
         "sampling": {"max_tokens": 256}, "min_ver": 3, "client": "actor-r0-0"}
    """

    items: list[InferItem] = Field(min_length=1, max_length=MAX_BATCH)
    """Prompts, 1..MAX_BATCH; outputs come back in the same order."""
    sampling: SamplingParams
    """One set of decoding knobs for the whole batch."""
    min_ver: int | None = Field(None, ge=0)
    """Admit the batch only once the server's ver >= min_ver (it waits, up to its infer timeout);
    None = any version."""
    client: str | None = None
    """Caller id for logs and metrics (e.g. ``actor-r0-0``); None = anonymous."""


class InferOutput(_Message):
    """The completion of one item.

    Example:
        {"id": "s1", "token_ids": [90, 1, 151645], "text": "{}", "finish_reason": "stop",
         "prompt_token_ids": [151644, 872, 198]}
    """

    id: str | None = None
    """``InferItem.id`` echoed; None if the item had none."""
    token_ids: list[int]
    """Generated token ids, turn-end token included when generation stopped on it."""
    text: str
    """``token_ids`` detokenised (for logs and humans; parsing uses ``token_ids``)."""
    finish_reason: Literal["stop", "length", "abort"]
    """``stop``: turn end or a stop string; ``length``: hit max_tokens; ``abort``: cut by a sync fence
    in abort mode — the tokens are unusable and the client resubmits the item."""
    prompt_token_ids: list[int]
    """The prompt as the engine saw it (templated, with vision pad tokens)."""


class InferResponse(_Message):
    """Body of a 200 from ``POST /infer``.

    Example:
        {"ver": 3, "outputs": [{"id": "s1", "token_ids": [90, 1, 151645], "text": "{}",
         "finish_reason": "stop", "prompt_token_ids": [151644, 872, 198]}], "engine": "hf",
         "elapsed_s": 0.42}
    """

    ver: int = Field(ge=0)
    """Weight version every output of this batch was generated under."""
    outputs: list[InferOutput]
    """One output per request item, same order."""
    engine: str
    """Engine that served the batch: ``vllm`` or ``hf``."""
    elapsed_s: float = Field(ge=0.0)
    """Server-side seconds from admission to response (fence waits excluded)."""


# =============================================================================================
# anyone -> rollout server (HTTP): GET /health
# =============================================================================================


class SyncState(StrEnum):
    """The server's weight-sync state machine (one client at a time; others get 409)::

        idle --init--> open --begin (fence closes)--> fenced --bucket*--> fenced --commit--> committing
        committing --(weights swapped, caches reset, ver += 1, fence opens)--> idle
        open | fenced --abort, error or session timeout--> idle (old weights, old ver)
    """

    IDLE = "idle"
    OPEN = "open"
    FENCED = "fenced"
    COMMITTING = "committing"


class HealthResponse(_Message):
    """Body of ``GET /health``; the status code is 200 only when ``status == "ok"``.

    Example:
        {"status": "ok", "engine": "hf", "model": "/models/tiny-qwen2-vl", "ver": 3,
         "sync_state": "idle", "world_size": 1, "schema": 1}
    """

    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True, validate_by_alias=True)

    status: Literal["ok", "loading", "syncing", "error"]
    """``ok`` serves; ``loading`` = engine starting; ``syncing`` = fence closed; ``error`` = see logs."""
    engine: str
    """``vllm`` or ``hf``."""
    model: str
    """Model path or name the engine loaded."""
    ver: int = Field(ge=0)
    """Current weight version (0 = the checkpoint as loaded, no sync yet)."""
    sync_state: SyncState
    """Where the weight-sync state machine is."""
    world_size: int = Field(ge=1)
    """Engine workers (tensor parallel x data parallel) that receive weights."""
    schema_version: int = Field(SCHEMA_VERSION, alias="schema")
    """The server's ``SCHEMA_VERSION``; clients refuse a different one at start."""
    engine_info: dict[str, Any] = Field(default_factory=dict)
    """Engine details for operators (``Engine.health_info``): device, dtype, TP/DP and, for vLLM, the
    weight-load path in use (``fast``, ``native``, or ``native (fast refused: <why>)``)."""


# =============================================================================================
# learner rank0 -> rollout server (HTTP, admin): POST /sync/{init,begin,bucket,update,commit,abort}
# Bearer token required when configured. Order: init -> begin -> bucket|update x n -> commit.
# GET /sync/digest (ops, tests) reads exact weight digests between sessions.
# =============================================================================================


class TensorSpec(_Message):
    """Name, dtype and shape of one served parameter.

    Example:
        {"name": "model.embed_tokens.weight", "dtype": "bfloat16", "shape": [152064, 2048]}
    """

    name: str = Field(min_length=1)
    """HF module name (no ``module.``/``_orig_mod.`` prefixes)."""
    dtype: SyncDtype
    """Serving dtype of this tensor (torch name)."""
    shape: list[int]
    """Dimensions, each >= 0."""

    @field_validator("shape")
    @classmethod
    def _dims_non_negative(cls, shape: list[int]) -> list[int]:
        if any(d < 0 for d in shape):
            raise ValueError(f"dimensions must be >= 0, got {shape}")
        return shape


class SyncInitRequest(_Message):
    """Body of ``POST /sync/init``: open a sync session (idle -> open).

    Example:
        {"client": "learner-rank0", "transport": "http", "bucket_bytes": 536870912,
         "master_addr": null, "master_port": null, "world_size": null, "rank_offset": 1,
         "backend": "nccl", "timeout_s": 600.0}
    """

    client: str = Field(min_length=1)
    """Who pushes, for logs and 409 messages (e.g. ``learner-rank0@host:pid``)."""
    transport: Literal["http", "nccl"]
    """``http``: safetensors buckets in request bodies; ``nccl``: broadcast from learner rank 0."""
    bucket_bytes: int = Field(512 * 2**20, ge=1)
    """Bytes per bucket, at most; one tensor larger than this travels alone."""
    master_addr: str | None = None
    """NCCL rendezvous host (learner rank 0); required for ``nccl``, None for ``http``."""
    master_port: int | None = Field(None, ge=1, le=65535)
    """NCCL rendezvous port; required for ``nccl``, None for ``http``."""
    world_size: int | None = Field(None, ge=2)
    """Weight-transfer group size = 1 (learner rank 0) + server workers; required for ``nccl``."""
    rank_offset: int = Field(1, ge=1)
    """Rank of the first server worker in that group (learner rank 0 is rank 0)."""
    backend: Literal["nccl", "gloo"] = "nccl"
    """The group's backend, as learner rank 0 builds it: ``nccl`` for weights on a GPU, ``gloo`` on
    CPU (only an engine on CPU joins a gloo group); a mismatch is refused before anyone waits."""
    timeout_s: float = Field(600.0, gt=0)
    """Seconds the whole session may take; past it the server aborts it and keeps the old weights."""
    weight_load: Literal["fast", "native"] | None = None
    """NCCL only: overrides ``rollout_server.weight_load`` for this session (the benchmark and the GPU
    tests compare the two load paths on one server); None keeps the server's setting."""

    @model_validator(mode="after")
    def _nccl_needs_rendezvous(self) -> SyncInitRequest:
        missing = [k for k in ("master_addr", "master_port", "world_size") if getattr(self, k) is None]
        if self.transport == "nccl" and missing:
            raise ValueError(f"transport 'nccl' needs {missing}")
        if self.transport == "http" and self.weight_load is not None:
            raise ValueError("weight_load applies to transport 'nccl' only; leave it null for 'http'")
        return self


class SyncInitResponse(_Message):
    """Reply to ``/sync/init``: what the server expects to receive.

    Example:
        {"session": "s-7f3a", "ver": 3, "dtype": "bfloat16",
         "manifest": [{"name": "lm_head.weight", "dtype": "bfloat16", "shape": [151936, 896]}],
         "tied": [["model.embed_tokens.weight", "lm_head.weight"]]}
    """

    session: str
    """Session id to quote in every later call."""
    ver: int = Field(ge=0)
    """Server weight version now."""
    dtype: SyncDtype
    """Serving dtype floating-point weights are cast to before sending."""
    manifest: list[TensorSpec]
    """Every served parameter the learner must send, once each."""
    tied: list[list[str]] = Field(default_factory=list)
    """Groups of names sharing one storage; send only the first name of each group."""


class SyncBeginRequest(_Message):
    """Body of ``POST /sync/begin``: close the fence (open -> fenced).

    Example:
        {"session": "s-7f3a", "mode": "drain", "expected_buckets": 4, "timeout_s": 60.0}
    """

    session: str
    """From ``SyncInitResponse.session``."""
    mode: Literal["drain", "abort"] = "drain"
    """``drain``: finish in-flight requests first; ``abort``: cut them (finish_reason ``abort``)."""
    expected_buckets: int | None = Field(None, ge=1)
    """Buckets the learner will send, for progress and an early check; None = not announced."""
    timeout_s: float = Field(60.0, gt=0)
    """Seconds to wait for the drain; past it the begin fails with ``sync_timeout`` and the fence reopens."""


class SyncBeginResponse(_Message):
    """Reply to ``/sync/begin`` once no request runs on the engine.

    Example:
        {"ver_before": 3, "drained": 12, "aborted": 0, "fence_s": 0.8}
    """

    ver_before: int = Field(ge=0)
    """Weight version the staged update will replace."""
    drained: int = Field(ge=0)
    """In-flight requests that finished before the fence closed."""
    aborted: int = Field(ge=0)
    """In-flight requests cut (``abort`` mode); their clients resubmit."""
    fence_s: float = Field(ge=0)
    """Seconds from the begin call to a quiet engine."""


class SyncBucketHeader(_Message):
    """Layout of one bucket, enough to validate it before staging (state stays fenced).

    HTTP: JSON in the :data:`BUCKET_HEADER` request header of ``POST /sync/bucket``, whose body is a
    safetensors blob; offsets are into its data section. NCCL: body of ``POST /sync/update``, sent
    before rank 0 broadcasts one flat uint8 buffer; offsets are into that buffer.

    Example:
        {"session": "s-7f3a", "index": 0, "names": ["lm_head.weight"], "dtypes": ["bfloat16"],
         "shapes": [[151936, 896]], "offsets": [[0, 272269312]]}
    """

    session: str
    """From ``SyncInitResponse.session``."""
    index: int = Field(ge=0)
    """Bucket number within the session, from 0, consecutive."""
    names: list[str] = Field(min_length=1)
    """Parameter names in the bucket, each from the manifest, no repeats within the session."""
    dtypes: list[SyncDtype]
    """Dtype of each tensor, parallel to ``names``."""
    shapes: list[list[int]]
    """Shape of each tensor, parallel to ``names``."""
    offsets: list[tuple[int, int]]
    """Byte range ``[begin, end)`` of each tensor in the bucket, parallel to ``names``."""

    @model_validator(mode="after")
    def _layout_consistent(self) -> SyncBucketHeader:
        n = len(self.names)
        if not len(self.dtypes) == len(self.shapes) == len(self.offsets) == n:
            raise ValueError("names, dtypes, shapes and offsets must have equal length")
        if len(set(self.names)) != n:
            raise ValueError("names repeat within the bucket")
        for name, dtype, shape, (begin, end) in zip(self.names, self.dtypes, self.shapes, self.offsets):
            if any(d < 0 for d in shape) or begin < 0:
                raise ValueError(f"{name}: negative dimension or offset")
            if end - begin != math.prod(shape) * SYNC_DTYPE_BYTES[dtype]:
                raise ValueError(f"{name}: offsets span {end - begin} bytes, {dtype} {shape} needs "
                                 f"{math.prod(shape) * SYNC_DTYPE_BYTES[dtype]}")
        return self


class SyncBucketResponse(_Message):
    """Reply to ``/sync/bucket`` or ``/sync/update`` once the bucket is staged.

    Example:
        {"session": "s-7f3a", "index": 0, "n_tensors": 1, "nbytes": 272269312, "elapsed_s": 0.31}
    """

    session: str
    """Echo."""
    index: int = Field(ge=0)
    """Echo of ``SyncBucketHeader.index``."""
    n_tensors: int = Field(ge=0)
    """Tensors staged from this bucket."""
    nbytes: int = Field(ge=0)
    """Bytes received."""
    elapsed_s: float = Field(ge=0)
    """Seconds from request to staged."""
    load: dict[str, float | str | bool | None] | None = None
    """``/sync/update`` only: how the engine loaded it (vLLM: ``path`` fast|native, ``rpc_s`` worker
    call, ``worker_s`` / ``gpu_s`` receive+copy as the slowest worker timed it, ``one_call``)."""


class SyncCommitRequest(_Message):
    """Body of ``POST /sync/commit``: swap the staged weights in (fenced -> committing -> idle).

    Example:
        {"session": "s-7f3a", "n_buckets": 4, "fingerprint": "9c1e2a0b5d7f3e11"}
    """

    session: str
    """From ``SyncInitResponse.session``."""
    n_buckets: int = Field(ge=0)
    """Buckets sent; the commit fails (old weights kept) if the server staged a different number or the
    manifest is incomplete."""
    fingerprint: str | None = None
    """Learner-side weights fingerprint to compare after the swap; None = skip the comparison."""
    min_ver: int | None = Field(default=None, ge=0)
    """Lowest ver this commit may produce: the server sets ``ver = max(previous + 1, min_ver)``.
    The learner passes its own ver + 1, so ver continues from ``max(server ver, checkpoint ver) + 1``
    after a learner resume or a server restart and never goes back. None = previous + 1."""


class SyncCommitResponse(_Message):
    """Reply to ``/sync/commit``: the new weights are live and the fence is open.

    Example:
        {"ver": 4, "commit_s": 0.12, "fingerprint": "9c1e2a0b5d7f3e11"}
    """

    ver: int = Field(ge=0)
    """New weight version: ``max(previous + 1, min_ver)``."""
    commit_s: float = Field(ge=0)
    """Seconds to swap weights and reset caches."""
    fingerprint: str
    """Server-side fingerprint of the weights now served."""


class SyncAbortRequest(_Message):
    """Body of ``POST /sync/abort``: drop the session and staged weights (any state but idle -> idle).

    Example:
        {"session": "s-7f3a", "reason": "learner rank 0 hit a NCCL timeout"}
    """

    session: str
    """From ``SyncInitResponse.session``."""
    reason: str | None = None
    """Logged by the server; None = no reason given."""


class SyncAbortResponse(_Message):
    """Reply to ``/sync/abort``.

    Example:
        {"ver": 3, "state": "idle", "aborted": true}
    """

    ver: int = Field(ge=0)
    """Weight version still served (unchanged)."""
    state: SyncState
    """State after the abort (``idle``)."""
    aborted: bool
    """False when no such session was open (an abort is idempotent)."""


class SyncDigestResponse(_Message):
    """Reply to ``GET /sync/digest`` (bearer token like every ``/sync/*``; 409 while a session is open).

    One exact digest (``rollout_server.weights.exact_digest``: every element, not a sample) per
    engine worker holding weights; equal digests mean bit-identical weights across workers, or
    between two weight-load paths, or with the tensors the learner pushed (cast to the serving dtype).

    Example:
        {"engine": "vllm", "ver": 4, "digests": ["3f9c0e1ab2d47c55", "3f9c0e1ab2d47c55"]}
    """

    engine: str
    """``vllm`` or ``hf``."""
    ver: int = Field(ge=0)
    """Weight version the digests were computed under."""
    digests: list[str] = Field(min_length=1)
    """Hex digest per worker (tensor x data parallel rank order); the hf engine has one."""


# =============================================================================================
# rollout server -> any HTTP client: the body of every 4xx/5xx
# =============================================================================================

ErrorCode = Literal[
    "bad_request",  # 400/422: a body that fails validation; `field` names it
    "unauthorized",  # 401: /sync/* without the configured bearer token
    "sync_conflict",  # 409: another client holds the sync session
    "sync_state",  # 409: call out of order for the sync state machine (e.g. commit before begin)
    "sync_timeout",  # 504: drain or session deadline passed; old weights kept
    "not_ready",  # 503: engine loading or in error
    "engine_error",  # 500: the engine failed on a valid request
    "not_implemented",  # 501: the selected engine does not serve this route (e.g. /sync/digest)
]


class ErrorResponse(_Message):
    """Body of every 4xx/5xx from the rollout server.

    Example:
        {"error": "bad_request", "field": "sampling.max_tokens",
         "message": "sampling.max_tokens: Input should be less than or equal to 32768",
         "hint": "lower rollout_matching.decoding.max_new_tokens"}
    """

    error: ErrorCode
    """Machine-readable code (list above)."""
    message: str
    """Human-readable, naming the offending field or state."""
    field: str | None = None
    """Dotted path of the offending field; None when not about one field."""
    hint: str | None = None
    """The likely fix; None when there is none to give."""

    @classmethod
    def from_validation_error(cls, exc: ValidationError, hint: str | None = None) -> ErrorResponse:
        """A ``bad_request`` naming every field pydantic rejected (the first one in ``field``)."""
        problems = [(".".join(map(str, e["loc"])) or "body", e["msg"]) for e in exc.errors()]
        message = "; ".join(f"{loc}: {msg}" for loc, msg in problems)
        return cls(error="bad_request", field=problems[0][0] if problems else None, message=message, hint=hint)


def _check_image_ref(ref: str) -> None:
    if ref.startswith("data:"):
        head, _, payload = ref.partition(",")
        if not (head.startswith("data:image/") and head.endswith(";base64") and payload):
            raise ValueError("a data URI image must look like 'data:image/<fmt>;base64,<payload>'")
    elif not ref:
        raise ValueError("an image path must not be empty")


# =============================================================================================
# actor -> learner rank r (ZMQ): pack message, multipart [msgpack header, raw array frame...]
#   encode_pack_message / decode_pack_message (any arrays), pack_to_frames / frames_to_pack
#   (a common.segment.Pack), PackMessage, WIRE_DTYPES -- defined in common.wire, layout in its
#   docstring.
#
# learner rank r -> actors (ZMQ back-channel): credits, one msgpack frame
#   encode_credits / decode_credits, Credits -- defined in common.wire.
#
# Both decoders raise ProtocolError (and nothing else) on any malformed input.
# =============================================================================================
