"""``POST /v1/responses``: OpenAI's Responses API on the same generation core, tools and reasoning;
responses are stored (``store``, true by default, bounded: ``response_store.py``) so that
``previous_response_id`` continues a conversation, and ``GET|DELETE /v1/responses/{id}`` read them."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from ferry.engine.async_engine import EngineDead
from ferry.server.context import ServerContext, context
from ferry.server.errors import APIError
from ferry.server.generation import StreamFailed, Usage, collect, deltas, sse, usage_of
from ferry.server.openai.chat import ChoiceText, chat_prompt, text_content, tool_overrides, tool_parser
from ferry.server.protocol import ChatCompletionRequest, Number

router = APIRouter()


class ResponsesRequest(BaseModel):
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


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (a text is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


def conversation(instructions: str | None, items: list[dict[str, Any]], first: int = 0) -> list[dict[str, Any]]:
    """Input items (messages, function calls and their outputs) as chat messages; items from
    ``first`` on are the request's own (the ones before, a stored conversation's)."""
    conv: list[dict[str, Any]] = []
    if instructions:  # a previous response's instructions are not carried over (OpenAI's rule)
        conv.append({"role": "system", "content": instructions})
    for n, item in enumerate(items):
        i = n - first
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer, got {role!r}",
                               param=f"{where}.role")
            conv.append({"role": "system" if role == "developer" else role,
                         "content": text_content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if conv and conv[-1]["role"] == "assistant" and "tool_calls" in conv[-1]:
                conv[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                conv.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            conv.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": out if isinstance(out, str) else json.dumps(out)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again
        else:
            raise APIError(400, f"{where}.type: input item type {kind!r} is not supported", param=f"{where}.type")
    return conv


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
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": None if usage is None else {
                "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}}}


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, raw: Request):
    ctx = context(raw)
    ctx.check_model(body.model)
    before: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = ctx.responses.get(body.previous_response_id)
        if stored is None:
            raise APIError(404, f"previous_response_id: no stored response {body.previous_response_id!r} "
                           f"(never stored, deleted, or dropped from the bounded store)",
                           param="previous_response_id", code="not_found")
        before = stored.items
    items = before + input_items(body)
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise APIError(400, f"max_output_tokens must be an integer >= 1, got {body.max_output_tokens}",
                       param="max_output_tokens")
    tools, choice = _tools(body)
    spec, prompt = await chat_prompt(ctx, conversation(body.instructions, items, len(before)), tools, choice,
                                     body.parallel_tool_calls, None)
    sampling = ChatCompletionRequest(messages=[{"role": "user", "content": ""}], temperature=body.temperature,
                                     top_p=body.top_p)
    parser = tool_parser(ctx)
    sp = ctx.params(sampling, body.max_output_tokens, None, None, **tool_overrides(spec, parser))
    stream = await ctx.submit(ctx.sub_requests([prompt], sp, 1, 0), tag_fallback=spec is not None and spec.choice == "auto")
    rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return StreamingResponse(_events(ctx, body, stream, spec, parser, rid, created, items),
                                 media_type="text/event-stream")
    out = (await collect(stream, raw))[0]
    comp = out.outputs[0]
    reasoning, text, calls = ChoiceText(ctx, spec, parser).whole(comp.text)
    outputs: list[dict[str, Any]] = []
    if reasoning:
        r = _reasoning()
        r["content"][0]["text"], r["status"] = reasoning, "completed"
        outputs.append(r)
    if text or not calls:
        m = _message()
        m["content"][0]["text"], m["status"] = text, "completed"
        outputs.append(m)
    for c in calls:
        outputs.append({**_call(c.openai()), "arguments": c.arguments, "status": "completed"})
    incomplete = "max_output_tokens" if comp.finish_reason == "length" else None
    final = _body(ctx, body, rid, created, "incomplete" if incomplete else "completed", outputs,
                  usage_of([out], 1), incomplete)
    _store(ctx, body, final, items)
    return final


def _store(ctx: ServerContext, body: ResponsesRequest, final: dict[str, Any], items: list[dict[str, Any]]) -> None:
    if body.store is not False:
        ctx.responses.put(final["id"], final, items + final["output"])


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
                  rid: str, created: int, items: list[dict[str, Any]]) -> AsyncIterator[str]:
    """The Responses event sequence: response.created, per item output_item.added, its content or
    argument deltas and their .done events, output_item.done, then response.completed (or .incomplete)."""
    seq = 0
    out = _Items()
    text = ChoiceText(ctx, spec, parser)
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

    try:
        yield ev("response.created", response=_body(ctx, body, rid, created, "in_progress", [], None))
        yield ev("response.in_progress", response=_body(ctx, body, rid, created, "in_progress", [], None))
        async for d in deltas(stream, 1, usage):
            reasoning, content, calls = text.feed(d.text, d.finished)
            if reasoning:
                if out.open is None or out.open["type"] != "reasoning":
                    for e in open_(_reasoning()):
                        yield e
                out.open["content"][0]["text"] += reasoning
                yield ev("response.reasoning_text.delta", item_id=out.open["id"], output_index=len(out.items) - 1,
                         content_index=0, delta=reasoning)
            if content:
                if out.open is None or out.open["type"] != "message":
                    for e in open_(_message()):
                        yield e
                out.open["content"][0]["text"] += content
                yield ev("response.output_text.delta", item_id=out.open["id"], output_index=len(out.items) - 1,
                         content_index=0, delta=content, logprobs=[])
            for c in calls:
                if "id" in c:
                    for e in open_(_call(c)):
                        yield e
                args = c["function"].get("arguments")
                if args:
                    out.open["arguments"] += args
                    yield ev("response.function_call_arguments.delta", item_id=out.open["id"],
                             output_index=len(out.items) - 1, delta=args)
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
