"""The OpenAI-compatible HTTP API over the async engine.

Routes: GET|HEAD /health, GET /v1/models[/{id}], GET /metrics, POST /v1/completions,
POST /v1/chat/completions, GET /dashboard[/state] (``dashboard.py``). Every error, whatever
raised it, has OpenAI's body: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ferry.core.sampling_params import SamplingParams
from ferry.engine.async_engine import AsyncEngine, EngineDead, EngineOverloaded, Stream, SubRequest
from ferry.engine.outputs import CompletionOutput, RequestOutput
from ferry.server.dashboard import dashboard_router
from ferry.server.guard import Guard
from ferry.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_json
from ferry.server.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedField

if TYPE_CHECKING:
    from ferry.server.replicas import ReplicaSet  # imports Ray's names only when used

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


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
# pydantic names the union member or type it tried ("list[int]", "constrained-float"); users want the path
_TYPE_IN_LOC = re.compile(r"^(str|int|float|bool|list|dict|function|constrained)\b")


def _bad_value(e: ValueError) -> APIError:
    """A ValueError from SamplingParams or the engine: its message starts with the field it is about."""
    if isinstance(e, UnsupportedField):
        return APIError(400, str(e), param=e.field, code="unsupported_field")
    msg = str(e)
    m = _FIELD.match(msg)
    param = "prompt" if msg.startswith("prompt") else (m.group(1) if m else None)
    return APIError(400, msg, param=param)


def build_app(engine: AsyncEngine | ReplicaSet, model_name: str, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              allowed_origins: list[str] | None = None) -> FastAPI:
    """The ASGI app over one engine (AsyncEngine) or data-parallel replicas (ReplicaSet, the
    same methods). The engine's step loop starts with the app and stops with it."""
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len
    if isinstance(engine, AsyncEngine) and engine.metrics is None:
        engine.observe(model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="ferry", lifespan=lifespan)
    app.add_middleware(Guard, api_key=api_key, max_request_bytes=max_request_bytes)
    if allowed_origins:  # outermost, so a browser's preflight is answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on "
                   f"{request.url.path}"}.get(e.status_code, str(e.detail))
        return error_response(APIError(e.status_code, message, "not_found_error" if e.status_code == 404
                                       else "invalid_request_error", headers=getattr(e, "headers", None)))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return error_response(APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', '')}".strip()))
        parts, param = [], None
        for err in errs[:3]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            loc = [x for x in loc if not _TYPE_IN_LOC.match(x)]
            field = ".".join(loc) or "body"
            # A whole-body check names its field at the start of its message.
            m = re.match(r"Value error, ([a-z_]+)", str(err.get("msg"))) if not loc else None
            param = param or (loc[0] if loc else m.group(1) if m else None)
            parts.append(f"{field}: {err.get('msg')}")
        return error_response(APIError(400, "; ".join(parts), param=param))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if engine.error is not None:
            return error_response(APIError(503, f"engine stopped: {engine.error}", "server_error"))
        if engine.draining:  # shutting down: a load balancer should send new traffic elsewhere
            return error_response(APIError(503, "the server is shutting down (draining)", "server_error",
                                           code="draining"))
        return Response(status_code=200)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "ferry",
                "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(404, f"model {model_id!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", param="model", code="model_not_found")
        return model_card()

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        """Forget every cached prefix (vLLM's endpoint of that name): benchmarks start cold."""
        return {"num_blocks_freed": await engine.reset_prefix_cache()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await engine.prometheus(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(dashboard_router(engine, model_name))

    def check_request(body: Any) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(400, f"model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        try:
            body.check_supported()
        except ValueError as e:
            raise _bad_value(e) from None

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
        return [SubRequest(p, sp if n == 1 else sp.nth(k), priority) for p in prompts for k in range(n)]

    def params(body: Any, max_tokens: int | None, logprobs: int | None,
               prompt_logprobs: int | None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs, prompt_logprobs)
        except ValueError as e:
            raise _bad_value(e) from None

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        check_request(body)
        prompts = _prompts(body.prompt)
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
        sp = params(body, max_tokens, body.logprobs, prompt_lp)
        stream = await submit(sub_requests(prompts, sp, body.n, body.priority))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = [(_prompt_text(p, tokenizer) if body.echo else "") for p in prompts for _ in range(body.n)]
        base = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        view = _prompt_only if echo_only else None

        def logprobs(i: int, out: RequestOutput, ntok: int, offset: int) -> dict[str, Any] | None:
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
            def choice(i: int, delta: str, out: RequestOutput, ntok: int, sent: int, finished: bool) -> dict[str, Any]:
                lead = echo[i] if ntok == 0 else ""
                return {**_choice(i, lead + delta, logprobs(i, out, ntok, len(echo[i]) + sent if ntok else 0),
                                  out.outputs[0].finish_reason if finished else None),
                        **(extra(out) if ntok == 0 else {})}

            events = _sse_events(stream, sp.stop, body.n, len(echo), base, _include_usage(body), [], choice, view)
            return StreamingResponse(events, media_type="text/event-stream")

        def full_choice(i: int, out: RequestOutput) -> dict[str, Any]:
            comp = out.outputs[0]
            return {**_choice(i, echo[i] + comp.text, logprobs(i, out, 0, 0), comp.finish_reason), **extra(out)}

        return _response(await _collect(stream, raw, view), body.n, base, full_choice)

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        check_request(body)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer and chat template; use /v1/completions with token ids")
        conv = [{"role": m.role, "content": _content(m.content)} for m in body.messages]
        try:
            engine.check_text_length(sum(len(m["content"]) for m in conv), "messages have")
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        try:  # rendering and tokenizing a long conversation must not hold up the event loop
            prompt = await asyncio.to_thread(tokenizer.apply_chat_template, conv)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        # OpenAI's newer name wins when both are sent.
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(body, field)
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"{field} must be an integer >= 1, got {max_tokens}", param=field)
        sp = params(body, max_tokens, (top or 0) if body.logprobs else None, body.prompt_logprobs)
        stream = await submit(sub_requests([prompt], sp, body.n, body.priority))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion", "created": created, "model": model_name}

        if body.stream:
            def delta_choice(i: int, delta: str, out: RequestOutput, ntok: int, sent: int,
                             finished: bool) -> dict[str, Any]:
                comp = out.outputs[0]
                return {"index": i, "delta": {"content": delta} if delta else {},
                        "logprobs": chat_logprobs(comp, tokenizer, ntok, top or 0) if body.logprobs else None,
                        "finish_reason": comp.finish_reason if finished else None}

            opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(body.n)]
            events = _sse_events(stream, sp.stop, body.n, body.n, {**base, "object": "chat.completion.chunk"},
                                 _include_usage(body), opening, delta_choice)
            return StreamingResponse(events, media_type="text/event-stream")

        def message_choice(i: int, out: RequestOutput) -> dict[str, Any]:
            comp = out.outputs[0]
            return {"index": i, "message": {"role": "assistant", "content": comp.text},
                    "logprobs": chat_logprobs(comp, tokenizer, 0, top or 0) if body.logprobs else None,
                    "finish_reason": comp.finish_reason}

        finals = await _collect(stream, raw)
        response = _response(finals, body.n, base, message_choice)
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_json(finals[0].prompt_token_ids,
                                                               finals[0].prompt_logprobs, tokenizer)
        return response

    return app


# ---------------------------------------------------------------------- helpers
View = Callable[[RequestOutput], RequestOutput]


async def _sse_events(stream: Stream, stop: list[str], n: int, num_choices: int, base: dict[str, Any],
                      include_usage: bool, opening: list[dict[str, Any]],
                      choice: Callable[[int, str, RequestOutput, int, int, bool], dict[str, Any]],
                      view: View | None = None) -> AsyncIterator[str]:
    """Server-sent events for a stream of outputs: one chunk per new text (``choice`` shapes it),
    then usage if asked, then [DONE]. A request that fails or is aborted by the server ends its
    stream with an error event and [DONE]. Leaving early (a disconnect) aborts what is unfinished."""
    sent = [0] * num_choices  # characters already sent, per choice
    ntok = [0] * num_choices  # tokens already covered (for logprobs)
    usage = _Usage()
    try:
        for c in opening:
            yield _sse({**base, "choices": [c]})
        async for i, out in stream:
            error = _error_of(out)
            if error is not None:
                yield _sse({"error": {"message": error.message, "type": error.type, "param": None,
                                      "code": error.code}})
                break
            if view is not None:
                out = view(out)
            comp = out.outputs[0]
            usage.add(i, out, n)
            delta, upto = _delta(comp.text, sent[i], out.finished, stop)
            if delta or out.finished:
                yield _sse({**base, "choices": [choice(i, delta, out, ntok[i], sent[i], out.finished)]})
                sent[i], ntok[i] = upto, len(comp.token_ids) or 1
        else:
            if include_usage:
                yield _sse({**base, "choices": [], "usage": usage.dict()})
        yield "data: [DONE]\n\n"
    except EngineDead as e:
        yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        yield "data: [DONE]\n\n"
    finally:
        await stream.close()


def _error_of(out: RequestOutput) -> APIError | None:
    """The error a final output stands for: its step failed, or the server aborted it."""
    comp = out.outputs[0]
    if comp.finish_reason == "error":
        return APIError(500, f"the engine step failed: {comp.stop_reason}", "server_error")
    if comp.finish_reason == "abort":  # a client's own abort has no one left to tell
        return APIError(503, "the request was aborted: the server is shutting down", "server_error",
                        code="aborted")
    return None


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """The output of a request that only scores its prompt (echo with max_tokens 0)."""
    comp = out.outputs[0]
    empty = CompletionOutput(index=comp.index, text="", token_ids=[], finish_reason="length",
                             logprobs=None if comp.logprobs is None else [])
    return replace(out, outputs=[empty])


def _response(finals: list[RequestOutput], n: int, base: dict[str, Any],
              choice: Callable[[int, RequestOutput], dict[str, Any]]) -> dict[str, Any]:
    """A non-streaming response body: one choice per finished output, and the usage."""
    usage = _Usage()
    for i, out in enumerate(finals):
        usage.add(i, out, n)
    return {**base, "choices": [choice(i, out) for i, out in enumerate(finals)], "usage": usage.dict()}


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


class _Usage:
    def __init__(self) -> None:
        self.prompt: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.completion: dict[int, int] = {}

    def add(self, i: int, out: RequestOutput, n: int) -> None:
        self.prompt[i // n] = len(out.prompt_token_ids)  # a prompt counts once, whatever n
        self.cached[i // n] = out.metrics.num_cached_tokens if out.metrics is not None else 0
        self.completion[i] = len(out.outputs[0].token_ids)

    def dict(self) -> dict[str, Any]:
        p, c = sum(self.prompt.values()), sum(self.completion.values())
        # OpenAI's field for prompt tokens served from the prefix cache.
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}


async def _collect(stream: Stream, raw: Request, view: View | None = None) -> list[RequestOutput]:
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
    for out in outs:
        error = _error_of(out)
        if error is not None:
            raise error
    return [view(o) for o in outs] if view is not None else outs
