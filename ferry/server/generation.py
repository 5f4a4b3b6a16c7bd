"""The generation core every protocol shares: a stream of engine outputs becomes per-choice
deltas (new text, the output it came from, where its tokens start, the finish reason), and the
usage; the protocol modules only shape them. Also the non-streaming wait (``collect``)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Callable

from fastapi import Request

from ferry.engine.async_engine import EngineDead, Stream
from ferry.engine.outputs import CompletionOutput, RequestOutput
from ferry.server.errors import APIError

View = Callable[[RequestOutput], RequestOutput]


@dataclass
class Delta:
    """What one choice adds in one step."""

    index: int  # the choice (prompt-major: prompt i's k-th sample is i * n + k)
    text: str  # new text since the previous delta of this choice
    out: RequestOutput  # the engine's output it came from (all tokens so far)
    token_start: int  # the first output token this delta covers (0 on the first delta)
    text_start: int  # characters of this choice sent before this delta
    finished: bool

    @property
    def completion(self) -> CompletionOutput:
        return self.out.outputs[0]

    @property
    def finish_reason(self) -> str | None:
        return self.completion.finish_reason if self.finished else None


class StreamFailed(Exception):
    """A request in the stream failed in the engine or was aborted by the server."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class Usage:
    """Token counts of a request's choices: a prompt counts once, whatever n."""

    def __init__(self, n: int = 1) -> None:
        self.n = n
        self.prompt: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.completion: dict[int, int] = {}

    def add(self, i: int, out: RequestOutput) -> None:
        self.prompt[i // self.n] = len(out.prompt_token_ids)
        self.cached[i // self.n] = out.metrics.num_cached_tokens if out.metrics is not None else 0
        self.completion[i] = len(out.outputs[0].token_ids)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt.values())

    @property
    def completion_tokens(self) -> int:
        return sum(self.completion.values())

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())

    def dict(self) -> dict[str, Any]:
        p, c = self.prompt_tokens, self.completion_tokens
        # OpenAI's field for prompt tokens served from the prefix cache.
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def error_of(out: RequestOutput) -> APIError | None:
    """The error a final output stands for: its step failed, or the server aborted it."""
    comp = out.outputs[0]
    if comp.finish_reason == "error":
        return APIError(500, f"the engine step failed: {comp.stop_reason}", "server_error")
    if comp.finish_reason == "abort":  # a client's own abort has no one left to tell
        return APIError(503, "the request was aborted: the server is shutting down", "server_error",
                        code="aborted")
    return None


async def deltas(stream: Stream, num_choices: int, usage: Usage,
                 view: View | None = None) -> AsyncIterator[Delta]:
    """Each choice's new text as it comes (a choice's last delta has ``finished``), counting usage.
    The engine's text already holds back what could start a stop string. Raises StreamFailed for
    a failed or server-aborted request, EngineDead if the engine died."""
    sent = [0] * num_choices  # characters already given, per choice
    ntok = [0] * num_choices  # tokens already covered (for logprobs)
    async for i, out in stream:
        error = error_of(out)
        if error is not None:
            raise StreamFailed(error)
        if view is not None:
            out = view(out)
        comp = out.outputs[0]
        usage.add(i, out)
        text = comp.text[sent[i]:]
        if text or out.finished:
            yield Delta(i, text, out, ntok[i], sent[i], out.finished)
            sent[i], ntok[i] = len(comp.text), len(comp.token_ids) or 1


def sse(data: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event (with an ``event:`` line when named, as Anthropic and Responses send)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def openai_sse(stream: Stream, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """OpenAI's event stream: each chunk, then [DONE]; a failure ends it with an error event and
    [DONE]. Leaving early (a disconnect) aborts what is unfinished."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
        yield "data: [DONE]\n\n"
    except StreamFailed as f:
        e = f.error
        yield sse({"error": {"message": e.message, "type": e.type, "param": None, "code": e.code}})
        yield "data: [DONE]\n\n"
    except EngineDead as e:
        yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        yield "data: [DONE]\n\n"
    finally:
        await stream.close()


def prompt_only(out: RequestOutput) -> RequestOutput:
    """The output of a request that only scores its prompt (echo with max_tokens 0)."""
    comp = out.outputs[0]
    empty = CompletionOutput(index=comp.index, text="", token_ids=[], finish_reason="length",
                             logprobs=None if comp.logprobs is None else [])
    return replace(out, outputs=[empty])


async def collect(stream: Stream, raw: Request, view: View | None = None) -> list[RequestOutput]:
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
        error = error_of(out)
        if error is not None:
            raise error
    return [view(o) for o in outs] if view is not None else outs


def usage_of(finals: list[RequestOutput], n: int) -> Usage:
    usage = Usage(n)
    for i, out in enumerate(finals):
        usage.add(i, out)
    return usage


def include_usage(body: Any) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)
