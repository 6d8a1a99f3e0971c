"""An OpenAI-compatible subset, so any OpenAI client or eval harness can query the policy in training.

    GET  /v1/models             the served model (id = the model path)
    POST /v1/completions        prompt: str | [str] | [int] | [[int]]
    POST /v1/chat/completions   messages with text, and images as ``image_url`` data URIs

The request bodies here are OpenAI's schema, not tandem's (``common.protocol``); unknown OpenAI
fields are accepted and ignored, as vLLM does, but the ones that would change the answer and that
we do not implement (``n > 1``, ``stream``, ``logprobs``, ``tools``) are refused with a 400 naming
them. Sampling maps onto :class:`common.protocol.SamplingParams` like vLLM's OpenAI server (extra
``top_k``, ``repetition_penalty`` and ``ignore_eos`` accepted); ``max_tokens`` defaults to 16 for
completions (the OpenAI default) and 512 for chat. Requests go through the same fence as /infer: the
batch's ``ver`` is in ``system_fingerprint`` as ``ver-<n>``. Images must be ``data:`` URIs (the server
does not download, and this route does not read server-side paths). Errors under ``/v1`` use
OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}`` so OpenAI clients show the
message; every other route answers with ``common.protocol.ErrorResponse``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.protocol import (MAX_INT32, MAX_SEED, MAX_TOKENS_LIMIT, REPETITION_PENALTY_RANGE, ChatMessage, ChatPart,
                             InferItem, SamplingParams)
from rollout_server.engines.base import Engine
from rollout_server.errors import ApiError

CHAT_DEFAULT_MAX_TOKENS = 512
COMPLETION_DEFAULT_MAX_TOKENS = 16


class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
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

    prompt: str | list[str] | list[int] | list[list[int]]


class ChatRequest(_OpenAIRequest):
    """``POST /v1/chat/completions`` (OpenAI schema subset)."""

    messages: list[dict[str, Any]] = Field(min_length=1)


def _usage(outputs: list[Any]) -> dict[str, int]:
    p = sum(len(o.prompt_token_ids) for o in outputs)
    c = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _chat_message(i: int, m: dict[str, Any]) -> ChatMessage:
    role = m.get("role")
    role = {"developer": "system"}.get(role, role) if isinstance(role, str) else role
    if role not in ("system", "user", "assistant"):
        raise ApiError(400, "bad_request", f"role {m.get('role')!r} is not supported (system, user, assistant)",
                       field=f"messages.{i}.role")
    content = m.get("content")
    if isinstance(content, str):
        return ChatMessage(role=role, content=content)
    if not isinstance(content, list):
        raise ApiError(400, "bad_request", "content must be a string or a list of parts", field=f"messages.{i}.content")
    parts = []
    for j, p in enumerate(content):
        where = f"messages.{i}.content.{j}"
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text":
            parts.append(ChatPart(type="text", text=str(p.get("text", ""))))
        elif kind == "image_url":
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith("data:image/"):
                raise ApiError(400, "bad_request", "images must be data URIs (data:image/<fmt>;base64,...); "
                               "this server does not download URLs", field=f"{where}.image_url")
            parts.append(ChatPart(type="image", image=url))
        else:
            raise ApiError(400, "bad_request", f"content part type {kind!r} is not supported (text, image_url)",
                           field=f"{where}.type")
    return ChatMessage(role=role, content=parts)


def openai_router(engine: Engine, generate: Callable[..., Any], require_ready: Callable[[], None]) -> APIRouter:
    """The /v1 routes over ``engine``; ``generate(request, items, sampling, min_ver, field)`` is /infer's path
    (readiness, budgets, the fence, cancellation when the client disconnects)."""
    router = APIRouter(prefix="/v1")

    def model_id() -> str:
        return engine.model_path

    @router.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_id(), "object": "model", "created": 0, "owned_by": "tandem",
                                            "root": model_id()}]}

    async def complete(request: Request, items: list[InferItem], sampling: SamplingParams,
                       field: str) -> tuple[int, list[Any]]:
        ticket, outputs = await generate(request, items, sampling, None, field)
        return ticket.ver, outputs

    def wrap(make: Callable[[], Any]) -> Any:
        try:
            return make()
        except ValidationError as exc:  # our protocol models rejected the translated request
            problems = [(".".join(map(str, e["loc"])), e["msg"]) for e in exc.errors()]
            raise ApiError(422, "bad_request", str(exc).splitlines()[0] + ": " + "; ".join(
                f"{loc}: {msg}" for loc, msg in problems), field=problems[0][0] if problems else None) from None

    # The /v1 handlers answer JSONResponse: one json.dumps, where a returned dict is validated against its
    # annotation first (and, before FastAPI 0.130, converted to JSON-able objects before the dumps).
    @router.post("/completions")
    async def completions(req: CompletionRequest, request: Request) -> JSONResponse:
        sampling = wrap(lambda: req.sampling(COMPLETION_DEFAULT_MAX_TOKENS))
        prompts = req.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not prompts:
            raise ApiError(400, "bad_request", "prompt is empty", field="prompt")
        require_ready()  # text prompts are tokenized here, by the engine's tokenizer
        items = wrap(lambda: [InferItem(prompt_token_ids=p if isinstance(p, list) else engine.encode_text(p))
                              for p in prompts])
        ver, outputs = await complete(request, items, sampling, "prompt")
        return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex[:16]}", "object": "text_completion",
                             "created": int(time.time()), "model": model_id(), "system_fingerprint": f"ver-{ver}",
                             "choices": [{"index": i, "text": o.text, "finish_reason": o.finish_reason,
                                          "logprobs": None} for i, o in enumerate(outputs)],
                             "usage": _usage(outputs)})

    @router.post("/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> JSONResponse:
        sampling = wrap(lambda: req.sampling(CHAT_DEFAULT_MAX_TOKENS))
        messages = wrap(lambda: [_chat_message(i, m) for i, m in enumerate(req.messages)])
        item = wrap(lambda: InferItem(messages=messages))
        ver, outputs = await complete(request, [item], sampling, "messages")
        o = outputs[0]
        return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion",
                             "created": int(time.time()), "model": model_id(), "system_fingerprint": f"ver-{ver}",
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": o.text},
                                          "finish_reason": o.finish_reason, "logprobs": None}],
                             "usage": _usage(outputs)})

    return router


__all__ = ["openai_router", "CompletionRequest", "ChatRequest"]
