"""``POST /v1/chat/completions``: OpenAI's chat completions, with tools and reasoning."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ferry.core.multimodal import ImageFeature
from ferry.engine.outputs import RequestOutput
from ferry.multimodal.images import ImageError
from ferry.multimodal.parts import message_content, take_images
from ferry.server.context import RequestTemplate, ServerContext, model_context
from ferry.server.errors import APIError, bad_value
from ferry.server.generation import Usage, collect, deltas, include_usage, openai_sse, usage_of
from ferry.server.json_body import BoundedJSONRoute
from ferry.server.logprobs import chat_logprobs, prompt_logprobs_json
from ferry.server.protocol import ChatCompletionRequest
from ferry.server.harmony import HarmonyStream
from ferry.server.reasoning import REASONING_PARSERS, ReasoningStream, prompt_opens
from ferry.server.tools.calls import ToolCall
from ferry.server.tools.output import ToolOutput, finish_reason
from ferry.server.tools.parsers import PARSERS, ToolParser, parser_for_template
from ferry.server.tools.render import with_tools
from ferry.server.tools.spec import (ToolSpec, call_tags, check_schemas, check_tool_count, check_tool_limits,
                                     tool_spec)

router = APIRouter(route_class=BoundedJSONRoute)


def conversation_of(messages: list[Any]) -> list[dict[str, Any]]:
    """The conversation the chat template renders, from request messages (models or dicts): a
    message's content its text, or with images its text and image parts (``ferry.multimodal.parts``)."""
    conv = []
    for i, m in enumerate(messages):
        m = m if isinstance(m, dict) else m.model_dump(exclude_none=True)
        try:
            content = message_content(m.get("content"), f"messages[{i}].content", m.get("role"))
        except ImageError as e:
            raise APIError(400, e.message, param=e.field) from None
        m = {**m, "content": content}
        if m.get("reasoning") is not None and m.get("reasoning_content") is None:
            m["reasoning_content"] = m.pop("reasoning")  # the name templates read
        conv.append(m)
    return conv


def tool_parser(ctx: ServerContext) -> ToolParser:
    """--tool-call-parser, or the format the chat template speaks."""
    if ctx.tool_call_parser:
        return PARSERS[ctx.tool_call_parser]
    return parser_for_template(ctx.tokenizer.chat_template if ctx.tokenizer is not None else "")


# One piece of a choice's output, in the order written: ("reasoning", text), ("content", text) or
# ("call", OpenAI's tool_call delta as it streams; the ToolCall in ``ChoiceText.whole_pieces``).
Piece = tuple[str, Any]


class ChoiceText:
    """One choice's text split into reasoning, content and tool calls, whole or as it streams.
    ``prompt``: the request's token ids, whose end tells whether the template opened a think block
    (None: not known, ``ReasoningStream``'s lone ``</think>`` rule applies).
    Beside tool calls, content that is only whitespace is none (OpenAI's null, no empty text block).
    The pieces come in the order the model wrote them (``feed_pieces``), whole the same as streamed:
    a call written inside the reasoning comes between the reasoning before and after it."""

    def __init__(self, ctx: ServerContext, spec: ToolSpec | None, parser: ToolParser,
                 prompt: list[int] | None = None) -> None:
        rp = REASONING_PARSERS.get(ctx.reasoning_parser or "")
        constrained = spec is not None and spec.constrained  # the grammar starts the output with the call
        opened = None
        if rp is not None and prompt and ctx.tokenizer is not None:
            opened = prompt_opens(rp, ctx.tokenizer.decode(prompt[-16:], skip_special_tokens=False))
        self.reasoning = ReasoningStream(rp, opened) if rp is not None and not constrained else None
        self.tools = ToolOutput(spec, parser) if spec is not None and spec.choice != "none" else None
        # gpt-oss's harmony channels (the template's format, or --reasoning-parser harmony): read as
        # one stream, its calls joining the tools' list (under auto; a constrained call is plain JSON).
        self.harmony = None
        if (parser.name == "harmony" or (rp is not None and rp.name == "harmony")) and not constrained:
            self.harmony = HarmonyStream(self.tools.calls if self.tools is not None else None,
                                         spec.names if spec is not None else None)
        self.blank = ""  # whitespace-only content held back until other text (or the end) says what it is
        self.spoke = False  # content other than whitespace was given

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning delta, content delta, tool_call deltas): ``feed_pieces`` gathered by kind."""
        pieces = self.feed_pieces(text, finished)
        return ("".join(v for k, v in pieces if k == "reasoning"), "".join(v for k, v in pieces if k == "content"),
                [v for k, v in pieces if k == "call"])

    def feed_pieces(self, text: str, finished: bool) -> list[Piece]:
        """What ``text``, the choice's next text, gives: reasoning, content and tool_call deltas in the
        order written (what the Responses and Messages routes turn into items and blocks)."""
        if self.harmony is not None:
            return self.harmony.feed(text, finished)
        reasoning, content = self.reasoning.feed(text, finished) if self.reasoning else ("", text)
        if self.tools is None:
            return [(k, v) for k, v in (("reasoning", reasoning), ("content", content)) if v]
        pieces: list[Piece] = []
        if self.reasoning is not None:
            pieces += [("reasoning" if k == "text" else k, v)
                       for k, v in self.tools.reasoning_parts(reasoning, finished or self.reasoning.done)]
        for kind, value in self.tools.parts(content, finished):
            if kind == "text":
                kind, value = "content", self._unblank(value, False)
            if value:
                pieces.append((kind, value))
        if finished and (rest := self._unblank("", True)):
            pieces.append(("content", rest))
        return pieces

    def _unblank(self, content: str, finished: bool) -> str:
        """Content as it may be sent: whitespace before any other content waits, and is dropped at
        the end if the model called tools."""
        if self.spoke:
            return content
        self.blank += content
        if self.blank.strip() or (finished and not self.tools.calls):
            self.spoke, content, self.blank = bool(self.blank.strip()), self.blank, ""
            return content
        return ""

    def whole(self, text: str) -> tuple[str | None, str, list[ToolCall]]:
        """(reasoning, None when there was no think block; content; calls) of a whole output."""
        pieces = self.whole_pieces(text)
        reasoning = "".join(v for k, v in pieces if k == "reasoning")
        saw = self.harmony.saw if self.harmony is not None else self.reasoning is not None and self.reasoning.saw
        return (reasoning if saw else None,
                "".join(v for k, v in pieces if k == "content"), [v for k, v in pieces if k == "call"])

    def whole_pieces(self, text: str) -> list[Piece]:
        """A whole output's pieces in the order written, each run of one kind merged, a call as its
        ToolCall: the items (blocks) a stream of the same text makes, however it is split."""
        out: list[Piece] = []
        for kind, value in self.feed_pieces(text, True):
            if kind == "call":
                if "id" in value:
                    out.append(("call", self.tools.calls[value["index"]]))
            elif out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + value)
            else:
                out.append((kind, value))
        if self.tools is not None:
            self.tools.settle()
        return out


# Arguments of the render that ferry sets itself: a request's chat_template_kwargs may not.
OWN_TEMPLATE_ARGUMENTS = ("tools", "add_generation_prompt", "messages", "conversation", "conversations")


def request_template(ctx: ServerContext, template_kwargs: dict[str, Any] | None,
                     chat_template: str | None = None) -> tuple[dict[str, Any], RequestTemplate | None]:
    """(chat_template_kwargs for the template, the template the request brought, if any: the
    top-level ``chat_template`` or ``chat_template_kwargs.chat_template``). A 400 naming the field
    for a template the server does not trust (--trust-request-chat-template), or kwargs that
    would set what ferry sets itself."""
    kwargs = dict(template_kwargs or {})
    own = next((k for k in OWN_TEMPLATE_ARGUMENTS if k in kwargs), None)
    if own is not None:
        hint = " (send tools in the request's tools field)" if own == "tools" else ""
        raise APIError(400, f"chat_template_kwargs may not set {own!r}: the server sets it{hint}",
                       param="chat_template_kwargs")
    brought = [(f, t) for f, t in (("chat_template", chat_template),
                                   ("chat_template_kwargs.chat_template", kwargs.pop("chat_template", None)))
               if t is not None]
    if not brought:
        return kwargs, None
    field, source = brought[0]
    if len(brought) > 1:
        raise APIError(400, "give one chat template: chat_template or chat_template_kwargs.chat_template",
                       param=field)
    if not ctx.limits.trust_request_chat_template:
        raise APIError(400, f"{field}: this server renders only its model's chat template (its operator "
                       f"can allow templates in requests with --trust-request-chat-template)",
                       param=field, code="unsupported_field")
    if not isinstance(source, str) or not source.strip():
        raise APIError(400, f"{field} must be a chat template (a non-empty string)", param=field)
    return kwargs, RequestTemplate(source, field)


async def checked_tools(ctx: ServerContext, tools: list[dict[str, Any]] | None, tool_choice: Any,
                        parallel: bool | None) -> tuple[ToolSpec | None, int]:
    """(the tools' spec, their JSON size): the count bound first, then (off the event loop, in
    linear time) the size bound and each tool's shape. The schemas are validated later
    (``check_schemas``), once the prompt's length is known to fit."""
    limits = ctx.limits
    if not tools:
        return tool_spec(tools, tool_choice, parallel), 0
    check_tool_count(tools, limits.max_tools)

    def check() -> tuple[ToolSpec | None, int]:
        size = check_tool_limits(tools, limits.max_tools, limits.max_tools_bytes)
        return tool_spec(tools, tool_choice, parallel, schemas=False), size

    return await asyncio.to_thread(check)


async def chat_prompt(ctx: ServerContext, messages: list[Any], tools: list[dict[str, Any]] | None,
                      tool_choice: Any, parallel: bool | None, template_kwargs: dict[str, Any] | None,
                      add_generation_prompt: bool = True, continue_final: bool = False,
                      chat_template: str | None = None, raw: Request | None = None
                      ) -> tuple[ToolSpec | None, list[int], tuple[ImageFeature, ...]]:
    """The checked tools, the prompt's token ids and its images: the conversation (with earlier
    calls and results, and images) and the tools through the chat template, or the generic tool
    prompt (``render.py``); images are loaded and checked first (``ServerContext.load_images``).
    ``continue_final``: the last (assistant) message is the start of the answer, left open.
    ``chat_template``: the request's top-level field; ``raw``: the request, whose client's
    disconnecting cancels the render. Cheap checks come first, the tools' schemas last."""
    kwargs, template = request_template(ctx, template_kwargs, chat_template)
    spec, tools_size = await checked_tools(ctx, tools, tool_choice, parallel)
    source = template.source if template is not None else ctx.need_tokenizer().chat_template
    conv, refs = take_images(conversation_of(messages))  # the images' sources out before any length is counted
    conv, template_tools = with_tools(conv, spec, source)
    ctx.check_prompt_length(conv, tools_size if template_tools else 0)
    images = await ctx.load_images(refs)
    if spec is not None:
        await asyncio.to_thread(check_schemas, spec)
    if continue_final:
        kwargs["continue_final_message"] = True
    prompt, features = await ctx.render_prompt(conv, template_tools, add_generation_prompt and not continue_final,
                                               kwargs, template=template, raw=raw, images=images)
    return spec, prompt, features


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


REASONING_EFFORTS = ("low", "medium", "high")


def effort_kwargs(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The request's chat_template_kwargs with its ``reasoning_effort`` among them (a 400 naming the
    field for an effort not in REASONING_EFFORTS); chat_template_kwargs' own wins."""
    effort = body.reasoning_effort
    if effort is None:
        return body.chat_template_kwargs
    if effort not in REASONING_EFFORTS:
        raise APIError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                       param="reasoning_effort")
    return {"reasoning_effort": effort, **(body.chat_template_kwargs or {})}


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, raw: Request):
    ctx = await model_context(raw, body.model)
    ctx.check_request(body)
    tokenizer = ctx.need_tokenizer()
    spec, prompt, images = await chat_prompt(ctx, body.messages, body.tools, body.tool_choice,
                                             body.parallel_tool_calls, effort_kwargs(body),
                                             chat_template=body.chat_template, raw=raw)
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
    overrides = tool_overrides(spec, parser, own_format)
    if parser.name == "harmony" or ctx.reasoning_parser == "harmony":  # its channels are special tokens
        overrides["skip_special_tokens"] = False
    sp = ctx.params(body, max_tokens, (top or 0) if body.logprobs else None, body.prompt_logprobs, **overrides)
    stream = await ctx.submit(ctx.sub_requests([prompt], sp, body.n, body.priority, images),
                              tag_fallback=spec is not None and spec.choice == "auto" and not own_format)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name}
    show_reasoning = body.include_reasoning

    def lp(out: RequestOutput, start: int) -> dict[str, Any] | None:
        return chat_logprobs(out.outputs[0], tokenizer, start, top or 0) if body.logprobs else None

    if body.stream:
        chunk_base = {**base, "object": "chat.completion.chunk"}

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            texts = [ChoiceText(ctx, spec, parser, prompt) for _ in range(body.n)]
            # With tools, content starts null, as OpenAI's does: an answer of only calls keeps it null.
            first = None if texts[0].tools is not None else ""
            for i in range(body.n):
                yield {**chunk_base, "choices": [{"index": i, "delta": {"role": "assistant", "content": first},
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
        reasoning, content, calls = ChoiceText(ctx, spec, parser, prompt).whole(comp.text)
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
