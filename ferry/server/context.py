"""What every route needs: the engine front, the served model's name, and the checks and
submission steps shared by all protocols. One per model served (``model_pool.py``)."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fastapi import Request

log = logging.getLogger(__name__)

from ferry.core.sampling_params import SamplingParams
from ferry.engine.async_engine import AsyncEngine, EngineDead, EngineOverloaded, Stream, SubRequest
from ferry.core.multimodal import ImageFeature
from ferry.multimodal.images import ImageError, ImageLimits
from ferry.multimodal.parts import ImageRef, load_images
from ferry.server.errors import APIError, bad_value
from ferry.server.openai.response_store import ResponseStore
from ferry.server.templates import MEMORY_BYTES, RenderPool, RenderFailed

if TYPE_CHECKING:
    from ferry.server.replicas import ReplicaSet  # imports Ray's names only when used


@dataclass(frozen=True)
class ChatLimits:
    """What a chat request may ask of the server before it is a prompt (``ferry serve``'s flags)."""

    trust_request_chat_template: bool = False  # --trust-request-chat-template
    max_template_seconds: float = 5.0  # --max-chat-template-seconds: one render's wall time
    max_template_chars: int = 4 * 2**20  # --max-chat-template-chars: one render's output
    max_tools: int = 128  # --max-tools (OpenAI's own bound)
    max_tools_bytes: int = 2**20  # --max-tools-bytes: the tools' JSON, all together
    images: ImageLimits = field(default_factory=ImageLimits)  # what a request's images may be

    def __post_init__(self) -> None:
        for name, flag in (("max_template_seconds", "max-chat-template-seconds"),
                           ("max_template_chars", "max-chat-template-chars"), ("max_tools", "max-tools"),
                           ("max_tools_bytes", "max-tools-bytes")):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"--{flag} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class RequestTemplate:
    """A chat template a request brought, and the field it came in (a 400 about it names that)."""

    source: str
    field: str


# Renders of the model's template run at once up to this many; templates requests bring (allowed
# by --trust-request-chat-template) up to REQUEST_TEMPLATE_WORKERS, at a lower CPU priority.
TEMPLATE_WORKERS = 2
REQUEST_TEMPLATE_WORKERS = 2
REQUEST_TEMPLATE_NICE = 19
# A chat shorter than this is encoded for its render, and its text tokenized, on the event loop:
# tens of microseconds, less than a hop to a thread.
INLINE_CHARS = 16_384


@dataclass
class ServerContext:
    """One engine (AsyncEngine) or data-parallel replicas (ReplicaSet, the same methods)."""

    engine: "AsyncEngine | ReplicaSet"
    model_name: str
    tool_call_parser: str | None = None  # --tool-call-parser; None: chosen from the chat template
    reasoning_parser: str | None = None  # --reasoning-parser; None: no reasoning split
    responses: ResponseStore = field(default_factory=ResponseStore)  # for previous_response_id
    limits: ChatLimits = field(default_factory=ChatLimits)
    # Chat template renders (``templates.py``): the model's template, and templates requests bring.
    renders: RenderPool = field(default_factory=lambda: RenderPool(TEMPLATE_WORKERS))
    request_renders: RenderPool = field(
        default_factory=lambda: RenderPool(REQUEST_TEMPLATE_WORKERS, nice=REQUEST_TEMPLATE_NICE))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def image_prompter(self) -> Any:
        """What turns a chat's text and images into a prompt; None: the model takes no images."""
        return getattr(self.engine, "image_prompter", None)

    async def load_images(self, refs: list[ImageRef]) -> list[Any]:
        """The request's images, decoded (in a thread: a fetch or a decode takes a while), then
        a 400 naming the field of the first image if the model takes none. Each image is checked
        whatever the model, so that a client learns what is wrong with it first."""
        if not refs:
            return []
        try:
            images = await asyncio.to_thread(load_images, refs, self.limits.images)
        except ImageError as e:
            raise APIError(400, e.message, param=e.field) from None
        if self.image_prompter is None:
            raise APIError(400, f"{refs[0].field}: model {self.model_name!r} does not accept images (it is "
                           f"text-only)", param=refs[0].field)
        return images

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(400, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_request(self, body: Any) -> None:
        """The model named, and no field ferry cannot honour (a 400 naming it)."""
        self.check_model(body.model)
        try:
            body.check_supported()
        except ValueError as e:
            raise bad_value(e) from None

    def need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer and chat template; use /v1/completions with token ids")
        return self.tokenizer

    def check_prompt_length(self, conv: list[dict[str, Any]], extra_chars: int = 0, param: str = "messages") -> None:
        """A 400 naming ``param`` when the conversation (and ``extra_chars`` of tools the template
        renders) is certainly more tokens than max_model_len: before anything costly is done with it."""
        chars = sum(len(str(m.get("content") or "")) for m in conv) + extra_chars
        try:
            self.engine.check_text_length(chars, f"{param} have")
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    async def render_chat(self, conv: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          add_generation_prompt: bool, template_kwargs: dict[str, Any],
                          param: str = "messages", template: RequestTemplate | None = None,
                          raw: Request | None = None) -> list[int]:
        """Token ids of a conversation through the model's chat template, or ``template`` (one the
        request brought), with ``tools`` and ``template_kwargs`` (e.g. enable_thinking). The render
        runs in a worker process (``templates.py``), bounded in time, memory and output, and is
        cancelled when the client (``raw``) disconnects; a 400 naming ``param`` (or the template's
        field) when the template refuses the conversation or goes past a bound."""
        ids, _ = await self.render_prompt(conv, tools, add_generation_prompt, template_kwargs, param, template, raw)
        return ids

    async def render_prompt(self, conv: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                            add_generation_prompt: bool, template_kwargs: dict[str, Any],
                            param: str = "messages", template: RequestTemplate | None = None,
                            raw: Request | None = None, images: list[Any] | None = None
                            ) -> tuple[list[int], tuple[ImageFeature, ...]]:
        """``render_chat``'s token ids, and with ``images`` (decoded, in the order of the
        conversation's ``{"type": "image"}`` parts) the image prompter's: each image's
        placeholder grown to its tokens, and the images' features."""
        tok = self.need_tokenizer()
        if not hasattr(tok, "chat_template_context"):  # a stand-in tokenizer: its own render, in a thread
            if images:
                raise APIError(400, "this model's tokenizer renders no images", param=param)
            return await self._render_in_thread(tok, conv, tools, add_generation_prompt, template_kwargs, param), ()
        wanted = (tools, template.source if template else None)
        try:  # loading transformers' tokenizer takes seconds, once
            source, special = (tok.chat_template_context(*wanted) if tok.chat_template_loaded
                               else await asyncio.to_thread(tok.chat_template_context, *wanted))
        except ValueError as e:
            raise APIError(400, str(e), param=template.field if template else param) from None
        request = {"template": source, "tools": tools, "add_generation_prompt": add_generation_prompt,
                   # as transformers does: None values are dropped, and kwargs win over special tokens
                   "conversation": [{k: v for k, v in m.items() if v is not None} for m in conv],
                   "kwargs": {**special, **template_kwargs}, "max_chars": self.limits.max_template_chars}
        pool = self.request_renders if template else self.renders
        where = template.field if template else param
        small = not tools and sum(len(str(m.get("content") or "")) for m in conv) < INLINE_CHARS
        try:
            head, text = await pool.render(request, self.limits.max_template_seconds,
                                           raw.is_disconnected if raw is not None else None, small)
        except RenderFailed as e:
            raise self._render_error(e, where, param, template is not None) from None
        if "error" in head:
            raise self._render_error(RenderFailed(head["error"], head.get("message", "")), where, param,
                                     template is not None)
        try:  # a long prompt's tokenizing must not hold up the event loop
            if images:  # processing the images takes a while too
                return await asyncio.to_thread(self._image_tokens, text, images, param)
            if len(text) < INLINE_CHARS:
                return self._tokens(tok, text, param), ()
            return await asyncio.to_thread(self._tokens, tok, text, param), ()
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    def _image_tokens(self, text: bytes, images: list[Any], param: str) -> tuple[list[int], tuple[ImageFeature, ...]]:
        rendered = text.decode()
        self.engine.check_text_length(len(rendered), f"{param} rendered through the chat template have")
        return self.image_prompter.encode(rendered, images)

    def _tokens(self, tok: Any, text: bytes, param: str) -> list[int]:
        rendered = text.decode()
        self.engine.check_text_length(len(rendered), f"{param} rendered through the chat template have")
        return tok.encode(rendered)

    def _render_error(self, e: RenderFailed, where: str, param: str, foreign: bool) -> APIError:
        """The API's error for a render that gave no text."""
        limits = self.limits
        if e.kind in ("disconnected", "cancelled"):
            return APIError(499, "client disconnected")
        if e.kind == "timeout":
            message = (f"rendering the chat template took more than {limits.max_template_seconds:g} s "
                       f"(--max-chat-template-seconds)")
        elif e.kind == "too_long":
            message = (f"the chat template rendered {int(e.message):,} characters, more than "
                       f"{limits.max_template_chars:,} (--max-chat-template-chars)")
        elif e.kind == "memory":
            message = f"rendering the chat template needed more than {MEMORY_BYTES // 2**20} MiB of memory"
        elif e.kind == "value":
            message = e.message
        elif e.kind == "template":
            message = f"the chat template refused these {param}: {e.message}"
        else:  # its worker ended: the template's doing only if the request brought it
            message = f"the chat template could not be rendered: {e.message}"
            if not foreign:
                return APIError(500, message, "server_error")
        return APIError(400, message, param=where)

    @staticmethod
    async def _render_in_thread(tok: Any, conv: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                                add_generation_prompt: bool, template_kwargs: dict[str, Any],
                                param: str) -> list[int]:
        try:
            return await asyncio.to_thread(tok.apply_chat_template, conv, tools=tools,
                                           add_generation_prompt=add_generation_prompt, **template_kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        except Exception as e:  # a template's own raise_exception, or a jinja error in it
            raise APIError(400, f"the chat template refused these {param}: {e}", param=param) from None

    async def start_renders(self) -> None:
        """Ready the first render: transformers' tokenizer loaded and a worker started (at the
        server's start, so that the first chat does not wait for them)."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "has_chat_template", False) or not hasattr(tok, "chat_template_context"):
            return
        try:
            await asyncio.to_thread(tok.chat_template_context)
        except Exception as e:  # the first chat will say what is wrong
            log.warning("the chat template did not load: %s", e)
            return
        await self.renders.warm()

    async def close_renders(self) -> None:
        await self.renders.close()
        await self.request_renders.close()

    def params(self, body: Any, max_tokens: int | None, logprobs: int | None,
               prompt_logprobs: int | None, **override: Any) -> SamplingParams:
        try:
            sp = body.sampling_params(max_tokens, logprobs, prompt_logprobs)
            if override:  # fields a protocol sets itself (a tool call's grammar)
                sp = replace(sp, **override)
            return sp
        except ValueError as e:
            raise bad_value(e) from None

    @staticmethod
    def sub_requests(prompts: list[str | list[int]], sp: SamplingParams, n: int, priority: int,
                     images: tuple[ImageFeature, ...] = ()) -> list[SubRequest]:
        """``n`` sub-requests per prompt; ``images``: the (one) prompt's images."""
        if not 1 <= n <= 128:
            raise APIError(400, f"n must be an integer in [1, 128], got {n}", param="n")
        return [SubRequest(p, sp if n == 1 else sp.nth(k), priority, images=images)
                for p in prompts for k in range(n)]

    async def submit(self, subs: list[SubRequest], tag_fallback: bool = False) -> Stream:
        """Queue the sub-requests (errors as the API's). ``tag_fallback``: their structural tag is
        the tools' own under tool_choice auto; when it does not compile (a schema the grammar
        engine refuses, or too slow) the calls are parsed unconstrained instead of failing."""
        try:
            return await self.engine.submit(subs)
        except ValueError as e:
            if tag_fallback and str(e).startswith("structured_outputs.structural_tag"):
                log.warning("tool calls under auto run unconstrained: %s", e)
                return await self.submit([replace(s, params=replace(s.params, structured_outputs=None)) for s in subs])
            raise bad_value(e) from None
        except EngineOverloaded as e:
            raise APIError(503, str(e), "server_overloaded", headers={"Retry-After": "1"}) from None
        except EngineDead as e:
            raise APIError(500, str(e), "server_error") from None


def context(request: Request) -> ServerContext:
    """The app's context, from inside a route."""
    return request.app.state.ctx


async def model_context(request: Request, model: str | None) -> ServerContext:
    """The context of the model a request names (None: the one model, where the server has one),
    loaded first if it is not, and kept loaded until the request ends (``model_pool.py``); a 404
    listing the models served when it names none of them."""
    return await request.app.state.models.context(request.scope, model)
