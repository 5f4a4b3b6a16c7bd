"""``POST /v1/chat/completions``: OpenAI's chat completions."""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ferry.engine.outputs import RequestOutput
from ferry.server.context import context
from ferry.server.errors import APIError
from ferry.server.generation import Usage, collect, deltas, include_usage, openai_sse, usage_of
from ferry.server.logprobs import chat_logprobs, prompt_logprobs_json
from ferry.server.protocol import ChatCompletionRequest

router = APIRouter()


def text_content(content: str | list[dict] | None, param: str = "messages") -> str:
    """A message's text: a string, or a list of text parts (other part types are a 400)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(400, f"message content of type {part.get('type')!r} is not supported (text only)",
                           param=param)
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def conversation_of(messages: list[Any]) -> list[dict[str, Any]]:
    """The conversation the chat template renders, from request messages (models or dicts)."""
    conv = []
    for i, m in enumerate(messages):
        m = m if isinstance(m, dict) else m.model_dump(exclude_none=True)
        conv.append({**m, "content": text_content(m.get("content"), f"messages[{i}].content")})
    return conv


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, raw: Request):
    ctx = context(raw)
    ctx.check_request(body)
    tokenizer = ctx.need_tokenizer()
    conv = conversation_of(body.messages)
    prompt = await ctx.render_chat(conv)
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    # OpenAI's newer name wins when both are sent.
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(body, field)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"{field} must be an integer >= 1, got {max_tokens}", param=field)
    sp = ctx.params(body, max_tokens, (top or 0) if body.logprobs else None, body.prompt_logprobs)
    stream = await ctx.submit(ctx.sub_requests([prompt], sp, body.n, body.priority))
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name}

    def lp(out: RequestOutput, start: int) -> dict[str, Any] | None:
        return chat_logprobs(out.outputs[0], tokenizer, start, top or 0) if body.logprobs else None

    if body.stream:
        chunk_base = {**base, "object": "chat.completion.chunk"}

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            for i in range(body.n):
                yield {**chunk_base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}
            usage = Usage(body.n)
            async for d in deltas(stream, body.n, sp.stop, usage):
                yield {**chunk_base, "choices": [{"index": d.index, "delta": {"content": d.text} if d.text else {},
                                                  "logprobs": lp(d.out, d.token_start),
                                                  "finish_reason": d.finish_reason}]}
            if include_usage(body):
                yield {**chunk_base, "choices": [], "usage": usage.dict()}

        return StreamingResponse(openai_sse(stream, chunks()), media_type="text/event-stream")

    finals = await collect(stream, raw)
    response = {**base, "choices": [
        {"index": i, "message": {"role": "assistant", "content": out.outputs[0].text},
         "logprobs": lp(out, 0), "finish_reason": out.outputs[0].finish_reason} for i, out in enumerate(finals)],
        "usage": usage_of(finals, body.n).dict()}
    if body.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(finals[0].prompt_token_ids,
                                                           finals[0].prompt_logprobs, tokenizer)
    return response
