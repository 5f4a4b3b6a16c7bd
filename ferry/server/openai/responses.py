"""``POST /v1/responses``: OpenAI's Responses API on the same generation core, tools and reasoning;
responses are stored (``store``, true by default, bounded: ``response_store.py``) so that
``previous_response_id`` continues a conversation, and ``GET|DELETE /v1/responses/{id}`` read them;
``text.format`` constrains the output as chat's ``response_format`` does."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from ferry.engine.async_engine import EngineDead
from ferry.multimodal.images import ImageError
from ferry.multimodal.parts import message_content
from ferry.server.context import ServerContext, context, model_context
from ferry.server.errors import APIError
from ferry.server.generation import StreamFailed, Usage, collect, deltas, sse, usage_of
from ferry.server.json_body import BoundedJSONRoute
from ferry.server.openai.chat import ChoiceText, chat_prompt, tool_overrides, tool_parser
from ferry.server.protocol import ChatCompletionRequest, Number, TextRequest

router = APIRouter(route_class=BoundedJSONRoute)


class ResponsesRequest(TextRequest):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None  # {"format": ...}: the output's form (structured output)


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (a text is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


_TEXT_PARTS = ("text", "input_text", "output_text")
_IMAGE_PARTS = ("input_image", "image_url")


def _text(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A message item's content as text: a string, or a list of text parts (a 400 naming ``param``
    for anything else, which ``message_content`` would take for parts and fail on). Content
    with images stays a list of its text and image parts, as sent (chat's ``message_content``
    checks and loads them when the prompt is made)."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise APIError(400, f"{param}[{j}] must be a content part (an object with a type), got {part!r:.60}",
                               param=param)
            if part.get("type") in _TEXT_PARTS and not isinstance(part.get("text"), str):
                raise APIError(400, f"{param}[{j}].text must be a string, got {part.get('text')!r:.60}", param=param)
    elif content is not None and not isinstance(content, str):
        raise APIError(400, f"{param} must be a string or a list of content parts, got {content!r:.60}",
                       param=param)
    if isinstance(content, list) and any(part.get("type") in _IMAGE_PARTS for part in content):
        return [{"type": "input_text", "text": p["text"]} if p.get("type") in _TEXT_PARTS else p for p in content]
    try:
        return message_content(content, param, None)  # text parts only here: their text
    except ImageError as e:
        raise APIError(400, e.message, param=e.field) from None


def _string(item: dict[str, Any], key: str, where: str) -> str | None:
    """``item[key]``, which must be a string when given (a 400 naming it otherwise)."""
    value = item.get(key)
    if value is not None and not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string, got {value!r:.60}", param=f"{where}.{key}")
    return value


def rendered_items(items: list[dict[str, Any]], where: str = "input") -> list[dict[str, Any]]:
    """Input (or output) items checked and cut to what the chat template renders: a message's text,
    a call's id, name and arguments, a call output's text; reasoning and every other field dropped.
    What a stored response keeps for ``previous_response_id``, so nothing unrendered is held."""
    kept: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind, at = item.get("type", "message"), f"{where}[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{at}.role must be user, assistant, system or developer, got {role!r:.60}",
                               param=f"{at}.role")
            kept.append({"type": "message", "role": role, "content": _text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            args = item.get("arguments", "{}")
            if not isinstance(args, (str, dict)):  # JSON text, or the object (as chat takes it)
                raise APIError(400, f"{at}.arguments must be a JSON string or an object, got {args!r:.60}",
                               param=f"{at}.arguments")
            kept.append({"type": "function_call", "call_id": _string(item, "call_id", at),
                         "name": _string(item, "name", at), "arguments": args})
        elif kind == "function_call_output":
            out = item.get("output")
            kept.append({"type": "function_call_output", "call_id": _string(item, "call_id", at),
                         "output": out if isinstance(out, str) else json.dumps(out)})
        elif kind != "reasoning":  # earlier reasoning is not shown to the model again
            raise APIError(400, f"{at}.type: input item type {kind!r:.60} is not supported", param=f"{at}.type")
    return kept


def conversation(instructions: str | None, items: list[dict[str, Any]], first_new: int = 0) -> list[dict[str, Any]]:
    """Rendered items (``rendered_items``: messages, function calls and their outputs) as chat messages;
    ``items[first_new:]`` are the request's input (a bad image there is named by its input field,
    one in the items before by previous_response_id)."""
    conv: list[dict[str, Any]] = []
    if instructions:  # a previous response's instructions are not carried over (OpenAI's rule)
        conv.append({"role": "system", "content": instructions})
    for k, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            content = item["content"]
            if isinstance(content, list):  # with images
                at = f"input[{k - first_new}].content" if k >= first_new else "previous_response_id"
                try:
                    content = message_content(content, at, item["role"])
                except ImageError as e:
                    raise APIError(400, e.message, param=e.field) from None
            conv.append({"role": "system" if item["role"] == "developer" else item["role"], "content": content})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if conv and conv[-1]["role"] == "assistant" and "tool_calls" in conv[-1]:
                conv[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                conv.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            conv.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return conv


def text_format(body: ResponsesRequest) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``text.format`` checked (a 400 naming it): the format as the response reports it, and the
    same as chat's ``response_format`` (which ``_Sampling.structured`` turns into the constraint)."""
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return {"type": "text"}, None
    if not isinstance(fmt, dict):
        raise APIError(400, f"text.format must be an object with a type, got {fmt!r:.60}", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return {"type": "text"}, None
    if kind == "json_object":
        return {"type": "json_object"}, {"type": "json_object"}
    if kind != "json_schema":
        raise APIError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r:.60}",
                       param="text.format")
    if not isinstance(fmt.get("schema"), dict):
        raise APIError(400, f"text.format.schema: a json_schema format needs a JSON schema object, got "
                       f"{fmt.get('schema')!r:.60}", param="text.format")
    for key, want, what in (("name", str, "a string"), ("description", str, "a string"), ("strict", bool, "a boolean")):
        if fmt.get(key) is not None and not isinstance(fmt[key], want):
            raise APIError(400, f"text.format.{key} must be {what}, got {fmt[key]!r:.60}", param="text.format")
    shown = {"type": "json_schema", **{k: fmt[k] for k in ("name", "schema", "description", "strict")
                                       if fmt.get(k) is not None}}
    return shown, {"type": "json_schema", "json_schema": {k: v for k, v in shown.items() if k != "type"}}


def _tools(body: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """Responses' flat function tools and tool_choice in chat's nested shape."""
    tools = None
    if body.tools is not None:
        tools = []
        for i, t in enumerate(body.tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else t
                raise APIError(400, f"tools[{i}].type: only function tools are served, not {kind!r}",
                               param=f"tools[{i}].type")
            tools.append({"type": "function", "function": {k: t.get(k) for k in ("name", "description", "parameters")
                                                           if t.get(k) is not None}})
    tc = body.tool_choice
    if isinstance(tc, dict) and tc.get("type") == "function" and "function" not in tc:
        tc = {"type": "function", "function": {"name": tc.get("name")}}
    return tools, tc


class _Items:
    """The response's output items, built as the text comes (for streaming and the final body alike)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None

    def new(self, item: dict[str, Any]) -> dict[str, Any]:
        self.items.append(item)
        self.open = item
        return item


def _message() -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress", "role": "assistant",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}


def _reasoning() -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}


def _call(c: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": c["id"],
            "name": c["function"]["name"], "arguments": "", "status": "in_progress"}


def _body(ctx: ServerContext, body: ResponsesRequest, rid: str, created: int, status: str,
          items: list[dict[str, Any]], usage: Usage | None, incomplete: str | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": ctx.model_name,
            "output": items, "instructions": body.instructions, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "store": body.store is not False,
            "metadata": body.metadata or {}, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "text": {"format": text_format(body)[0]}, "truncation": "disabled",
            "usage": None if usage is None else {
                "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}}}


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, raw: Request):
    ctx = await model_context(raw, body.model)
    before: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = ctx.responses.get(body.previous_response_id)
        if stored is None:
            raise APIError(404, f"previous_response_id: no stored response {body.previous_response_id!r} "
                           f"(never stored, deleted, or dropped from the bounded store)",
                           param="previous_response_id", code="not_found")
        before = stored.items
    items = before + rendered_items(input_items(body))
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise APIError(400, f"max_output_tokens must be an integer >= 1, got {body.max_output_tokens}",
                       param="max_output_tokens")
    response_format = text_format(body)[1]
    tools, choice = _tools(body)
    spec, prompt, images = await chat_prompt(ctx, conversation(body.instructions, items, len(before)), tools, choice,
                                             body.parallel_tool_calls, None, raw=raw)
    try:  # text.format goes through chat's response_format, so both constrain the output alike
        sampling = ChatCompletionRequest(messages=[{"role": "user", "content": ""}], temperature=body.temperature,
                                         top_p=body.top_p, response_format=response_format)
        own_format = sampling.structured() is not None
    except ValueError as e:  # pydantic's refusal (a lone surrogate in the schema) or structured()'s
        msg = e.errors()[0]["msg"] if isinstance(e, ValidationError) else str(e)
        raise APIError(400, "text.format: " + msg.replace("response_format.json_schema.", "text.format."),
                       param="text.format") from None
    if spec is not None and spec.constrained and own_format:
        raise APIError(400, "tool_choice 'required' or a named function already constrains the output; "
                       "send no text.format with it", param="tool_choice")
    parser = tool_parser(ctx)
    sp = ctx.params(sampling, body.max_output_tokens, None, None, **tool_overrides(spec, parser, own_format))
    try:
        stream = await ctx.submit(ctx.sub_requests([prompt], sp, 1, 0, images),
                                  tag_fallback=spec is not None and spec.choice == "auto" and not own_format)
    except APIError as e:  # a schema the grammar engine refused is the format's fault
        if own_format and (e.param or "").startswith("structured_outputs"):
            raise APIError(400, f"text.format: {e.message}", param="text.format") from None
        raise
    rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return StreamingResponse(_events(ctx, body, stream, spec, parser, rid, created, items, prompt),
                                 media_type="text/event-stream")
    out = (await collect(stream, raw))[0]
    comp = out.outputs[0]
    outputs: list[dict[str, Any]] = []
    for kind, value in ChoiceText(ctx, spec, parser, prompt).whole_pieces(comp.text):  # as the stream orders them
        if kind == "call":
            outputs.append({**_call(value.openai()), "arguments": value.arguments, "status": "completed"})
            continue
        item = _reasoning() if kind == "reasoning" else _message()
        item["content"][0]["text"], item["status"] = value, "completed"
        outputs.append(item)
    if not any(o["type"] in ("message", "function_call") for o in outputs):  # an answer is at least a message
        m = _message()
        m["status"] = "completed"
        outputs.append(m)
    incomplete = "max_output_tokens" if comp.finish_reason == "length" else None
    final = _body(ctx, body, rid, created, "incomplete" if incomplete else "completed", outputs,
                  usage_of([out], 1), incomplete)
    _store(ctx, body, final, items)
    return final


def _store(ctx: ServerContext, body: ResponsesRequest, final: dict[str, Any], items: list[dict[str, Any]]) -> None:
    if body.store is not False:
        ctx.responses.put(final["id"], final, items + rendered_items(final["output"], "output"))


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, raw: Request) -> dict[str, Any]:
    stored = context(raw).responses.get(response_id)
    if stored is None:
        raise APIError(404, f"no stored response {response_id!r}", param="response_id", code="not_found")
    return stored.body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw: Request) -> dict[str, Any]:
    if not context(raw).responses.delete(response_id):
        raise APIError(404, f"no stored response {response_id!r}", param="response_id", code="not_found")
    return {"id": response_id, "object": "response", "deleted": True}


async def _events(ctx: ServerContext, body: ResponsesRequest, stream: Any, spec: Any, parser: Any,
                  rid: str, created: int, items: list[dict[str, Any]],
                  prompt: list[int] | None = None) -> AsyncIterator[str]:
    """The Responses event sequence: response.created, per item output_item.added, its content or
    argument deltas and their .done events, output_item.done, then response.completed (or .incomplete)."""
    seq = 0
    out = _Items()
    text = ChoiceText(ctx, spec, parser, prompt)
    usage = Usage(1)

    def ev(kind: str, **data: Any) -> str:
        nonlocal seq
        seq += 1
        return sse({"type": kind, "sequence_number": seq - 1, **data}, kind)

    def close() -> list[str]:
        item, events = out.open, []
        if item is None:
            return events
        i = len(out.items) - 1
        if item["type"] == "message":
            part = item["content"][0]
            events += [ev("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                          text=part["text"], logprobs=[]),
                       ev("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                          part=part)]
        elif item["type"] == "reasoning":
            events.append(ev("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                             text=item["content"][0]["text"]))
        else:
            events.append(ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                             arguments=item["arguments"], name=item["name"]))
        item["status"] = "completed"
        events.append(ev("response.output_item.done", output_index=i, item=item))
        out.open = None
        return events

    def open_(item: dict[str, Any]) -> list[str]:
        events = close()
        out.new(item)
        i = len(out.items) - 1
        events.append(ev("response.output_item.added", output_index=i,
                         item={**item, "content": [dict(p) for p in item.get("content", [])]}))
        if item["type"] == "message":
            events.append(ev("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                             part=dict(item["content"][0])))
        return events

    def text_events(kind: str, delta: str) -> list[str]:
        """A piece of reasoning or content: added to the open item of its kind, or to a new one."""
        reasoning = kind == "reasoning"
        events = []
        if out.open is None or out.open["type"] != ("reasoning" if reasoning else "message"):
            events += open_(_reasoning() if reasoning else _message())
        out.open["content"][0]["text"] += delta
        i = len(out.items) - 1
        if reasoning:
            events.append(ev("response.reasoning_text.delta", item_id=out.open["id"], output_index=i,
                             content_index=0, delta=delta))
        else:
            events.append(ev("response.output_text.delta", item_id=out.open["id"], output_index=i,
                             content_index=0, delta=delta, logprobs=[]))
        return events

    def call_events(calls: list[dict[str, Any]]) -> list[str]:
        events = []
        for c in calls:
            if "id" in c:
                events += open_(_call(c))
            args = c["function"].get("arguments")
            if args:
                out.open["arguments"] += args
                events.append(ev("response.function_call_arguments.delta", item_id=out.open["id"],
                                 output_index=len(out.items) - 1, delta=args))
        return events

    try:
        yield ev("response.created", response=_body(ctx, body, rid, created, "in_progress", [], None))
        yield ev("response.in_progress", response=_body(ctx, body, rid, created, "in_progress", [], None))
        async for d in deltas(stream, 1, usage):
            for kind, value in text.feed_pieces(d.text, d.finished):  # in the order written
                for e in call_events([value]) if kind == "call" else text_events(kind, value):
                    yield e
            if d.finished:
                if not out.items:  # an empty answer is still a message
                    for e in open_(_message()):
                        yield e
                for e in close():
                    yield e
                incomplete = "max_output_tokens" if d.completion.finish_reason == "length" else None
                kind = "response.incomplete" if incomplete else "response.completed"
                final = _body(ctx, body, rid, created, "incomplete" if incomplete else "completed",
                              out.items, usage, incomplete)
                _store(ctx, body, final, items)
                yield ev(kind, response=final)
    except StreamFailed as f:
        yield ev("error", code=f.error.code or f.error.type, message=f.error.message, param=None)
    except EngineDead as e:
        yield ev("error", code="server_error", message=str(e), param=None)
    finally:
        await stream.close()
