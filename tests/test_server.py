"""The OpenAI-compatible server, as a real process on 127.0.0.1, driven by the official client."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest

from ferry import SamplingParams
from ferry.executor.base import Executor

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(proc: subprocess.Popen, url: str, timeout: float) -> None:
    """Until ``url``/health answers 200; a server that exits or takes longer is an error."""
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            out = proc.stdout.read() if proc.stdout is not None and proc.poll() is not None else ""
            raise RuntimeError(f"server did not start (exit code {proc.poll()}): {out}")
        time.sleep(0.2)


@contextmanager
def serve_in_thread(app, log_level: str = "warning"):
    """An ASGI app served by uvicorn in a thread of this process on 127.0.0.1; yields its URL."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    t = threading.Thread(target=srv.run)
    t.start()
    try:
        deadline = time.time() + 30
        while not srv.started:
            assert time.time() < deadline
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(30)


@contextmanager
def server(*extra: str, env: dict[str, str] | None = None):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ferry.cli", "serve", "--port", str(port), "--log-level",
                             "warning", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, url, 180)
        proc.url = url  # type: ignore[attr-defined]
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def srv():
    with server("--max-num-seqs", "32") as proc:
        yield proc.url


def metric(url: str, name: str, label: str = "") -> float:
    text = httpx.get(url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(url: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (metric(url, "ferry:num_requests_running") == 0 and metric(url, "ferry:num_requests_waiting") == 0
                and metric(url, "ferry:kv_cache_usage_perc") == 0):
            return
        time.sleep(0.1)
    raise AssertionError(httpx.get(url + "/metrics").text)


# ---------------------------------------------------------------- the official client
def test_models_health_and_greedy_equals_llm_generate(srv, llm):
    client = openai.OpenAI(base_url=srv + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(srv + "/health").status_code == 200
    prompt = "The three primary colours are"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode(prompt, add_special_tokens=True))


def test_streaming_equals_non_streaming_and_reports_usage(srv):
    client = openai.OpenAI(base_url=srv + "/v1", api_key="none")
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


def test_raw_stream_is_sse_ending_with_done(srv):
    with httpx.stream("POST", srv + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3,
                                                              "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_chat_sync_and_async_streaming(srv):
    client = openai.OpenAI(base_url=srv + "/v1", api_key="none")
    msgs = [{"role": "user", "content": "Name the capital city of France."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    assert "Paris" in r.choices[0].message.content and r.choices[0].message.role == "assistant"

    async def stream() -> tuple[str, str | None]:
        aclient = openai.AsyncOpenAI(base_url=srv + "/v1", api_key="none")
        parts, role = [], None
        async for c in await aclient.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16,
                                                             temperature=0, stream=True):
            role = role or c.choices[0].delta.role
            parts.append(c.choices[0].delta.content or "")
        await aclient.close()
        return "".join(parts), role

    text, role = asyncio.run(stream())
    assert text == r.choices[0].message.content and role == "assistant"


def test_n_seed_stop_and_logprobs(srv):
    client = openai.OpenAI(base_url=srv + "/v1", api_key="none")
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=12, temperature=1.0, seed=7, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert len(a.choices) == 3 and [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    r = client.completions.create(model=MODEL, prompt="Count: one, two, three, four,", max_tokens=30,
                                  temperature=0, stop=[" six"])
    assert r.choices[0].finish_reason == "stop" and " six" not in r.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Count: one, two, three, four,", max_tokens=30, temperature=0, stop=[" six"], stream=True))
    assert streamed == r.choices[0].text
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) >= 2 for t in lp.top_logprobs)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Hello")


def test_64_concurrent_streams_complete_and_leave_nothing_behind(srv):
    lens = [(5 + 7 * i % 90, 1 + (11 * i) % 40) for i in range(64)]

    async def one(client, i, plen, out_len):
        r = await client.completions.create(model=MODEL, prompt=[100 + i] * plen, max_tokens=out_len,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = None
        async for c in r:
            usage = c.usage or usage
        return usage.completion_tokens

    async def main():
        client = openai.AsyncOpenAI(base_url=srv + "/v1", api_key="none", max_retries=0, timeout=600)
        got = await asyncio.gather(*(one(client, i, p, o) for i, (p, o) in enumerate(lens)))
        await client.close()
        return got

    assert asyncio.run(main()) == [o for _, o in lens]
    wait_idle(srv, timeout=5)


def test_disconnected_streams_are_aborted_and_blocks_return(srv):
    before = metric(srv, "ferry:request_success_total", 'finished_reason="abort"')
    clients = [httpx.Client(timeout=60) for _ in range(4)]
    streams = []
    for c in clients:
        cm = c.stream("POST", srv + "/v1/completions", json={"prompt": [5] * 50, "max_tokens": 2000,
                                                             "ignore_eos": True, "stream": True})
        resp = cm.__enter__()
        it = resp.iter_lines()
        got = 0
        while got < 3:  # a few tokens arrive
            if next(it).startswith("data: "):
                got += 1
        streams.append((cm, it))  # dropping the line iterator would close the connection
    assert metric(srv, "ferry:num_requests_running") == 4
    for (cm, _), c in zip(streams, clients):
        cm.__exit__(None, None, None)
        c.close()
    wait_idle(srv, timeout=20)
    assert metric(srv, "ferry:request_success_total", 'finished_reason="abort"') - before == 4


BAD = [
    ({"model": "gpt-4", "prompt": "hi"}, "model", "gpt-4"),
    ({"max_tokens": 3}, "prompt", "prompt"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens", "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature", "temperature must be >= 0"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
    ({"prompt": "hi", "n": 0}, "n", "n must be"),
    ({"prompt": "hi", "max_tokens": 9000}, "prompt", "more than max_model_len (8192)"),
    ({"prompt": [1, 2, 99999999]}, "prompt", "prompt token ids must be in [0, 49152)"),
]


@pytest.mark.parametrize("body,param,text", BAD)
def test_bad_completion_input_is_a_400_naming_the_field(srv, body, param, text):
    r = httpx.post(srv + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}


def test_bad_chat_input_and_malformed_json(srv):
    r = httpx.post(srv + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(srv + "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.post(srv + "/v1/completions", content=b'{"prompt": "hi", ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=srv + "/v1", api_key="x").completions.create(model=MODEL, prompt="hi", extra_body={"min_p": 3.0})
    # and the server goes on serving
    assert httpx.post(srv + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_api_key_and_overload():
    with server("--api-key", "sekret", "--max-waiting-requests", "1", "--max-num-seqs", "1") as proc:
        url = proc.url
        assert httpx.get(url + "/health").status_code == 200  # open without a key
        r = httpx.get(url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        # One running (max_num_seqs=1), one waiting (the limit): the next is refused with 503.
        hold = {"prompt": [7] * 20, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        auth = {"Authorization": "Bearer sekret"}
        opened = []
        for want_running, want_waiting in ((1, 0), (1, 1)):
            c = httpx.Client(timeout=60)
            cm = c.stream("POST", url + "/v1/completions", json=hold, headers=auth)
            cm.__enter__()
            opened.append((cm, c))
            deadline = time.time() + 30
            while not (metric(url, "ferry:num_requests_running") == want_running
                       and metric(url, "ferry:num_requests_waiting") == want_waiting):
                assert time.time() < deadline
                time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, headers=auth)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "waiting" in r.json()["error"]["message"]
        for cm, c in opened:
            cm.__exit__(None, None, None)
            c.close()
        wait_idle(url)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_sigterm_finishes_in_flight_requests_and_exits_0():
    with server("--shutdown-timeout", "30") as proc:
        result: dict[str, object] = {}

        def stream() -> None:
            with httpx.stream("POST", proc.url + "/v1/completions",
                              json={"prompt": "Tell me a story", "max_tokens": 40, "ignore_eos": True,
                                    "stream": True}, timeout=60) as r:
                result["lines"] = [line for line in r.iter_lines() if line]

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        t.join(10)
        assert result["lines"][-1] == "data: [DONE]"  # the request in flight was finished
        assert '"finish_reason": "length"' in "".join(result["lines"])
        with pytest.raises(httpx.ConnectError):
            httpx.get(proc.url + "/health")


# ---------------------------------------------------------------- a failing step, in process
class FailOnToken(Executor):
    """Wraps the model executor; a step that holds token id 13 raises, as a model bug would."""

    def __init__(self, inner) -> None:
        self.inner = inner
        for name in ("vocab_size", "tokenizer", "eos_token_ids", "num_kv_blocks", "max_model_len"):
            setattr(self, name, getattr(inner, name))

    def execute(self, out):
        self.inner.states.apply(out)  # once per step: the inner executor's own call skips it
        if any(13 in self.inner.states[c.request_id].prompt_token_ids for c in out.chunks):
            raise RuntimeError("injected fault")
        return self.inner.execute(out)


def test_a_failing_step_is_a_500_and_the_server_goes_on(llm):
    import uvicorn

    from ferry.engine.async_engine import AsyncEngine
    from ferry.engine.llm_engine import LLMEngine
    from ferry.server.app import build_app

    engine = LLMEngine.from_config(llm.config, FailOnToken(llm.engine.executor))
    app = build_app(AsyncEngine(engine), MODEL)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run)
    t.start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while not srv.started:
            assert time.time() < deadline
            time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json={"prompt": [13, 14], "max_tokens": 4}, timeout=60)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": [13], "max_tokens": 4, "stream": True},
                          timeout=60) as s:
            lines = [line for line in s.iter_lines() if line]
        assert any("injected fault" in line for line in lines)
        ok = httpx.post(url + "/v1/completions", json={"prompt": [20, 21], "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert engine.kv.pool.num_used == 0
    finally:
        srv.should_exit = True
        t.join(30)


def test_bench_serve_reports_like_bench_online(srv, tmp_path):
    p = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", "serve", "--base-url", srv, "--num-prompts", "6",
                        "--input-len", "20", "--output-len", "5", "--request-rate", "20", "--no-progress",
                        "--output-json", str(tmp_path / "b.json")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    d = json.loads((tmp_path / "b.json").read_text())
    assert d["completed"] == 6 and d["total_output_tokens"] == 30
    assert d["mean_ttft_ms"] > 0 and d["p99_itl_ms"] > 0
    assert re.search(r"TTFT\s+[\d.]+", p.stdout)


def test_prefix_cache_and_speculation_metrics_reset_and_cached_usage():
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    with server("--speculative-config", spec) as proc:
        url = proc.url
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        prompt = "one two three four five, one two three four five, " * 8
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
        assert again.choices[0].text == first.choices[0].text
        # All full blocks but the one holding the last prompt token are reused.
        assert again.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // 16 * 16 > 0
        wait_idle(url)
        assert metric(url, "ferry:prefix_cache_queries_total") == 2 * first.usage.prompt_tokens
        assert metric(url, "ferry:prefix_cache_hits_total") == again.usage.prompt_tokens_details.cached_tokens
        drafts, accepted = metric(url, "ferry:spec_decode_num_draft_tokens_total"), \
            metric(url, "ferry:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= drafts and metric(url, "ferry:spec_decode_num_drafts_total") > 0
        assert metric(url, "ferry:spec_decode_acceptance_rate") == pytest.approx(accepted / drafts)
        assert metric(url, "ferry:generation_tokens_total") == 60
        r = httpx.post(url + "/reset_prefix_cache")
        assert r.status_code == 200 and r.json()["num_blocks_freed"] > 0
        cold = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0 and cold.choices[0].text == first.choices[0].text
