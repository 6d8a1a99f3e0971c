"""The rollout server's HTTP messages but the weight sync's: ``POST /infer``, ``GET /health``, error bodies.

    actor ──HTTP /infer──────────────► rollout server      InferRequest -> InferResponse
    anyone ──HTTP /health────────────► rollout server      HealthResponse
    rollout server ──any 4xx/5xx─────► any HTTP client     ErrorResponse

Bodies are JSON validated by the pydantic models here (server and client import the same classes); every
model forbids unknown fields, so a typo is a 4xx naming the field, not a silent default. The ``/sync/*``
messages are in ``common/weight_sync/messages.py``, the ZMQ codecs in ``common/wire/codec.py`` (the links side by side:
``common/wire/__init__.py``).

What this module does not know: sockets, engines, tokenizers, torch. It imports pydantic and the other wire modules
(msgpack, numpy) only, so every process (and the CPU-only actor) can import it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from common.wire.base import Message as _Message
from common.wire.base import ContentError, error_location, lone_surrogate
from common.weight_sync.messages import MAX_VER, SyncState
from common.wire.codec import SCHEMA_VERSION

#: Upper bound on ``SamplingParams.max_tokens``; larger values are a config mistake, not a request.
MAX_TOKENS_LIMIT = 32768
#: Upper bound on ``InferRequest.items``; clients split larger batches.
MAX_BATCH = 1024
#: Sampling seeds are 0 .. 2**53 - 1: inside what torch's and vLLM's generators take (a 64-bit seed overflowed),
#: and exact as a JSON number, so the schema's bound is the server's (2**63 - 1 read as a double is 2**63: a
#: client checking the schema took seeds the server refused).
MAX_SEED = 2**53 - 1
#: ``top_k`` and token ids fit an int32 (vLLM keeps them in int32 tensors); larger is never meaningful.
MAX_INT32 = 2**31 - 1
#: Repetition penalties outside [1/100, 100] push logits to inf (a NaN distribution on the engine), and no
#: model is decoded with them: vLLM's and HF's useful range is about 1.0 to 1.5.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
#: Extra stop strings per request, and characters per string (vLLM scans every one after every token).
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]



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
    top_k: int = Field(0, ge=-1, le=MAX_INT32)
    """Keep the k most likely tokens; 0 or -1 = off."""
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    """New tokens to generate at most (required: the server has no safe default)."""
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    """Per-request sampling seed in 0..2**53-1; None = the engine's own randomness (not reproducible)."""
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    """Extra stop strings (at most 16, each 1..256 characters); generation always stops at the chat
    template's turn end."""
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    """vLLM/HF repetition penalty in [0.01, 100]; 1 = off."""
    logprobs: bool = Field(False, exclude_if=lambda v: v is False)
    """Return the log-probability of every generated token in ``InferOutput.logprobs``: the sampled
    token's log-softmax under the model's raw logits, before repetition penalty, temperature, top-k and
    top-p (so a score does not depend on the decoding knobs). Both engines report this: hf computes it
    in its sampler from the logits ``generate`` hands it, vllm runs with ``logprobs_mode=raw_logprobs``
    and ``logprobs=0``. Left out of the JSON when False (see ``InferOutput.logprobs``)."""
    ignore_eos: bool = Field(False, exclude_if=lambda v: v is False)
    """Do not stop at the eos / turn-end tokens (they are sampled like any other and kept): only
    ``max_tokens`` and ``stop`` strings end a row, so every row without a stop string generates exactly
    ``max_tokens`` — vLLM's ``ignore_eos``, for benchmarks that need a fixed output length. Left out of
    the JSON when False, like ``logprobs``."""


class ChatPart(_Message):
    """One part of a multimodal chat message (Qwen/OpenAI style).

    Example:
        {"type": "image", "text": null, "image": null}
    """

    type: Literal["text", "image"]
    """``text`` carries ``text``; ``image`` is an image slot."""
    text: str | None = None
    """The text of a ``text`` part; None for image parts."""
    image: str | None = Field(None, min_length=1)
    """An ``image`` part's image inline (path or data URI, as in ``InferItem.images``); None = take the
    next entry of ``InferItem.images``."""

    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "text"}}, "required": ["type"]},
        "then": {"required": ["text"], "properties": {"text": {"type": "string"}, "image": {"type": "null"}}},
        "else": {"properties": {"text": {"type": "null"}}},
    })

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

    Rules the schema cannot state (a 400 when broken): ``images`` has one entry per image part without
    an inline ``image``; every token id is inside the model's vocabulary; the prompt fits the model's
    context (its ``max_position_embeddings``); every image can be read.

    Example:
        {"id": "coco-17", "messages": [{"role": "user", "content": [{"type": "image"},
         {"type": "text", "text": "Detect all objects."}]}], "prompt_token_ids": null,
         "images": ["/data/train/000017.jpg"]}
    """

    id: str | None = None
    """Client tag echoed in ``InferOutput.id`` (e.g. the sample id); None = untagged."""
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    """Chat to continue with the assistant turn; None when ``prompt_token_ids`` is given."""
    prompt_token_ids: list[TokenId] | None = Field(None, min_length=1)
    """Already-templated prompt token ids (vision pad tokens included), each in 0..2**31-1 (one outside
    the model's vocabulary is a 400 naming it); None when ``messages`` is given."""
    images: list[Annotated[str, Field(min_length=1)]] | None = None
    """Images for the image slots in order: server-side file paths or ``data:image/<fmt>;base64,...``
    URIs; None = no images besides inline ones."""

    @field_validator("images")
    @classmethod
    def _images_are_refs(cls, images: list[str] | None) -> list[str] | None:
        for ref in images or []:
            _check_image_ref(ref)
        return images

    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt_token_ids": {"type": "null"}}},
        {"required": ["prompt_token_ids"],
         "properties": {"prompt_token_ids": {"type": "array"}, "messages": {"type": "null"}}},
    ]})

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
                raise ContentError(f"'images' has {given} entries for {slots} image parts without 'image'")
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
    min_ver: int | None = Field(None, ge=0, le=MAX_VER)
    """Admit the batch only once the server's ver >= min_ver (it waits, up to its infer timeout);
    None = any version."""
    client: str | None = None
    """Caller id for logs and metrics (e.g. ``actor-r0-0``); None = anonymous."""


class InferOutput(_Message):
    """The completion of one item.

    Example:
        {"id": "s1", "token_ids": [90, 1, 151645], "text": "{}", "finish_reason": "stop",
         "prompt_token_ids": [151644, 872, 198], "logprobs": [-0.105, -0.0021, -0.0003]}
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
    logprobs: list[float] | None = Field(None, exclude_if=lambda v: v is None)
    """With ``sampling.logprobs``: one natural-log probability (<= 0) per entry of ``token_ids``, same
    order, turn-end token included — what ``SamplingParams.logprobs`` describes. None (and left out of
    the JSON, so that peers built before this field still parse the message) when not requested."""

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> InferOutput:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.token_ids)} token_ids")
        return self


class InferResponse(_Message):
    """Body of a 200 from ``POST /infer``.

    Example:
        {"ver": 3, "outputs": [{"id": "s1", "token_ids": [90, 1, 151645], "text": "{}",
         "finish_reason": "stop", "prompt_token_ids": [151644, 872, 198]}], "engine": "hf",
         "elapsed_s": 0.42}
    """

    ver: int = Field(ge=0, le=MAX_VER)
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


class HealthResponse(_Message):
    """Body of ``GET /health``; the status code is 200 only when ``status == "ok"``.

    Example:
        {"status": "ok", "engine": "hf", "model": "/models/tiny-qwen2-vl", "ver": 3,
         "sync_state": "idle", "world_size": 1, "schema": 2}
    """

    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True, validate_by_alias=True)

    status: Literal["ok", "loading", "syncing", "error"]
    """``ok`` serves; ``loading`` = engine starting; ``syncing`` = fence closed; ``error`` = see logs."""
    engine: str
    """``vllm`` or ``hf``."""
    model: str
    """Model path or name the engine loaded."""
    ver: int = Field(ge=0, le=MAX_VER)
    """Current weight version (0 = the checkpoint as loaded, no sync yet)."""
    sync_state: SyncState
    """Where the weight-sync state machine is."""
    world_size: int = Field(ge=1)
    """Engine workers (tensor parallel x data parallel) that receive weights."""
    schema_version: int = Field(SCHEMA_VERSION, alias="schema")
    """The server's ``SCHEMA_VERSION``; clients refuse a different one at start."""
    engine_info: dict[str, Any] = Field(default_factory=dict)
    """Engine details for operators (``Engine.health_info``): device, dtype, TP/DP and, for vLLM, the
    weight-load path in use (``fast``, ``native``, or ``native (fast refused: <why>)``); ``image_pixels``
    (``{"min_pixels": 3136, "max_pixels": 12544, "multiple_of": 28}``, None for a text-only model): what images
    are resized with, compared by actors and the evaluator at start (``common.data.image_size.mismatch``)."""


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
    "request_timeout",  # 408: the request body stopped arriving (rollout_server.body_read_timeout_s)
    "client_closed",  # 499 (logged and counted only): the client disconnected; its generation was cancelled
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

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """An error may quote the text it refuses: a lone surrogate there is escaped, not refused."""
        if isinstance(value, str) and lone_surrogate(value) is not None:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value

    @classmethod
    def from_validation_error(cls, exc: ValidationError, hint: str | None = None) -> ErrorResponse:
        """A ``bad_request`` naming every field pydantic rejected (the first one in ``field``)."""
        problems = [(".".join(error_location(e)) or "body", e["msg"]) for e in exc.errors()]
        message = "; ".join(f"{loc}: {msg}" for loc, msg in problems)
        return cls(error="bad_request", field=problems[0][0] if problems else None, message=message, hint=hint)


def _check_image_ref(ref: str) -> None:
    if ref.startswith("data:"):
        head, _, payload = ref.partition(",")
        if not (head.startswith("data:image/") and head.endswith(";base64") and payload):
            # An image reference the server cannot read, like an unreadable image: a 400, not a schema 422.
            raise ContentError("a data URI image must look like 'data:image/<fmt>;base64,<payload>'")
    elif not ref:
        raise ValueError("an image path must not be empty")


# =============================================================================================
# actor -> learner rank r (ZMQ): pack message, multipart [msgpack header, raw array frame...]
#   encode_pack_message / decode_pack_message (any arrays), pack_to_frames / frames_to_pack
#   (a common.packing.segment.Pack), PackMessage, WIRE_DTYPES -- defined in common.wire.codec, layout in its
#   docstring.
#
# learner rank r -> actors (ZMQ back-channel): credits, one msgpack frame
#   encode_credits / decode_credits, Credits -- defined in common.wire.codec.
#
# Both decoders raise ProtocolError (and nothing else) on any malformed input.
# =============================================================================================
