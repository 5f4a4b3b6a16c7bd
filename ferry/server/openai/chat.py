"""``POST /v1/chat/completions``: OpenAI's chat completions, with tools and reasoning."""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ferry.engine.outputs import RequestOutput
from ferry.server.context import ServerContext, context
from ferry.server.errors import APIError, bad_value
from ferry.server.generation import Usage, collect, deltas, include_usage, openai_sse, usage_of
from ferry.server.logprobs import chat_logprobs, prompt_logprobs_json
from ferry.server.protocol import ChatCompletionRequest
from ferry.server.reasoning import REASONING_PARSERS, ReasoningStream
from ferry.server.tools.calls import ToolCall
from ferry.server.tools.output import ToolOutput, finish_reason
from ferry.server.tools.parsers import PARSERS, ToolParser, parser_for_template
from ferry.server.tools.render import with_tools
from ferry.server.tools.spec import ToolSpec, call_tags, tool_spec

router = APIRouter()


def text_content(content: str | list[dict] | None, param: str = "messages") -> str:
    """A message's text: a string, or a list of text parts (other part types are a 400)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") not in ("text", "input_text", "output_text"):
            raise APIError(400, f"{param}: content of type {part.get('type')!r} is not supported (text only)",
                           param=param)
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def conversation_of(messages: list[Any]) -> list[dict[str, Any]]:
    """The conversation the chat template renders, from request messages (models or dicts)."""
    conv = []
    for i, m in enumerate(messages):
        m = m if isinstance(m, dict) else m.model_dump(exclude_none=True)
        m = {**m, "content": text_content(m.get("content"), f"messages[{i}].content")}
        if m.get("reasoning") is not None and m.get("reasoning_content") is None:
            m["reasoning_content"] = m.pop("reasoning")  # the name templates read
        conv.append(m)
    return conv


def tool_parser(ctx: ServerContext) -> ToolParser:
    """--tool-call-parser, or the format the chat template speaks."""
    if ctx.tool_call_parser:
        return PARSERS[ctx.tool_call_parser]
    return parser_for_template(ctx.tokenizer.chat_template if ctx.tokenizer is not None else "")


class ChoiceText:
    """One choice's text split into reasoning, content and tool calls, whole or as it streams."""

    def __init__(self, ctx: ServerContext, spec: ToolSpec | None, parser: ToolParser) -> None:
        rp = REASONING_PARSERS.get(ctx.reasoning_parser or "")
        constrained = spec is not None and spec.constrained  # the grammar starts the output with the call
        self.reasoning = ReasoningStream(rp) if rp is not None and not constrained else None
        self.tools = ToolOutput(spec, parser) if spec is not None and spec.choice != "none" else None

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning delta, content delta, tool_call deltas)."""
        reasoning, content = self.reasoning.feed(text, finished) if self.reasoning else ("", text)
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, finished)
        return reasoning, content, calls

    def whole(self, text: str) -> tuple[str | None, str, list[ToolCall]]:
        reasoning, content = self.reasoning.whole(text) if self.reasoning else (None, text)
        if self.tools is None:
            return reasoning, content, []
        content, calls = self.tools.whole(content)
        return reasoning, content, calls


async def chat_prompt(ctx: ServerContext, messages: list[Any], tools: list[dict[str, Any]] | None,
                      tool_choice: Any, parallel: bool | None, template_kwargs: dict[str, Any] | None,
                      add_generation_prompt: bool = True) -> tuple[ToolSpec | None, list[int]]:
    """The checked tools and the prompt's token ids: the conversation (with earlier calls and
    results) and the tools through the chat template, or the generic tool prompt (``render.py``)."""
    spec = tool_spec(tools, tool_choice, parallel)
    conv, template_tools = with_tools(conversation_of(messages), spec, ctx.need_tokenizer().chat_template)
    prompt = await ctx.render_chat(conv, tools=template_tools, add_generation_prompt=add_generation_prompt,
                                   **(template_kwargs or {}))
    return spec, prompt


def tool_overrides(spec: ToolSpec | None, parser: ToolParser, constrained: bool = False) -> dict[str, Any]:
    """The sampling settings a request's tools ask for (every route that takes tools): the grammar of
    a required or named call; under `auto`, the structural tag that constrains a call once the
    model opens one (unless the request ``constrained`` its output itself), and the special
    tokens kept when the parser's call marker is one (Mistral's [TOOL_CALLS], Llama 3's <|python_tag|>)."""
    if spec is None:
        return {}
    if spec.constrained:
        return {"structured_outputs": spec.grammar()}
    if spec.choice != "auto":
        return {}
    out: dict[str, Any] = {"skip_special_tokens": False} if parser.special_markers else {}
    if parser.call_frame is not None and not constrained:
        out["structured_outputs"] = call_tags(spec, parser.call_frame)
    return out


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, raw: Request):
    ctx = context(raw)
    ctx.check_request(body)
    tokenizer = ctx.need_tokenizer()
    spec, prompt = await chat_prompt(ctx, body.messages, body.tools, body.tool_choice, body.parallel_tool_calls,
                                     body.chat_template_kwargs)
    parser = tool_parser(ctx)
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    # OpenAI's newer name wins when both are sent.
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(body, field)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"{field} must be an integer >= 1, got {max_tokens}", param=field)
    try:
        own_format = body.structured() is not None
    except ValueError as e:
        raise bad_value(e) from None
    if spec is not None and spec.constrained and own_format:
        raise APIError(400, "tool_choice 'required' or a named function already constrains the output; "
                       "send no response_format or structured_outputs with it", param="tool_choice")
    sp = ctx.params(body, max_tokens, (top or 0) if body.logprobs else None, body.prompt_logprobs,
                    **tool_overrides(spec, parser, own_format))
    stream = await ctx.submit(ctx.sub_requests([prompt], sp, body.n, body.priority),
                              tag_fallback=spec is not None and spec.choice == "auto" and not own_format)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name}
    show_reasoning = body.include_reasoning

    def lp(out: RequestOutput, start: int) -> dict[str, Any] | None:
        return chat_logprobs(out.outputs[0], tokenizer, start, top or 0) if body.logprobs else None

    if body.stream:
        chunk_base = {**base, "object": "chat.completion.chunk"}

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            texts = [ChoiceText(ctx, spec, parser) for _ in range(body.n)]
            for i in range(body.n):
                yield {**chunk_base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}
            usage = Usage(body.n)
            async for d in deltas(stream, body.n, usage):
                ct = texts[d.index]
                reasoning, content, calls = ct.feed(d.text, d.finished)
                delta: dict[str, Any] = {}
                if reasoning and show_reasoning:
                    delta.update(reasoning_content=reasoning, reasoning=reasoning)
                if content:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = calls
                made = ct.tools.calls if ct.tools is not None else []
                finish = finish_reason(d.finish_reason, made)
                if calls and finish:  # as OpenAI does: the finish in a chunk of its own, after the calls
                    yield {**chunk_base, "choices": [{"index": d.index, "delta": delta,
                                                      "logprobs": lp(d.out, d.token_start), "finish_reason": None}]}
                    yield {**chunk_base, "choices": [{"index": d.index, "delta": {}, "logprobs": None,
                                                      "finish_reason": finish}]}
                elif delta or finish or body.logprobs:
                    yield {**chunk_base, "choices": [{"index": d.index, "delta": delta,
                                                      "logprobs": lp(d.out, d.token_start),
                                                      "finish_reason": finish}]}
            if include_usage(body):
                yield {**chunk_base, "choices": [], "usage": usage.dict()}

        return StreamingResponse(openai_sse(stream, chunks()), media_type="text/event-stream")

    finals = await collect(stream, raw)

    def message_choice(i: int, out: RequestOutput) -> dict[str, Any]:
        comp = out.outputs[0]
        reasoning, content, calls = ChoiceText(ctx, spec, parser).whole(comp.text)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning is not None and show_reasoning:
            message.update(reasoning_content=reasoning, reasoning=reasoning)
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return {"index": i, "message": message, "logprobs": lp(out, 0),
                "finish_reason": finish_reason(comp.finish_reason, calls)}

    response = {**base, "choices": [message_choice(i, out) for i, out in enumerate(finals)],
                "usage": usage_of(finals, body.n).dict()}
    if body.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(finals[0].prompt_token_ids,
                                                           finals[0].prompt_logprobs, tokenizer)
    return response
