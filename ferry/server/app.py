"""The OpenAI-compatible HTTP API over the async engine.

Routes: GET /health, GET /v1/models, GET /metrics, POST /v1/completions, POST /v1/chat/completions.
Errors use OpenAI's body: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ferry.core.sampling_params import SamplingParams
from ferry.engine.async_engine import AsyncEngine, EngineDead, EngineOverloaded, Stream, SubRequest
from ferry.engine.outputs import RequestOutput
from ferry.server.metrics import ServerMetrics
from ferry.server.protocol import ChatCompletionRequest, CompletionRequest


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = \
            status, message, type_, param, code, headers


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}},
                        status_code=e.status, headers=e.headers)


_FIELD = re.compile(r"^(?:prompt \(|prompt |)([a-z_]+)")


def _bad_value(e: ValueError) -> APIError:
    """A ValueError from SamplingParams or the engine: its message starts with the field it is about."""
    msg = str(e)
    m = _FIELD.match(msg)
    param = "prompt" if msg.startswith("prompt") else (m.group(1) if m else None)
    return APIError(400, msg, param=param)


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The ASGI app. The engine's step loop starts with the app and stops with it."""
    llm = engine.engine
    tokenizer = llm.tokenizer
    metrics = ServerMetrics(llm, model_name)
    engine.on_step = metrics.on_step
    engine.on_abort = metrics.on_abort

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="ferry", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return error_response(APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', '')}".strip()))
        parts, param = [], None
        for err in errs[:3]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            # pydantic names the union member it tried ("list[int]"); the user wants the field path
            loc = [x for x in loc if not re.match(r"^(str|int|list|dict)\b", x)]
            field = ".".join(loc) or "body"
            param = param or (loc[0] if loc else None)
            parts.append(f"{field}: {err.get('msg')}")
        return error_response(APIError(400, "; ".join(parts), param=param))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return error_response(APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                                               code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return error_response(APIError(503, f"engine stopped: {engine.error}", "server_error"))
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "ferry", "max_model_len": llm.config.max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(400, f"model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    async def submit(subs: list[SubRequest]) -> Stream:
        try:
            return await engine.submit(subs)
        except ValueError as e:
            raise _bad_value(e) from None
        except EngineOverloaded as e:
            raise APIError(503, str(e), "server_overloaded", headers={"Retry-After": "1"}) from None
        except EngineDead as e:
            raise APIError(500, str(e), "server_error") from None

    def sub_requests(prompts: list[str | list[int]], sp: SamplingParams, n: int, priority: int) -> list[SubRequest]:
        if not 1 <= n <= 128:
            raise APIError(400, f"n must be an integer in [1, 128], got {n}", param="n")
        return [SubRequest(p, sp if n == 1 else replace(sp, seed=None if sp.seed is None else sp.seed + k), priority)
                for p in prompts for k in range(n)]

    def params(req, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return req.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            raise _bad_value(e) from None

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
        prompts = _prompts(body.prompt)
        sp = params(body, body.max_tokens, body.logprobs)
        stream = await submit(sub_requests(prompts, sp, body.n, body.priority))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = [(_prompt_text(p, tokenizer) if body.echo else "") for p in prompts for _ in range(body.n)]
        base = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        want_lp = body.logprobs is not None

        if body.stream:
            def choice(i: int, delta: str, comp: Any, ntok: int, sent: int, finished: bool) -> dict[str, Any]:
                lp = _completion_logprobs(comp, tokenizer, ntok, len(echo[i]) + sent) if want_lp else None
                return _choice(i, delta, lp, comp.finish_reason if finished else None)

            opening = [_choice(i, text, None, None) for i, text in enumerate(echo) if text]
            events = _sse_events(stream, sp.stop, body.n, len(echo), base, _include_usage(body), opening, choice)
            return StreamingResponse(events, media_type="text/event-stream")

        def full_choice(i: int, comp: Any) -> dict[str, Any]:
            lp = _completion_logprobs(comp, tokenizer, 0, len(echo[i])) if want_lp else None
            return _choice(i, echo[i] + comp.text, lp, comp.finish_reason)

        return _response(await _collect(stream, raw), body.n, base, full_choice)

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer and chat template; use /v1/completions with token ids")
        conv = [{"role": m.role, "content": _content(m.content)} for m in body.messages]
        try:
            prompt = tokenizer.apply_chat_template(conv)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        sp = params(body, body.max_completion_tokens or body.max_tokens, (top or 0) if body.logprobs else None)
        stream = await submit(sub_requests([prompt], sp, body.n, body.priority))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion", "created": created, "model": model_name}

        if body.stream:
            def delta_choice(i: int, delta: str, comp: Any, ntok: int, sent: int, finished: bool) -> dict[str, Any]:
                return {"index": i, "delta": {"content": delta} if delta else {},
                        "logprobs": _chat_logprobs(comp, tokenizer, ntok, top or 0) if body.logprobs else None,
                        "finish_reason": comp.finish_reason if finished else None}

            opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(body.n)]
            events = _sse_events(stream, sp.stop, body.n, body.n, {**base, "object": "chat.completion.chunk"},
                                 _include_usage(body), opening, delta_choice)
            return StreamingResponse(events, media_type="text/event-stream")

        def message_choice(i: int, comp: Any) -> dict[str, Any]:
            return {"index": i, "message": {"role": "assistant", "content": comp.text},
                    "logprobs": _chat_logprobs(comp, tokenizer, 0, top or 0) if body.logprobs else None,
                    "finish_reason": comp.finish_reason}

        return _response(await _collect(stream, raw), body.n, base, message_choice)

    return app


# ---------------------------------------------------------------------- helpers
async def _sse_events(stream: Stream, stop: list[str], n: int, num_choices: int, base: dict[str, Any],
                      include_usage: bool, opening: list[dict[str, Any]],
                      choice: Callable[[int, str, Any, int, int, bool], dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events for a stream of outputs: one chunk per new text (``choice`` shapes it),
    then usage if asked, then [DONE]. Leaving early (a disconnect) aborts what is unfinished."""
    sent = [0] * num_choices  # characters already sent, per choice
    ntok = [0] * num_choices  # tokens already covered (for logprobs)
    usage = _Usage()
    try:
        for c in opening:
            yield _sse({**base, "choices": [c]})
        async for i, out in stream:
            comp = out.outputs[0]
            if comp.finish_reason == "error":
                yield _sse({"error": _step_error(comp)})
                return
            usage.add(i, out, n)
            delta, upto = _delta(comp.text, sent[i], out.finished, stop)
            if delta or out.finished:
                yield _sse({**base, "choices": [choice(i, delta, comp, ntok[i], sent[i], out.finished)]})
                sent[i], ntok[i] = upto, len(comp.token_ids)
        if include_usage:
            yield _sse({**base, "choices": [], "usage": usage.dict()})
        yield "data: [DONE]\n\n"
    finally:
        await stream.close()


def _response(finals: list[RequestOutput], n: int, base: dict[str, Any],
              choice: Callable[[int, Any], dict[str, Any]]) -> dict[str, Any]:
    """A non-streaming response body: one choice per finished output, and the usage."""
    usage = _Usage()
    for i, out in enumerate(finals):
        usage.add(i, out, n)
    return {**base, "choices": [choice(i, out.outputs[0]) for i, out in enumerate(finals)], "usage": usage.dict()}


def _include_usage(body: Any) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _prompts(prompt: Any) -> list[str | list[int]]:
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


def _prompt_text(p: str | list[int], tokenizer: Any) -> str:
    if isinstance(p, str):
        return p
    return tokenizer.decode(p, skip_special_tokens=False) if tokenizer is not None else ""


def _content(content: str | list[dict] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(400, f"message content of type {part.get('type')!r} is not supported (text only)",
                           param="messages")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _delta(text: str, sent: int, finished: bool, stop: list[str]) -> tuple[str, int]:
    """New text since ``sent`` chars. With stop strings, hold back what could be the start of one:
    it may be cut when the rest of the stop string arrives."""
    upto = len(text) if finished or not stop else max(sent, len(text) - (max(map(len, stop)) - 1))
    return text[sent:upto], upto


def _choice(i: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
    return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _step_error(comp) -> dict[str, Any]:
    return {"message": f"the engine step failed: {comp.stop_reason}", "type": "server_error", "param": None,
            "code": None}


class _Usage:
    def __init__(self) -> None:
        self.prompt: dict[int, int] = {}
        self.completion: dict[int, int] = {}

    def add(self, i: int, out: RequestOutput, n: int) -> None:
        self.prompt[i // n] = len(out.prompt_token_ids)  # a prompt counts once, whatever n
        self.completion[i] = len(out.outputs[0].token_ids)

    def dict(self) -> dict[str, int]:
        p, c = sum(self.prompt.values()), sum(self.completion.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _collect(stream: Stream, raw: Request) -> list[RequestOutput]:
    """Wait for every final output; a client that hangs up aborts its requests."""
    finals: dict[int, RequestOutput] = {}

    async def run() -> None:
        async for i, out in stream:
            if out.finished:
                finals[i] = out

    task = asyncio.create_task(run())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
        task.result()
    except EngineDead as e:
        raise APIError(500, str(e), "server_error") from None
    finally:
        await stream.close()
    outs = [finals[i] for i in range(len(finals))]
    failed = [o for o in outs if o.outputs[0].finish_reason == "error"]
    if failed:
        raise APIError(500, _step_error(failed[0].outputs[0])["message"], "server_error")
    return outs


def _completion_logprobs(comp, tokenizer: Any, start: int, offset: int) -> dict[str, Any] | None:
    if comp.logprobs is None or tokenizer is None:
        return None
    toks, lps, tops, offs = [], [], [], []
    for tid, entry in zip(comp.token_ids[start:], comp.logprobs[start:]):
        piece = tokenizer.decode([tid], skip_special_tokens=False)
        toks.append(piece)
        lps.append(entry.get(tid))
        tops.append({tokenizer.decode([k], skip_special_tokens=False): v for k, v in entry.items()})
        offs.append(offset)
        offset += len(piece)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def _chat_logprobs(comp, tokenizer: Any, start: int, top: int) -> dict[str, Any] | None:
    if comp.logprobs is None or tokenizer is None:
        return None

    def item(tid: int, lp: float) -> dict[str, Any]:
        piece = tokenizer.decode([tid], skip_special_tokens=False)
        return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}

    return {"content": [
        {**item(tid, entry[tid]), "top_logprobs": [item(k, v) for k, v in sorted(entry.items(), key=lambda kv: -kv[1])[:top]]}
        for tid, entry in zip(comp.token_ids[start:], comp.logprobs[start:])]}
