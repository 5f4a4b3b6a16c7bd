"""What every route needs: the engine front, the served model's name, and the checks and
submission steps shared by all protocols. One per app, on ``app.state.ctx``."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fastapi import Request

log = logging.getLogger(__name__)

from ferry.core.sampling_params import SamplingParams
from ferry.engine.async_engine import AsyncEngine, EngineDead, EngineOverloaded, Stream, SubRequest
from ferry.server.errors import APIError, bad_value
from ferry.server.openai.response_store import ResponseStore

if TYPE_CHECKING:
    from ferry.server.replicas import ReplicaSet  # imports Ray's names only when used


@dataclass
class ServerContext:
    """One engine (AsyncEngine) or data-parallel replicas (ReplicaSet, the same methods)."""

    engine: "AsyncEngine | ReplicaSet"
    model_name: str
    tool_call_parser: str | None = None  # --tool-call-parser; None: chosen from the chat template
    reasoning_parser: str | None = None  # --reasoning-parser; None: no reasoning split
    responses: ResponseStore = field(default_factory=ResponseStore)  # for previous_response_id

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

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

    async def render_chat(self, conv: list[dict[str, Any]], param: str = "messages", **kwargs: Any) -> list[int]:
        """Token ids of a conversation through the model's chat template (``kwargs`` go to it: tools,
        chat_template_kwargs); a 400 naming ``param`` when it is too long or the template refuses it."""
        tok = self.need_tokenizer()
        try:
            self.engine.check_text_length(sum(len(str(m.get("content") or "")) for m in conv), f"{param} have")
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        try:  # rendering and tokenizing a long conversation must not hold up the event loop
            return await asyncio.to_thread(tok.apply_chat_template, conv, **kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        except Exception as e:  # a template's own raise_exception, or a jinja error in it
            raise APIError(400, f"the chat template refused these {param}: {e}", param=param) from None

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
    def sub_requests(prompts: list[str | list[int]], sp: SamplingParams, n: int, priority: int) -> list[SubRequest]:
        if not 1 <= n <= 128:
            raise APIError(400, f"n must be an integer in [1, 128], got {n}", param="n")
        return [SubRequest(p, sp if n == 1 else sp.nth(k), priority) for p in prompts for k in range(n)]

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
