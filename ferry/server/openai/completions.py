"""``POST /v1/completions``: OpenAI's text completions (and vLLM's extras: echo scoring, prompt_logprobs)."""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ferry.engine.outputs import RequestOutput
from ferry.server.context import model_context
from ferry.server.errors import APIError
from ferry.server.generation import Usage, collect, deltas, include_usage, openai_sse, prompt_only, usage_of
from ferry.server.json_body import BoundedJSONRoute
from ferry.server.logprobs import completion_logprobs, prompt_logprobs_json
from ferry.server.protocol import CompletionRequest

router = APIRouter(route_class=BoundedJSONRoute)


def prompts_of(prompt: Any) -> list[str | list[int]]:
    """The prompts of a request: one text, one list of token ids, or a list of either."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    for p in prompts:
        if (isinstance(p, str) and not p) or (isinstance(p, list) and not p):
            raise APIError(400, "prompt must not be empty: a request needs at least one prompt token", param="prompt")
    return prompts


def prompt_text(p: str | list[int], tokenizer: Any) -> str:
    if isinstance(p, str):
        return p
    return tokenizer.decode(p, skip_special_tokens=False) if tokenizer is not None else ""


def _choice(i: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
    return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request):
    ctx = await model_context(raw, body.model)
    ctx.check_request(body)
    tokenizer = ctx.tokenizer
    prompts = prompts_of(body.prompt)
    max_tokens, echo_only = body.max_tokens, False
    if max_tokens == 0:
        if not body.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo, to score the prompt)",
                           param="max_tokens")
        # Score the prompt only: one token is generated (the step needs it) and not returned.
        max_tokens, echo_only = 1, True
    want_lp = body.logprobs is not None
    prompt_lp = body.prompt_logprobs
    if body.echo and want_lp:
        prompt_lp = max(prompt_lp or 0, body.logprobs or 0)
    sp = ctx.params(body, max_tokens, body.logprobs, prompt_lp)
    stream = await ctx.submit(ctx.sub_requests(prompts, sp, body.n, body.priority))
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    echo = [(prompt_text(p, tokenizer) if body.echo else "") for p in prompts for _ in range(body.n)]
    base = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}
    view = prompt_only if echo_only else None

    def logprobs(out: RequestOutput, ntok: int, offset: int) -> dict[str, Any] | None:
        if not want_lp:
            return None
        # With echo, the prompt's tokens lead the first chunk's logprobs (the first has none).
        prompt = out.prompt_logprobs if body.echo and ntok == 0 else None
        return completion_logprobs(out.prompt_token_ids if prompt else [], prompt, out.outputs[0], tokenizer,
                                   ntok, offset)

    def extra(out: RequestOutput) -> dict[str, Any]:
        if body.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs_json(out.prompt_token_ids, out.prompt_logprobs, tokenizer)}

    if body.stream:
        async def chunks() -> AsyncIterator[dict[str, Any]]:
            usage = Usage(body.n)
            async for d in deltas(stream, len(echo), usage, view):
                first = d.token_start == 0
                lead = echo[d.index] if first else ""
                offset = len(echo[d.index]) + d.text_start if not first else 0
                yield {**base, "choices": [{**_choice(d.index, lead + d.text, logprobs(d.out, d.token_start, offset),
                                                      d.finish_reason), **(extra(d.out) if first else {})}]}
            if include_usage(body):
                yield {**base, "choices": [], "usage": usage.dict()}

        return StreamingResponse(openai_sse(stream, chunks()), media_type="text/event-stream")

    finals = await collect(stream, raw, view)

    def full_choice(i: int, out: RequestOutput) -> dict[str, Any]:
        comp = out.outputs[0]
        return {**_choice(i, echo[i] + comp.text, logprobs(out, 0, 0), comp.finish_reason), **extra(out)}

    return {**base, "choices": [full_choice(i, o) for i, o in enumerate(finals)],
            "usage": usage_of(finals, body.n).dict()}
