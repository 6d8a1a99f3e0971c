"""An OpenAI-compatible subset, so any OpenAI client or eval harness can query the policy in training.

    GET  /v1/models             the served model (id = the model path)
    POST /v1/completions        prompt: str | [str] | [int] | [[int]]
    POST /v1/chat/completions   messages with text, and images as ``image_url`` data URIs

The request bodies here are OpenAI's schema, not tandem's (``common.wire.http``); unknown OpenAI
fields are accepted and ignored, as vLLM does, but the ones that would change the answer and that
we do not implement (``n > 1``, ``stream``, ``logprobs``, ``tools``) are refused with a 400 naming
them. Sampling maps onto :class:`common.wire.http.SamplingParams` like vLLM's OpenAI server (extra
``top_k``, ``repetition_penalty`` and ``ignore_eos`` accepted); ``max_tokens`` defaults to 16 for
completions (the OpenAI default) and 512 for chat. Requests go through the same fence as /infer: the
batch's ``ver`` is in ``system_fingerprint`` as ``ver-<n>``. Images must be ``data:`` URIs (the server
does not download, and this route does not read server-side paths). Errors under ``/v1`` use
OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}`` (rollout_server/errors.py) so
OpenAI clients show the message; every other route answers with ``common.wire.http.ErrorResponse``.

What this module does not know: tandem's own bodies beyond the ones it translates to
(``InferItem``, ``SamplingParams``), or how a batch is admitted and run (:func:`rollout_server.routes.infer.generate`).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema

from common.wire.base import Message, content_only, error_location
from common.wire.http import (MAX_INT32, MAX_SEED, MAX_STOP_STRINGS, MAX_TOKENS_LIMIT, REPETITION_PENALTY_RANGE,
                              ChatMessage, ChatPart, InferItem, SamplingParams, StopString, TokenId)
from rollout_server.errors import ApiError
from rollout_server.routes.infer import generate
from rollout_server.state import Server

#: What an image part's URL must look like (the payload is checked when the image is read: a 400).
DATA_URI = r"^data:image/[A-Za-z0-9.+-]+;base64,[A-Za-z0-9+/=]+$"
CHAT_DEFAULT_MAX_TOKENS = 512
COMPLETION_DEFAULT_MAX_TOKENS = 16


class _OpenAIModel(Message):
    """OpenAI's bodies: unknown fields are accepted and ignored (as vLLM does); text must be valid Unicode."""

    model_config = ConfigDict(extra="allow")


class OpenAIError(BaseModel):
    """The body of every /v1 error: OpenAI's envelope, so OpenAI clients show the message."""

    class Detail(BaseModel):
        message: str
        type: Literal["invalid_request_error", "server_error"]
        param: str | None = None
        code: str

    error: Detail


#: The errors a /v1 route answers (all in OpenAI's envelope): 400 a request this server does not serve or
#: content it cannot use, 413 over a size limit, 422 a body that breaks this schema, 500 an engine failure,
#: 503 not ready or the fence's wait ran out.
OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": OpenAIError} for code in (400, 413, 422, 500, 503)}

NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class _OpenAIRequest(_OpenAIModel):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool = False  # vLLM's extra parameter: eos / turn end do not stop (fixed-length benchmarks)
    n: int = 1
    stream: bool = False
    logprobs: Any = None

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        for key, bad in (("n", self.n != 1), ("stream", self.stream), ("logprobs", self.logprobs not in (None, False))):
            if bad:
                raise ApiError(400, "bad_request", f"{key}={getattr(self, key)!r} is not supported by this server",
                               field=key)
        if getattr(self, "tools", None):
            raise ApiError(400, "bad_request", "tools are not supported by this server", field="tools")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            seed=self.seed, stop=stop,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_OpenAIRequest):
    """``POST /v1/completions`` (OpenAI schema subset)."""

    prompt: (NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1)])
    """One prompt (text or token ids) or a batch of them; none may be empty."""


def _data_uri(url: str) -> str:
    if not re.match(DATA_URI, url):
        raise ValueError("images must be data URIs (data:image/<fmt>;base64,...); this server does not download URLs")
    return url


#: An image part's URL: the schema states the pattern; the validator says why in words.
DataUri = Annotated[str, AfterValidator(_data_uri), WithJsonSchema({"type": "string", "pattern": DATA_URI})]


class ImageUrl(_OpenAIModel):
    url: DataUri
    """A ``data:image/<fmt>;base64,...`` URI: this server does not download URLs."""


class TextContent(_OpenAIModel):
    type: Literal["text"]
    text: str


class ImageContent(_OpenAIModel):
    type: Literal["image_url"]
    image_url: ImageUrl | DataUri


class ChatMessageIn(_OpenAIModel):
    """One OpenAI chat message: ``developer`` is read as ``system``; tool and function roles are not served."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextContent | ImageContent], Field(min_length=1)]


class ChatRequest(_OpenAIRequest):
    """``POST /v1/chat/completions`` (OpenAI schema subset)."""

    messages: list[ChatMessageIn] = Field(min_length=1)


def _usage(outputs: list[Any]) -> dict[str, int]:
    p = sum(len(o.prompt_token_ids) for o in outputs)
    c = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _chat_message(m: ChatMessageIn) -> ChatMessage:
    role = "system" if m.role == "developer" else m.role
    if isinstance(m.content, str):
        return ChatMessage(role=role, content=m.content)
    return ChatMessage(role=role, content=[
        ChatPart(type="text", text=p.text) if isinstance(p, TextContent)
        else ChatPart(type="image", image=p.image_url.url if isinstance(p.image_url, ImageUrl) else p.image_url)
        for p in m.content])


router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(server: Server) -> dict[str, Any]:
    model_id = server.engine.model_path
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "tandem",
                                        "root": model_id}]}


def wrap(make: Callable[[], Any]) -> Any:
    """``make()``, with a ValidationError of our protocol models (the translated request) answered as ours are."""
    try:
        return make()
    except ValidationError as exc:  # our protocol models rejected the translated request
        problems = [(".".join(error_location(e)), e["msg"]) for e in exc.errors()]
        raise ApiError(400 if content_only(exc.errors()) else 422, "bad_request", str(exc).splitlines()[0] + ": " + "; ".join(
            f"{loc}: {msg}" for loc, msg in problems), field=problems[0][0] if problems else None) from None


# The /v1 handlers answer JSONResponse: one json.dumps, where a returned dict is validated against its
# annotation first (and, before FastAPI 0.130, converted to JSON-able objects before the dumps).
@router.post("/completions", responses=OPENAI_ERRORS)
async def completions(req: CompletionRequest, request: Request, server: Server) -> JSONResponse:
    engine = server.engine
    sampling = wrap(lambda: req.sampling(COMPLETION_DEFAULT_MAX_TOKENS))
    prompts = req.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # type: ignore[list-item]
    if not prompts:
        raise ApiError(400, "bad_request", "prompt is empty", field="prompt")
    server.require_ready()  # text prompts are tokenized here, by the engine's tokenizer
    # Tokenizing is CPU work (a 64 MB prompt: seconds): on a thread, so the event loop keeps serving.
    encoded = await asyncio.to_thread(lambda: [p if isinstance(p, list) else engine.encode_text(p) for p in prompts])
    items = wrap(lambda: [InferItem(prompt_token_ids=ids) for ids in encoded])
    ticket, outputs = await generate(server, request, items, sampling, None, "prompt")
    return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex[:16]}", "object": "text_completion",
                         "created": int(time.time()), "model": engine.model_path,
                         "system_fingerprint": f"ver-{ticket.ver}",
                         "choices": [{"index": i, "text": o.text, "finish_reason": o.finish_reason,
                                      "logprobs": None} for i, o in enumerate(outputs)],
                         "usage": _usage(outputs)})


@router.post("/chat/completions", responses=OPENAI_ERRORS)
async def chat(req: ChatRequest, request: Request, server: Server) -> JSONResponse:
    sampling = wrap(lambda: req.sampling(CHAT_DEFAULT_MAX_TOKENS))
    messages = wrap(lambda: [_chat_message(m) for m in req.messages])
    item = wrap(lambda: InferItem(messages=messages))
    ticket, outputs = await generate(server, request, [item], sampling, None, "messages")
    o = outputs[0]
    return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion",
                         "created": int(time.time()), "model": server.engine.model_path,
                         "system_fingerprint": f"ver-{ticket.ver}",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": o.text},
                                      "finish_reason": o.finish_reason, "logprobs": None}],
                         "usage": _usage(outputs)})
