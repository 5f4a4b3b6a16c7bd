"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes: a prompt, or chat messages rendered
through the chat template, to token ids (and back)."""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from ferry.server.context import model_context
from ferry.server.errors import APIError
from ferry.server.json_body import BoundedJSONRoute
from ferry.server.protocol import ChatMessage, TextRequest

router = APIRouter(route_class=BoundedJSONRoute)


class TokenizeRequest(TextRequest):
    """vLLM's TokenizeCompletionRequest (``prompt``) or TokenizeChatRequest (``messages``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None  # typed as chat's: a bad message is a 400 naming messages
    add_special_tokens: StrictBool | None = None  # a prompt's (default True); a chat's come from its template
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # the last message is left open, to be continued
    return_token_strs: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: StrictStr | None = None  # this request's own template (--trust-request-chat-template)

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt or messages: give exactly one")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt] = Field(min_length=0)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request) -> dict[str, Any]:
    ctx = await model_context(raw, body.model)
    tok = ctx.need_tokenizer()
    if body.messages is not None:
        from ferry.server.openai.chat import chat_prompt

        _, ids, _ = await chat_prompt(ctx, body.messages, body.tools, None, None, body.chat_template_kwargs,
                                      body.add_generation_prompt, body.continue_final_message,
                                      chat_template=body.chat_template, raw=raw)
    else:
        try:
            ctx.engine.check_text_length(len(body.prompt or ""), "prompt has")
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await asyncio.to_thread(tok.encode, body.prompt, add)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request) -> dict[str, Any]:
    ctx = await model_context(raw, body.model)
    tok = ctx.need_tokenizer()
    vocab = len(tok)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens: {bad} is not a token id (vocabulary of {vocab})", param="tokens")
    return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}
