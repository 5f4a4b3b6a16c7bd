#!/usr/bin/env python3
"""Soak test for ``ferry serve``: start a real server, send a bounded mix of requests, check it.

    .venv/bin/python scripts/soak.py                      # ~2000 requests, concurrency 12
    .venv/bin/python scripts/soak.py --requests 300 --concurrency 8 --max-duration 600
    .venv/bin/python scripts/soak.py --mix chat_json=5 --server-arg=--max-num-seqs --server-arg=64
    .venv/bin/python scripts/soak.py --only chat_json,invalid --requests 100
    make soak SOAK_ARGS="--requests 500"

What it does:

1. starts ``ferry serve`` on 127.0.0.1 (a free port unless ``--port``), waits for ``/health``;
2. sends ``--requests`` requests at ``--concurrency`` (load stops early after ``--max-duration``
   seconds): completions and chat, streaming and not, n > 1, several prompts at once, clients
   that disconnect (streams closed after a few chunks; plain requests whose socket is closed
   before the answer) and invalid bodies (expecting a 4xx with an OpenAI error body);
3. checks: every valid request that was not disconnected got one well-formed answer (plain: a
   JSON body with one choice per index and a consistent usage; streams: well-formed chunks, one
   finish per choice, no error event, ``data: [DONE]`` once and last), every invalid one a 4xx
   JSON error; response ids are unique; at idle ``/metrics`` shows no running or waiting request
   and ``kv_cache_usage_perc`` 0; the server's RSS grew by less than ``--max-rss-growth-mb``
   between the end of the warm-up (the first ``--warmup-frac`` of the requests) and the end;
   the server is alive at the end and exits 0 on SIGTERM;
4. prints a summary and exits 1 if any check failed (2 if the server never came up).

The server is always stopped (SIGTERM, then SIGKILL), also on Ctrl-C or an error.

Adding a kind of request: write a function ``(rng, env) -> Spec`` and register it with
``@maker("name", weight)`` (or call ``register``). ``Spec.validate`` may add checks of its own on
the finished answer (see ``chat_json`` below: weight 0, switched on with ``--mix chat_json=5`` or
``--only chat_json``).
Only the standard library and httpx are used.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

# ---------------------------------------------------------------------------- request specs


@dataclass
class Env:
    """What makers may use: the served model and a word-prompt helper."""

    model: str
    max_model_len: int
    max_prompt_words: int

    WORDS = ("time year people way day man thing woman life child world school state family student "
             "group country problem hand part place case week company system program question work "
             "government number night point home water room mother area money story fact month lot "
             "right study book eye job word business issue side kind head house service friend father "
             "power hour game line end member law car city community name president team minute idea "
             "kid body information back parent face others level office door health person art war "
             "history party result change morning reason research girl guy moment air teacher force "
             "education river mountain garden ocean window letter music picture").split()

    def words(self, rng: random.Random, n: int) -> str:
        return " ".join(rng.choice(self.WORDS) for _ in range(max(1, n)))

    def prompt_len(self, rng: random.Random) -> int:
        """Mostly short prompts, some long: 60% 10-100 words, 30% up to 400, 10% up to the max."""
        top = self.max_prompt_words
        r = rng.random()
        if r < 0.6:
            return rng.randint(10, min(100, top))
        if r < 0.9:
            return rng.randint(min(100, top), min(400, top))
        return rng.randint(min(400, top), top)


@dataclass
class Spec:
    """One request to send and what to expect of it.

    expect: "ok" (a well-formed answer), "error" (a 4xx with an OpenAI error body) or
    "disconnect" (the client hangs up: ``disconnect_after_chunks`` events into a stream, or
    ``disconnect_after_s`` seconds after sending a plain request; an answer that comes first is fine).
    """

    kind: str
    path: str
    body: dict[str, Any] | None = None
    raw_body: bytes | None = None  # sent as is (malformed JSON)
    expect: str = "ok"
    num_choices: int = 1
    disconnect_after_chunks: int | None = None
    disconnect_after_s: float | None = None
    # Extra checks on a finished answer: returns a list of problems (empty when fine).
    validate: Callable[["Spec", "Result"], list[str]] | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body and self.body.get("stream"))

    @property
    def chat(self) -> bool:
        return self.path.endswith("/chat/completions")


@dataclass
class Result:
    spec: Spec
    outcome: str = "ok"  # ok | rejected (expected 4xx) | disconnected | failed
    status: int | None = None
    problems: list[str] = field(default_factory=list)
    latency: float = 0.0
    response_id: str | None = None
    texts: dict[int, str] = field(default_factory=dict)  # choice index -> its whole text
    finish: dict[int, str] = field(default_factory=dict)  # choice index -> finish_reason


Maker = Callable[[random.Random, Env], Spec]
MAKERS: dict[str, tuple[float, Maker]] = {}


def register(name: str, weight: float, fn: Maker) -> None:
    MAKERS[name] = (weight, fn)


def maker(name: str, weight: float) -> Callable[[Maker], Maker]:
    def deco(fn: Maker) -> Maker:
        register(name, weight, fn)
        return fn
    return deco


def _sampling(rng: random.Random) -> dict[str, Any]:
    """Sampling fields most valid requests share: max_tokens 1-64 and a sprinkle of options."""
    body: dict[str, Any] = {"max_tokens": rng.randint(1, 64), "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.2:
        body["top_p"] = 0.9
    if rng.random() < 0.15:
        body["seed"] = rng.randint(0, 10**6)
    if rng.random() < 0.15:
        body["stop"] = [rng.choice(["\n\n", ".", " the"])]
    return body


def _completion(rng: random.Random, env: Env, stream: bool, n: int = 1, prompts: int = 1) -> Spec:
    body = {"model": env.model, **_sampling(rng), "stream": stream, "n": n}
    texts = [env.words(rng, env.prompt_len(rng)) for _ in range(prompts)]
    body["prompt"] = texts[0] if prompts == 1 else texts
    if rng.random() < 0.1:
        body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.1:
        body["echo"] = True
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    kind = "cmpl" + ("_stream" if stream else "") + ("_n" if n > 1 else "") + ("_batch" if prompts > 1 else "")
    return Spec(kind, "/v1/completions", body, num_choices=n * prompts)


def _chat(rng: random.Random, env: Env, stream: bool, n: int = 1) -> Spec:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You are a terse assistant."})
    messages.append({"role": "user", "content": env.words(rng, env.prompt_len(rng))})
    if rng.random() < 0.2:  # a short earlier exchange
        messages[-1:-1] = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."}]
    body = {"model": env.model, "messages": messages, **_sampling(rng), "stream": stream, "n": n}
    if rng.random() < 0.1:
        body["logprobs"] = True
        body["top_logprobs"] = rng.randint(0, 3)
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    kind = "chat" + ("_stream" if stream else "") + ("_n" if n > 1 else "")
    return Spec(kind, "/v1/chat/completions", body, num_choices=n)


@maker("cmpl", 18)
def _m_cmpl(rng, env):
    return _completion(rng, env, stream=False)


@maker("cmpl_stream", 14)
def _m_cmpl_stream(rng, env):
    return _completion(rng, env, stream=True)


@maker("chat", 14)
def _m_chat(rng, env):
    return _chat(rng, env, stream=False)


@maker("chat_stream", 14)
def _m_chat_stream(rng, env):
    return _chat(rng, env, stream=True)


@maker("multi_n", 8)
def _m_n(rng, env):
    n, stream = rng.randint(2, 4), rng.random() < 0.5
    return _completion(rng, env, stream, n=n) if rng.random() < 0.5 else _chat(rng, env, stream, n=n)


@maker("cmpl_batch", 3)
def _m_batch(rng, env):
    return _completion(rng, env, stream=rng.random() < 0.5, n=rng.choice([1, 2]), prompts=rng.randint(2, 3))


@maker("disconnect_stream", 8)
def _m_disc_stream(rng, env):
    spec = _chat(rng, env, True) if rng.random() < 0.5 else _completion(rng, env, True)
    spec.body["max_tokens"] = 64
    spec.body.pop("stop", None)
    spec.kind, spec.expect, spec.disconnect_after_chunks = "disconnect_stream", "disconnect", rng.randint(1, 4)
    return spec


@maker("disconnect_plain", 7)
def _m_disc_plain(rng, env):
    spec = _chat(rng, env, False) if rng.random() < 0.5 else _completion(rng, env, False)
    spec.body["max_tokens"] = 64
    spec.body.pop("stop", None)
    spec.kind, spec.expect, spec.disconnect_after_s = "disconnect_plain", "disconnect", rng.uniform(0.05, 1.5)
    return spec


def _invalid_cases(env: Env) -> list[tuple[str, str, dict[str, Any] | bytes]]:
    m, msg = env.model, [{"role": "user", "content": "hi"}]
    return [
        ("temperature<0", "/v1/completions", {"model": m, "prompt": "hi", "temperature": -1}),
        ("max_tokens<0", "/v1/completions", {"model": m, "prompt": "hi", "max_tokens": -3}),
        ("max_tokens=str", "/v1/chat/completions", {"model": m, "messages": msg, "max_tokens": "ten"}),
        ("n=0", "/v1/completions", {"model": m, "prompt": "hi", "n": 0}),
        ("top_p>1", "/v1/chat/completions", {"model": m, "messages": msg, "top_p": 1.5}),
        ("empty prompt", "/v1/completions", {"model": m, "prompt": ""}),
        ("no prompt", "/v1/completions", {"model": m, "max_tokens": 4}),
        ("no messages", "/v1/chat/completions", {"model": m, "messages": []}),
        ("bad role", "/v1/chat/completions", {"model": m, "messages": [{"role": "wizard", "content": "hi"}]}),
        ("unknown model", "/v1/chat/completions", {"model": "no-such-model", "messages": msg}),
        ("stream=str", "/v1/completions", {"model": m, "prompt": "hi", "stream": "yes"}),
        ("too long", "/v1/completions", {"model": m, "prompt": "hi", "max_tokens": env.max_model_len + 10}),
        ("malformed JSON", "/v1/chat/completions", b'{"model": "x", "messages": [{"role": "user", '),
    ]


@maker("invalid", 10)
def _m_invalid(rng, env):
    name, path, body = rng.choice(_invalid_cases(env))
    if isinstance(body, bytes):
        return Spec(f"invalid:{name}", path, raw_body=body, expect="error")
    return Spec(f"invalid:{name}", path, dict(body), expect="error")


def _json_content(spec: Spec, res: Result) -> list[str]:
    """A response_format json_object answer that finished by itself must parse as JSON."""
    problems = []
    for i, text in res.texts.items():
        if res.finish.get(i) == "stop":
            try:
                json.loads(text)
            except ValueError:
                problems.append(f"choice {i}: finished with 'stop' but is not JSON: {text[:80]!r}")
    return problems


@maker("chat_json", 0)  # a hook for grammar requests: switch on with --mix chat_json=5
def _m_chat_json(rng, env):
    spec = _chat(rng, env, stream=rng.random() < 0.5)
    spec.body["messages"][-1]["content"] = "Reply with a JSON object describing a " + rng.choice(Env.WORDS)
    spec.body["response_format"] = {"type": "json_object"}
    spec.body.pop("stop", None)
    spec.kind, spec.validate = "chat_json" + ("_stream" if spec.stream else ""), _json_content
    return spec


# ---------------------------------------------------------------------------- running one request

class Runner:
    def __init__(self, base_url: str, timeout: float, concurrency: int) -> None:
        self.base_url = base_url
        self.timeout = timeout
        host, port = base_url.split("//", 1)[1].rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.client = httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout, connect=30),
                                        limits=httpx.Limits(max_connections=concurrency + 4))

    async def run(self, spec: Spec) -> Result:
        res = Result(spec)
        t0 = time.monotonic()
        try:
            if spec.disconnect_after_s is not None:
                await asyncio.wait_for(self._plain_disconnect(spec, res), self.timeout)
            elif spec.stream:
                await asyncio.wait_for(self._stream(spec, res), self.timeout)
            else:
                await asyncio.wait_for(self._plain(spec, res), self.timeout)
        except asyncio.TimeoutError:
            res.problems.append(f"no answer within {self.timeout:.0f} s")
        except httpx.HTTPError as e:
            res.problems.append(f"{type(e).__name__}: {e}")
        except OSError as e:
            res.problems.append(f"{type(e).__name__}: {e}")
        res.latency = time.monotonic() - t0
        if res.problems:
            res.outcome = "failed"
        elif spec.validate is not None and res.outcome == "ok":
            res.problems = spec.validate(spec, res)
            if res.problems:
                res.outcome = "failed"
        return res

    # -- plain JSON answers
    async def _plain(self, spec: Spec, res: Result) -> None:
        if spec.raw_body is not None:
            r = await self.client.post(spec.path, content=spec.raw_body, headers={"content-type": "application/json"})
        else:
            r = await self.client.post(spec.path, json=spec.body)
        res.status = r.status_code
        if spec.expect == "error":
            _check_error(r.status_code, r.headers.get("content-type", ""), r.content, res)
            return
        if r.status_code != 200:
            res.problems.append(f"HTTP {r.status_code}: {r.text[:200]}")
            return
        try:
            body = r.json()
        except ValueError:
            res.problems.append(f"body is not JSON: {r.text[:200]!r}")
            return
        _check_plain_body(spec, body, res)

    # -- server-sent events
    async def _stream(self, spec: Spec, res: Result) -> None:
        async with self.client.stream("POST", spec.path, json=spec.body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                if spec.expect == "error":
                    _check_error(r.status_code, r.headers.get("content-type", ""), r.content, res)
                else:
                    res.problems.append(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            if spec.expect == "error":
                res.problems.append("expected a 4xx, got 200")
                return
            if "text/event-stream" not in r.headers.get("content-type", ""):
                res.problems.append(f"content-type {r.headers.get('content-type')!r} is not text/event-stream")
            sse = _SSECheck(spec, res)
            async for line in r.aiter_lines():
                sse.line(line)
                if spec.disconnect_after_chunks is not None and sse.events >= spec.disconnect_after_chunks \
                        and not sse.done:
                    res.outcome = "disconnected"
                    return  # leaving the block closes the connection half-way
            sse.finish()

    # -- a plain request whose client hangs up before the answer
    async def _plain_disconnect(self, spec: Spec, res: Result) -> None:
        data = json.dumps(spec.body).encode()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write((f"POST {spec.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                          f"Connection: close\r\n\r\n").encode() + data)
            await writer.drain()
            try:
                first = await asyncio.wait_for(reader.read(1), spec.disconnect_after_s)
            except asyncio.TimeoutError:
                first = b""
            res.outcome = "disconnected" if not first else "ok"  # an early answer is fine too
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass

    async def close(self) -> None:
        await self.client.aclose()


def _check_error(status: int, ctype: str, content: bytes, res: Result) -> None:
    if not 400 <= status < 500:
        res.problems.append(f"expected a 4xx, got HTTP {status}: {content[:200]!r}")
        return
    res.outcome = "rejected"
    try:
        err = json.loads(content)["error"]
        if not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
            res.problems.append(f"error body lacks message/type: {err}")
    except (ValueError, KeyError, TypeError):
        res.problems.append(f"HTTP {status} body is not an OpenAI error: {content[:200]!r}")


_FINISH = ("stop", "length")


def _check_plain_body(spec: Spec, body: Any, res: Result) -> None:
    p = res.problems
    want_obj = "chat.completion" if spec.chat else "text_completion"
    if not isinstance(body, dict):
        p.append(f"body is not an object: {str(body)[:200]}")
        return
    if body.get("object") != want_obj:
        p.append(f"object {body.get('object')!r}, expected {want_obj!r}")
    res.response_id = body.get("id")
    if not isinstance(res.response_id, str):
        p.append("no id")
    choices = body.get("choices")
    if not isinstance(choices, list):
        p.append("no choices list")
        return
    idx = [c.get("index") for c in choices]
    if not all(isinstance(i, int) for i in idx) or sorted(idx) != list(range(spec.num_choices)):
        p.append(f"choice indices {idx}, expected 0..{spec.num_choices - 1} once each")
    for c in choices:
        i = c.get("index")
        if c.get("finish_reason") not in _FINISH:
            p.append(f"choice {i}: finish_reason {c.get('finish_reason')!r}")
        if spec.chat:
            msg = c.get("message") or {}
            if msg.get("role") != "assistant" or not isinstance(msg.get("content"), str):
                p.append(f"choice {i}: malformed message {msg}")
            text = msg.get("content") or ""
        else:
            text = c.get("text")
            if not isinstance(text, str):
                p.append(f"choice {i}: text is not a string")
                text = ""
        res.texts[i] = text
        res.finish[i] = c.get("finish_reason")
    _check_usage(spec, body.get("usage"), p)


def _check_usage(spec: Spec, usage: Any, p: list[str]) -> None:
    if not isinstance(usage, dict) or not all(isinstance(usage.get(k), int)
                                              for k in ("prompt_tokens", "completion_tokens", "total_tokens")):
        p.append(f"malformed usage {usage}")
        return
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        p.append(f"usage does not add up: {usage}")
    top = (spec.body.get("max_tokens") or 0) * spec.num_choices
    if usage["prompt_tokens"] < 1 or not 0 <= usage["completion_tokens"] <= top:
        p.append(f"usage {usage} out of range (choices {spec.num_choices}, max_tokens {spec.body.get('max_tokens')})")


class _SSECheck:
    """Checks a stream event by event: chunks well formed, each choice finished once, [DONE] last."""

    def __init__(self, spec: Spec, res: Result) -> None:
        self.spec, self.res = spec, res
        self.events = 0
        self.done = 0
        self.after_done = 0
        self.usage_chunks = 0
        self.finished: Counter[int] = Counter()
        self.ids: set[str] = set()
        self.role_seen: set[int] = set()

    def line(self, line: str) -> None:
        if not line.strip():
            return
        p = self.res.problems
        if not line.startswith("data: "):
            p.append(f"not an SSE data line: {line[:120]!r}")
            return
        data = line[6:]
        self.events += 1
        if self.done:
            self.after_done += 1
        if data.strip() == "[DONE]":
            self.done += 1
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            p.append(f"event is not JSON: {data[:120]!r}")
            return
        if "error" in chunk:
            p.append(f"error event: {chunk['error']}")
            return
        want = "chat.completion.chunk" if self.spec.chat else "text_completion"
        if chunk.get("object") != want:
            p.append(f"chunk object {chunk.get('object')!r}, expected {want!r}")
        if isinstance(chunk.get("id"), str):
            self.ids.add(chunk["id"])
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            p.append("chunk without choices")
            return
        if not choices:  # the usage chunk
            self.usage_chunks += 1
            _check_usage(self.spec, chunk.get("usage"), p)
            return
        for c in choices:
            i = c.get("index")
            if not isinstance(i, int) or not 0 <= i < self.spec.num_choices:
                p.append(f"choice index {i!r} out of range")
                continue
            if self.finished[i]:
                p.append(f"choice {i} got a chunk after its finish")
            if self.spec.chat:
                delta = c.get("delta")
                if not isinstance(delta, dict):
                    p.append(f"choice {i}: no delta")
                    continue
                if delta.get("role") == "assistant":
                    self.role_seen.add(i)
                text = delta.get("content") or ""
            else:
                text = c.get("text")
                if not isinstance(text, str):
                    p.append(f"choice {i}: text is not a string")
                    text = ""
            self.res.texts[i] = self.res.texts.get(i, "") + text
            if c.get("finish_reason") is not None:
                if c["finish_reason"] not in _FINISH:
                    p.append(f"choice {i}: finish_reason {c['finish_reason']!r}")
                self.finished[i] += 1
                self.res.finish[i] = c["finish_reason"]

    def finish(self) -> None:
        p = self.res.problems
        if self.done != 1:
            p.append(f"data: [DONE] seen {self.done} times")
        elif self.after_done:
            p.append(f"{self.after_done} events after data: [DONE]")
        for i in range(self.spec.num_choices):
            if self.finished[i] != 1:
                p.append(f"choice {i} finished {self.finished[i]} times")
            if self.spec.chat and i not in self.role_seen:
                p.append(f"choice {i}: no role=assistant delta")
        if len(self.ids) > 1:
            p.append(f"chunks carry {len(self.ids)} different ids")
        self.res.response_id = next(iter(self.ids), None)
        wants_usage = bool((self.spec.body.get("stream_options") or {}).get("include_usage"))
        if self.usage_chunks != (1 if wants_usage else 0):
            p.append(f"{self.usage_chunks} usage chunks (include_usage={wants_usage})")


# ---------------------------------------------------------------------------- the server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Server:
    def __init__(self, port: int, extra_args: list[str], env: dict[str, str], log_path: Path,
                 server_cmd: str | None = None) -> None:
        ferry = Path(sys.executable).with_name("ferry")
        if server_cmd:
            cmd = shlex.split(server_cmd)
        else:
            cmd = [str(ferry)] if ferry.exists() else [sys.executable, "-m", "ferry.cli"]
        self.cmd = cmd + ["serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra_args]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        # Its own session: a Ctrl-C here does not reach it; we stop it ourselves.
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     start_new_session=True)
        self.exit_code: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=5) as c:
            while time.monotonic() < deadline:
                if not self.alive():
                    return False
                try:
                    if (await c.get(self.url + "/health")).status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        return False

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.exit_code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                self.exit_code = None  # had to be killed
        elif self.exit_code is None:
            self.exit_code = self.proc.returncode
        self.log.close()
        return self.exit_code

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


_METRIC = re.compile(r"^(ferry:[a-z_]+)(?:\{([^}]*)\})? ([-+0-9.eE]+|NaN)$")


async def read_metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """Unlabelled values by name (the model_name label dropped); finished requests by reason as
    ``finished:REASON``."""
    r = await client.get("/metrics")
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        m = _METRIC.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        reason = re.search(r'finished_reason="([^"]*)"', labels)
        if name == "ferry:request_success_total" and reason:
            out[f"finished:{reason.group(1)}"] = out.get(f"finished:{reason.group(1)}", 0) + value
        elif name not in out:
            out[name] = value
    return out


# ---------------------------------------------------------------------------- the soak

def build_specs(args: argparse.Namespace, env: Env) -> list[Spec]:
    weights = {name: w for name, (w, _) in MAKERS.items()}
    mixed: set[str] = set()
    for item in (args.mix or "").split(","):
        if item.strip():
            name, _, w = item.partition("=")
            if name.strip() not in MAKERS:
                raise SystemExit(f"--mix: no request maker {name.strip()!r} (have: {', '.join(MAKERS)})")
            weights[name.strip()] = float(w)
            mixed.add(name.strip())
    if args.only:  # only these kinds, equally often unless --mix weighs them
        only = [n.strip() for n in args.only.split(",") if n.strip()]
        for n in only:
            if n not in MAKERS:
                raise SystemExit(f"--only: no request maker {n!r} (have: {', '.join(MAKERS)})")
        weights = {n: (weights[n] if n in mixed else 1.0) if n in only else 0.0 for n in weights}
    names = [n for n in MAKERS if weights[n] > 0]
    if not names:
        raise SystemExit("--mix leaves no request kind with a positive weight")
    rng = random.Random(args.seed)
    picks = rng.choices(names, [weights[n] for n in names], k=args.requests)
    return [MAKERS[name][1](rng, env) for name in picks]


Check = tuple[str, bool, str]  # name, passed, detail


def print_table(results: list[Result]) -> None:
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    lat: dict[str, list[float]] = defaultdict(list)
    for r in results:
        k = r.spec.kind.split(":")[0]
        by_kind[k][r.outcome] += 1
        lat[k].append(r.latency)
    outcomes = ("ok", "rejected", "disconnected", "failed")
    print(f"\n{'kind':<22}{'sent':>6}" + "".join(f"{o:>14}" for o in outcomes) + f"{'p50 s':>9}{'max s':>9}")
    for k in sorted(by_kind):
        ls = sorted(lat[k])
        print(f"{k:<22}{sum(by_kind[k].values()):>6}" + "".join(f"{by_kind[k][o]:>14}" for o in outcomes)
              + f"{ls[len(ls) // 2]:>9.2f}{ls[-1]:>9.2f}")
    total = Counter(r.outcome for r in results)
    print(f"{'all':<22}{len(results):>6}" + "".join(f"{total[o]:>14}" for o in outcomes), flush=True)


def describe_failure(r: Result) -> str:
    body = json.dumps(r.spec.body)[:160] if r.spec.body else repr(r.spec.raw_body)[:80]
    return (f"  FAILED {r.spec.kind} {r.spec.path} HTTP {r.status} after {r.latency:.1f} s: "
            f"{'; '.join(r.problems)[:300]}\n         body {body}")


async def soak(args: argparse.Namespace, server: Server, checks: list[Check], results: list[Result]) -> int:
    """Run the load (answers appended to ``results``) and the checks (to ``checks``).
    0, or 2 if the server never came up."""
    print(f"soak: server pid {server.pid} at {server.url} (log: {server.log_path})", flush=True)
    t_start = time.monotonic()
    if not await server.wait_healthy(args.startup_timeout):
        print(f"soak: the server did not become healthy within {args.startup_timeout:.0f} s", flush=True)
        print(server.log_tail(), flush=True)
        return 2
    print(f"soak: healthy after {time.monotonic() - t_start:.1f} s", flush=True)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
        card = (await c.get("/v1/models")).json()["data"][0]
    env = Env(model=card["id"], max_model_len=int(card.get("max_model_len") or 2048),
              max_prompt_words=args.max_prompt_words)
    specs = build_specs(args, env)
    rss: dict[str, float | None] = {"start": rss_mb(server.pid)}
    trace: list[tuple[int, float | None]] = [(0, rss["start"])]
    warmup_n = max(1, int(len(specs) * args.warmup_frac))
    every = max(1, len(specs) // 10)

    runner = Runner(server.url, args.request_timeout, args.concurrency)
    queue: asyncio.Queue[Spec] = asyncio.Queue()
    for s in specs:
        queue.put_nowait(s)
    deadline = time.monotonic() + args.max_duration
    capped = False
    server_died = False
    t0 = time.monotonic()

    async def worker() -> None:
        nonlocal capped, server_died
        while not queue.empty():
            if time.monotonic() > deadline:
                capped = True
                return
            if not server.alive():
                server_died = True
                return
            spec = queue.get_nowait()
            res = await runner.run(spec)
            results.append(res)
            if res.outcome == "failed" and args.verbose:
                print(describe_failure(res), flush=True)
            done = len(results)
            if done == warmup_n:
                rss["warmup"] = rss_mb(server.pid)
            if done % every == 0:
                trace.append((done, rss_mb(server.pid)))
                failed = sum(r.outcome == "failed" for r in results)
                print(f"soak: {done}/{len(specs)} done, {failed} failed, {time.monotonic() - t0:.0f} s, "
                      f"server RSS {trace[-1][1] or 0:.0f} MB", flush=True)

    try:
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    finally:
        await runner.close()
    wall = time.monotonic() - t0

    # ---- idle: nothing running or waiting, no KV block held
    idle: dict[str, float] = {}
    if server.alive():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            t_idle = time.monotonic()
            while True:
                try:
                    idle = await read_metrics(c)
                except httpx.HTTPError as e:
                    idle = {"error": str(e)}  # type: ignore[dict-item]
                    break
                quiet = (idle.get("ferry:num_requests_running") == 0 and idle.get("ferry:num_requests_waiting") == 0
                         and idle.get("ferry:kv_cache_usage_perc") == 0)
                if quiet or time.monotonic() - t_idle > args.idle_timeout:
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(1.0)  # let freed memory settle before the last RSS sample
            try:
                health = (await c.get("/health")).status_code
            except httpx.HTTPError:
                health = None
    else:
        server_died, health = True, None
    rss["end"] = rss_mb(server.pid)
    trace.append((len(results), rss["end"]))

    # ---- summary
    print_table(results)
    invalid_status = Counter(r.status for r in results if r.spec.expect == "error")
    print(f"\nsent {len(results)} of {len(specs)} requests in {wall:.1f} s"
          + (f" (stopped by --max-duration {args.max_duration:.0f} s)" if capped else "")
          + f"; invalid requests answered with {dict(invalid_status)}")

    failed = [r for r in results if r.outcome == "failed"]
    for r in failed[:args.show_failures]:
        print(describe_failure(r))
    if len(failed) > args.show_failures:
        print(f"  ... and {len(failed) - args.show_failures} more failures")
    ids = Counter(r.response_id for r in results if r.response_id)
    dup = [i for i, n in ids.items() if n > 1]

    def mb(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.0f} MB"

    print("\nserver RSS by requests done: " + ", ".join(f"{n}: {mb(v)}" for n, v in trace))
    growth = None if rss.get("warmup") is None or rss["end"] is None else rss["end"] - rss["warmup"]
    print(f"server RSS: start {mb(rss['start'])}, after warm-up ({warmup_n} requests) {mb(rss.get('warmup'))}, "
          f"end {mb(rss['end'])}; growth after warm-up {mb(growth)} (limit {args.max_rss_growth_mb:.0f} MB)")
    print("idle metrics: " + ", ".join(f"{k.split(':')[1]}={v:g}" for k, v in idle.items()
                                       if k in ("ferry:num_requests_running", "ferry:num_requests_waiting",
                                                "ferry:kv_cache_usage_perc", "ferry:num_preemptions_total")
                                       and isinstance(v, float)))
    finished = {k.split(":", 1)[1]: v for k, v in idle.items() if k.startswith("finished:")}
    if finished:
        print("engine requests finished, by reason (server lifetime): "
              + ", ".join(f"{k}={v:g}" for k, v in sorted(finished.items())))

    checks.append(("server alive to the end", not server_died and health == 200, f"/health {health}"))
    checks.append(("every valid request answered once, well formed", not [r for r in failed if r.spec.expect == "ok"],
                   f"{sum(r.spec.expect == 'ok' for r in failed)} failed"))
    checks.append(("invalid requests got 4xx JSON errors", not [r for r in failed if r.spec.expect == "error"],
                   f"{sum(r.spec.expect == 'error' for r in failed)} failed"))
    checks.append(("disconnecting clients handled", not [r for r in failed if r.spec.expect == "disconnect"],
                   f"{sum(r.spec.expect == 'disconnect' for r in failed)} failed"))
    checks.append(("response ids unique", not dup, f"{len(dup)} duplicated"))
    for name in ("ferry:num_requests_running", "ferry:num_requests_waiting", "ferry:kv_cache_usage_perc"):
        v = idle.get(name)
        checks.append((f"idle {name.split(':')[1]} == 0", v == 0, f"{v}"))
    if growth is None:
        checks.append(("RSS growth after warm-up", rss["start"] is None, "RSS not measurable"
                       if rss["start"] is None else "no warm-up sample"))
    else:
        checks.append((f"RSS growth after warm-up < {args.max_rss_growth_mb:.0f} MB",
                       growth < args.max_rss_growth_mb, f"{growth:+.0f} MB"))
    if capped and len(results) < warmup_n:
        checks.append(("warm-up reached before --max-duration", False, f"{len(results)} < {warmup_n}"))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", "-n", type=int, default=2000, help="requests to send (default 2000)")
    ap.add_argument("--concurrency", "-c", type=int, default=12, help="requests in flight at once (default 12)")
    ap.add_argument("--max-duration", type=float, default=1800,
                    help="stop sending new requests after this many seconds (default 1800)")
    ap.add_argument("--request-timeout", type=float, default=300, help="seconds one request may take (default 300)")
    ap.add_argument("--warmup-frac", type=float, default=0.15,
                    help="RSS growth is measured from after this fraction of the requests (default 0.15)")
    ap.add_argument("--max-rss-growth-mb", type=float, default=300,
                    help="fail if the server's RSS grows more than this after warm-up (default 300)")
    ap.add_argument("--max-prompt-words", type=int, default=1500, help="longest prompt, in words (default 1500)")
    ap.add_argument("--mix", default="", help="override request-kind weights, e.g. 'invalid=0,chat_json=5' "
                                              f"(kinds: {', '.join(MAKERS)})")
    ap.add_argument("--only", default="", help="send only these kinds, e.g. 'chat_json' or 'cmpl,invalid'")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")
    ap.add_argument("--port", type=int, default=0, help="port for the server (default: a free one)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for `ferry serve` (repeat; use --server-arg=--flag for dashes)")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for the server, e.g. MALLOC_ARENA_MAX=2 (repeat)")
    ap.add_argument("--server-cmd", default=None,
                    help="command that runs the ferry CLI, to which 'serve --host ... --port ...' is appended "
                         "(default: the ferry next to this Python, else python -m ferry.cli)")
    ap.add_argument("--startup-timeout", type=float, default=300, help="seconds to wait for /health (default 300)")
    ap.add_argument("--idle-timeout", type=float, default=30,
                    help="seconds to wait for the server to go idle after the load (default 30)")
    ap.add_argument("--server-log", type=Path, default=None,
                    help="where the server's output goes (default: a temp file)")
    ap.add_argument("--show-failures", type=int, default=20, help="failures to print in full (default 20)")
    ap.add_argument("--verbose", "-v", action="store_true", help="print each failure as it happens")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or not 0 <= args.warmup_frac < 1:
        ap.error("--requests and --concurrency must be >= 1 and --warmup-frac in [0, 1)")

    env = dict(kv.split("=", 1) for kv in args.server_env)
    log_path = args.server_log or Path(tempfile.mkstemp(prefix="ferry-soak-", suffix=".log")[1])
    port = args.port or free_port()
    # The prefix cache keeps freed blocks' KV until their memory is needed, so a server's resident
    # cache grows toward kv_cache_memory_gb. A 0.5 GiB cache (more than max_model_len needs) fills
    # during warm-up; RSS growth after it measures leaks, not the cache filling.
    server_args = args.server_arg if any(a.startswith("--kv-cache-memory-gb") or a.startswith("--num-kv-blocks")
                                         for a in args.server_arg) else ["--kv-cache-memory-gb=0.5", *args.server_arg]
    server = Server(port, server_args, env, log_path, args.server_cmd)

    def on_term(*_: Any) -> None:
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGTERM, on_term)
    rc: int | None = None
    checks: list[Check] = []
    results: list[Result] = []
    try:
        rc = asyncio.run(soak(args, server, checks, results))
    except KeyboardInterrupt:
        print(f"\nsoak: interrupted after {len(results)} answers", flush=True)
        if results:
            print_table(results)
            for r in [r for r in results if r.outcome == "failed"][:args.show_failures]:
                print(describe_failure(r))
        rc = 130
    finally:
        exit_code = server.stop()
        signal.signal(signal.SIGTERM, old)
    if rc != 0:
        if rc != 130:
            print(server.log_tail(), flush=True)
        return rc if rc is not None else 1
    checks.append(("server exits 0 on SIGTERM", exit_code == 0,
                   "killed after 30 s" if exit_code is None else f"exit {exit_code}"))
    log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
    tracebacks = log_text.count("Traceback (most recent call last)")
    print(f"server log: {log_path} ({tracebacks} tracebacks)")
    print("\nchecks:")
    for name, ok, detail in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}  ({detail})")
    bad = [c for c in checks if not c[1]]
    print(f"\nsoak: {'FAILED' if bad else 'passed'} ({len(checks) - len(bad)}/{len(checks)} checks)")
    if bad and tracebacks:
        print("last lines of the server log:\n" + "\n".join(log_text.splitlines()[-25:]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
