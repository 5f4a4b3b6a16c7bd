"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API (what Claude
Code and the anthropic SDK speak), on the same generation core, tools and reasoning as chat."""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ferry.engine.async_engine import EngineDead
from ferry.multimodal.images import MEDIA_TYPES
from ferry.multimodal.parts import image_part
from ferry.server.anthropic.errors import anthropic_error_body
from ferry.server.context import ServerContext, model_context
from ferry.server.errors import APIError
from ferry.server.generation import StreamFailed, Usage, collect, deltas, sse, usage_of
from ferry.server.json_body import BoundedJSONRoute
from ferry.server.openai.chat import ChoiceText, chat_prompt, tool_overrides, tool_parser
from ferry.server.protocol import ChatCompletionRequest, Number, TextRequest
from ferry.server.tools.calls import ToolCall

router = APIRouter(route_class=BoundedJSONRoute)


class MessagesRequest(TextRequest):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: StrictStr | list[dict[str, Any]] | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(TextRequest):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


def _text(blocks: Any, where: str) -> str:
    """The text of a string or a list of text blocks; anything else is a 400 naming ``where``."""
    if isinstance(blocks, str):
        return blocks
    if blocks is not None and not isinstance(blocks, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks, got {type(blocks).__name__}",
                       param=where)
    out = []
    for j, b in enumerate(blocks or []):
        if not isinstance(b, dict) or b.get("type") != "text":
            raise APIError(400, f"{where}[{j}].type: {b.get('type') if isinstance(b, dict) else b!r} is not "
                           "supported here (text only)", param=f"{where}[{j}].type")
        out.append(_string(b.get("text", ""), f"{where}[{j}].text"))
    return "".join(out)


def _string(value: Any, where: str) -> str:
    """``value``, a string; anything else is a 400 naming ``where``."""
    if not isinstance(value, str):
        raise APIError(400, f"{where} must be a string, got {type(value).__name__}", param=where)
    return value


def _image_source(source: Any, where: str) -> tuple[str, str]:
    """An image block's source as a URL for ``load_image``, and its field: ``{"type": "base64",
    "media_type", "data"}`` a data: URL, ``{"type": "url", "url"}`` its URL; a 400 naming the field at fault."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media = source.get("media_type")
        if media not in MEDIA_TYPES:
            raise APIError(400, f"{where}.media_type must be one of {', '.join(MEDIA_TYPES)}, got {media!r:.60}",
                           param=f"{where}.media_type")
        return f"data:{media};base64,{_string(source.get('data'), f'{where}.data')}", f"{where}.data"
    if kind == "url":
        return _string(source.get("url"), f"{where}.url"), f"{where}.url"
    raise APIError(400, f"{where}.type: an image source must be of type base64 or url, got {kind!r:.60}",
                   param=f"{where}.type")


def conversation(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic's system and content blocks as the chat messages the template renders."""
    conv: list[dict[str, Any]] = []
    if body.system:
        conv.append({"role": "system", "content": _text(body.system, "system")})
    for i, m in enumerate(body.messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise APIError(400, f"messages[{i}].role must be 'user' or 'assistant', got {role!r}",
                           param=f"messages[{i}].role")
        if isinstance(content, str):
            conv.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, f"messages[{i}].content must be a string or a list of blocks",
                           param=f"messages[{i}].content")
        texts, calls, thinking = [], [], []
        parts: list[dict[str, Any]] = []  # text and images in order, when the message holds images
        for j, b in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                texts.append(_string(b.get("text", ""), f"{where}.text"))
                parts.append({"type": "text", "text": texts[-1]})
            elif kind == "image" and role == "user":
                parts.append(image_part(*_image_source(b.get("source"), f"{where}.source")))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": b.get("id"), "type": "function", "function": {
                    "name": b.get("name"), "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                result = _text(b.get("content"), f"{where}.content")
                conv.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                             "content": ("Error: " if b.get("is_error") else "") + result})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                thinking.append(_string(b.get("thinking", ""), f"{where}.thinking"))
            else:
                raise APIError(400, f"{where}.type: block type {kind!r} is not supported in a {role} message",
                               param=f"{where}.type")
        if len(parts) > len(texts):  # images: a user message of text and image parts
            conv.append({"role": role, "content": parts})
        elif texts or calls or thinking:
            msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            conv.append(msg)
    return conv


def _tools(body: MessagesRequest | CountTokensRequest) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
    """Anthropic's tools and tool_choice in OpenAI's shape (the checks name Anthropic's fields)."""
    tools = None
    if body.tools is not None:
        tools = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                                   "parameters": t.get("input_schema")}}
                 if isinstance(t, dict) else t for t in body.tools]
    tc = body.tool_choice
    if tc is None:
        return tools, None, None
    kind = tc.get("type")
    parallel = False if tc.get("disable_parallel_tool_use") else None
    if kind == "tool":
        return tools, {"type": "function", "function": {"name": tc.get("name")}}, parallel
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if choice is None:
        raise APIError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice")
    return tools, choice, parallel


async def _prompt(ctx: ServerContext, body: MessagesRequest | CountTokensRequest, raw: Request):
    tools, choice, parallel = _tools(body)
    conv = conversation(body)
    if not conv:
        raise APIError(400, "messages hold no content", param="messages")
    # A last assistant message (text only) is a prefill: the reply continues it, in no new turn.
    prefill = conv[-1]["role"] == "assistant" and bool(conv[-1]["content"]) and "tool_calls" not in conv[-1]
    return await chat_prompt(ctx, conv, tools, choice, parallel, None, continue_final=prefill, raw=raw)


def stop_reason(finish: str | None, stop: int | str | None, calls: list[ToolCall]) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished output."""
    if finish == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _tool_use(c: ToolCall) -> dict[str, Any]:
    try:
        args = json.loads(c.arguments)
    except json.JSONDecodeError:
        args = {}
    return {"type": "tool_use", "id": "toolu_" + c.id.removeprefix("call_"), "name": c.name, "input": args}


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, raw: Request) -> dict[str, Any]:
    ctx = await model_context(raw, body.model)
    _, prompt, _ = await _prompt(ctx, body, raw)
    return {"input_tokens": len(prompt)}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, raw: Request):
    ctx = await model_context(raw, body.model)
    if body.max_tokens < 1:
        raise APIError(400, f"max_tokens must be an integer >= 1, got {body.max_tokens}", param="max_tokens")
    spec, prompt, images = await _prompt(ctx, body, raw)
    sampling = ChatCompletionRequest(messages=[{"role": "user", "content": ""}], max_tokens=body.max_tokens,
                                     temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                     stop=body.stop_sequences)
    parser = tool_parser(ctx)
    sp = ctx.params(sampling, body.max_tokens, None, None, **tool_overrides(spec, parser))
    stream = await ctx.submit(ctx.sub_requests([prompt], sp, 1, 0, images),
                              tag_fallback=spec is not None and spec.choice == "auto")
    mid = f"msg_{uuid.uuid4().hex}"
    if body.stream:
        return StreamingResponse(_events(ctx, stream, spec, parser, mid, prompt), media_type="text/event-stream")
    out = (await collect(stream, raw))[0]
    comp = out.outputs[0]
    content: list[dict[str, Any]] = []
    calls: list[ToolCall] = []
    for kind, value in ChoiceText(ctx, spec, parser, prompt).whole_pieces(comp.text):  # as the stream orders them
        if kind == "call":
            calls.append(value)
            content.append(_tool_use(value))
        elif kind == "reasoning":
            content.append({"type": "thinking", "thinking": value, "signature": ""})
        else:
            content.append({"type": "text", "text": value})
    reason, seq = stop_reason(comp.finish_reason, comp.stop_reason, calls)
    usage = usage_of([out], 1)
    return {"id": mid, "type": "message", "role": "assistant", "model": ctx.model_name, "content": content,
            "stop_reason": reason, "stop_sequence": seq,
            "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                      "cache_read_input_tokens": usage.cached_tokens}}


async def _events(ctx: ServerContext, stream: Any, spec: Any, parser: Any, mid: str,
                  prompt: list[int] | None = None) -> AsyncIterator[str]:
    """Anthropic's event sequence: message_start, per block content_block_start / _delta / _stop,
    message_delta (stop_reason, usage), message_stop; an error event if the request fails."""
    text = ChoiceText(ctx, spec, parser, prompt)
    usage = Usage(1)
    index, open_kind = -1, None

    def start(kind: str, block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        events = [sse({"type": "content_block_stop", "index": index}, "content_block_stop")] if open_kind else []
        index, open_kind = index + 1, kind
        return events + [sse({"type": "content_block_start", "index": index, "content_block": block},
                             "content_block_start")]

    def delta(d: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": index, "delta": d}, "content_block_delta")

    def text_events(kind: str, piece: str) -> list[str]:
        """A piece of reasoning or content: a delta of the open block of its kind, or of a new one."""
        if kind == "reasoning":
            events = [] if open_kind == "thinking" else start("thinking", {"type": "thinking", "thinking": "",
                                                                           "signature": ""})
            return events + [delta({"type": "thinking_delta", "thinking": piece})]
        events = [] if open_kind == "text" else start("text", {"type": "text", "text": ""})
        return events + [delta({"type": "text_delta", "text": piece})]

    def call_events(calls: list[dict[str, Any]]) -> list[str]:
        events = []
        for c in calls:
            if "id" in c:  # a new call: a tool_use block of its own
                block = _tool_use(ToolCall(c["function"]["name"], "{}", c["id"]))
                events += start("tool_use", {**block, "input": {}})
            if c["function"].get("arguments"):
                events.append(delta({"type": "input_json_delta", "partial_json": c["function"]["arguments"]}))
        return events

    try:
        started = False
        async for d in deltas(stream, 1, usage):
            if not started:
                started = True
                yield sse({"type": "message_start", "message": {
                    "id": mid, "type": "message", "role": "assistant", "model": ctx.model_name, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": 0}}}, "message_start")
            for kind, value in text.feed_pieces(d.text, d.finished):  # in the order written
                for e in call_events([value]) if kind == "call" else text_events(kind, value):
                    yield e
            if d.finished:
                made = text.tools.calls if text.tools is not None else []
                reason, seq = stop_reason(d.completion.finish_reason, d.completion.stop_reason, made)
                if open_kind:
                    yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                           "usage": {"output_tokens": usage.completion_tokens}}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
    except StreamFailed as f:
        yield sse(anthropic_error_body(f.error), "error")
    except EngineDead as e:
        yield sse(anthropic_error_body(APIError(500, str(e), "server_error")), "error")
    finally:
        await stream.close()
