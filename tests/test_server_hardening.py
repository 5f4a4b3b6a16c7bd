"""Hardening: what an attacker or a careless client tried against a real `ferry serve`
on 127.0.0.1 that once stalled or corrupted other requests, or leaked the key."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.test_server import free_port, metric, wait_until_up

KEY = "s3cret-t0ken"  # holds no "key": a query that spells the name otherwise must still be caught
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 100_000  # --max-request-bytes
ORIGIN = "http://app.example"  # --allowed-origins


@contextmanager
def logged_server(*extra: str):
    """A `ferry serve` whose output (the access log included) goes to a file the test can read."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    proc = subprocess.Popen([sys.executable, "-m", "ferry.cli", "serve", "--port", str(port), "--log-level", "info",
                             *extra], stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    proc.log = lambda: open(log.name).read()  # type: ignore[attr-defined]
    try:
        wait_until_up(proc, proc.url, 180)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def srv():
    with logged_server("--api-key", KEY, "--max-request-bytes", str(LIMIT), "--allowed-origins", ORIGIN) as proc:
        yield proc


def completion(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=timeout)


def raw_http(url: str, data: bytes, read_timeout: float = 10) -> bytes:
    """Send raw bytes on one connection; everything the server sends back until it closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as s:
        s.sendall(data)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except socket.timeout:
            pass
    return b"".join(chunks)


# ---------------------------------------------------------------- 2. tiny temperatures
@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 1e-300, 9.9e-6])
def test_a_tiny_positive_temperature_is_greedy_not_token_zero(srv, temperature):
    body = {"prompt": "The capital of France is", "max_tokens": 8, "ignore_eos": True}
    greedy = completion(srv.url, {**body, "temperature": 0}).json()["choices"][0]
    tiny = completion(srv.url, {**body, "temperature": temperature}).json()["choices"][0]
    assert tiny["text"] == greedy["text"] and tiny["text"].strip()


def test_the_smallest_sampling_temperature_samples_finite_probabilities():
    import torch

    from ferry.core.sampling_params import MIN_TEMPERATURE, SamplingParams

    assert SamplingParams(temperature=MIN_TEMPERATURE * 0.99).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    # At the floor the division the sampler does cannot overflow, even with a +100 logit bias.
    logits = torch.tensor([130.0, -130.0, 129.99, 0.0])
    probs = torch.softmax(logits / MIN_TEMPERATURE, dim=-1)
    assert torch.isfinite(probs).all() and int(probs.argmax()) == 0


# ---------------------------------------------------------------- 4. min_tokens that can never be met
@pytest.mark.parametrize("extra", [{"min_tokens": 10**12, "max_tokens": None}, {"min_tokens": 9, "max_tokens": 3},
                                   {"min_tokens": 8190, "max_tokens": None}])
def test_min_tokens_that_can_never_be_met_is_a_400(srv, extra):
    r = completion(srv.url, {"prompt": "Hello there, how are", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "min_tokens", r.text


# ---------------------------------------------------------------- 5. the key never reaches the log
@pytest.mark.parametrize("method,path", [("HEAD", "/dashboard"), ("GET", "/dashboard/"), ("GET", "/v1/models"),
                                         ("POST", "/v1/completions"), ("GET", "/dashboard")])
def test_a_key_in_any_query_string_never_reaches_the_access_log(srv, method, path):
    secret = f"leak{abs(hash((method, path))) % 10**8}"
    r = httpx.request(method, f"{srv.url}{path}?a=1&key={secret}", timeout=30,
                      json={"prompt": "hi", "max_tokens": 1} if method == "POST" else None)
    assert r.status_code == 401  # a wrong key, and only GET /dashboard takes one in the query
    time.sleep(0.3)
    log = srv.log()
    assert f"{method} {path}?a=1 HTTP/1.1" in log, log[-2000:]
    assert secret not in log


def test_the_right_key_in_the_query_still_opens_the_dashboard(srv):
    r = httpx.get(f"{srv.url}/dashboard?key={KEY}", timeout=30)
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    time.sleep(0.3)
    assert KEY not in srv.log()


# ---------------------------------------------------------------- 7. protocol gaps
def test_head_is_allowed_wherever_get_is(srv):
    for path in ("/metrics", "/v1/models", "/health"):
        get = httpx.get(srv.url + path, headers=AUTH, timeout=30)
        head = httpx.head(srv.url + path, headers=AUTH, timeout=30)
        assert head.status_code == get.status_code == 200, (path, head.status_code)
        assert head.content == b""


def test_an_unknown_http_version_is_a_505(srv):
    out = raw_http(srv.url, b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 505"), out[:200]


def test_a_413_says_connection_close_and_never_reads_the_next_request_as_body(srv):
    # A declared over-limit body, then a second request on the same socket: it must not be answered
    # as if it were part of the first's body, and the socket closes after the 413.
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {LIMIT + 1}\r\n\r\n").encode()
    nxt = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    out = raw_http(srv.url, head + nxt)
    assert out.startswith(b"HTTP/1.1 413"), out[:300]
    assert b"connection: close" in out.lower()
    assert out.count(b"HTTP/1.1 ") == 1


@pytest.mark.parametrize("size", [LIMIT + 1, 4 * 2**20])
def test_a_client_that_sends_an_over_limit_body_whole_reads_the_413(srv, size):
    # urllib (like httpx and the openai SDK) sends the whole body before reading, without
    # Expect: 100-continue: closing while it still sends resets the connection under it.
    req = urllib.request.Request(srv.url + "/v1/completions", data=b"x" * size, method="POST",
                                 headers={**AUTH, "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 413
    assert "--max-request-bytes" in json.loads(e.value.read())["error"]["message"]
    r = httpx.post(srv.url + "/v1/completions", content=b"y" * size, headers=AUTH, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


# ---------------------------------------------------------------- 6. /health while draining
def test_health_is_503_from_the_first_second_of_the_drain():
    with logged_server("--shutdown-timeout", "20") as proc:
        url = proc.url
        busy = subprocess.Popen([sys.executable, "-c", f"import httpx; httpx.post('{url}/v1/completions', "
                                 "json={'prompt': 'Once', 'max_tokens': 3000, 'ignore_eos': True}, timeout=60)"])
        try:
            deadline = time.time() + 60
            while metric(url, "ferry:num_requests_running") < 1:
                assert time.time() < deadline
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            r = httpx.get(url + "/health", timeout=5)
            assert r.status_code == 503, r.text
            assert "draining" in r.text
            assert proc.poll() is None  # still finishing the request in flight
        finally:
            busy.kill()
            busy.wait()


# ---------------------------------------------------------------- 1. grammar compiles
def slow_regex(n: int) -> str:
    return f"[^x]{{0,{n}}}[0-9]{{0,{n}}}"  # a few bytes, seconds to compile


def compiling(pid: int) -> int:
    """Threads of server ``pid`` below its main thread's CPU priority: its grammar compiles still
    running (a compile thread is demoted to the lowest priority after a fraction of a second)."""
    def nice(stat: Path) -> int | None:
        try:
            return int(stat.read_text().rsplit(")", 1)[1].split()[16])  # field 19 of proc(5)'s stat
        except (OSError, IndexError, ValueError):  # the thread just ended
            return None

    main = nice(Path(f"/proc/{pid}/stat"))
    if main is None or main >= 19:
        pytest.skip("the server runs at the lowest priority already: its compile threads cannot be told apart")
    threads = [nice(stat) for stat in Path(f"/proc/{pid}/task").glob("*/stat")]
    return sum(1 for n in threads if n is not None and n > main)


def test_grammar_compiles_never_delay_requests_without_one():
    """Eight slow grammars at once (six compiles) are each refused at the bound, and requests without
    a grammar are answered after that, while every one of those compiles still runs: no time is compared."""
    bound = 0.5  # a slow pattern takes 2-3.5 s of CPU to compile: far from done at the bound
    with logged_server("--max-grammar-compile-seconds", str(bound)) as proc:
        url = proc.url

        def plain() -> None:
            r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
                           timeout=120)
            assert r.status_code == 200, r.text

        plain()  # warm
        assert compiling(proc.pid) == 0
        answers: list[httpx.Response] = []

        def guided(regex: str) -> None:
            answers.append(httpx.post(url + "/v1/completions", timeout=120, json={
                "prompt": "Hello", "max_tokens": 4, "guided_regex": regex}))

        # Five different slow patterns and three identical ones, sent at once: more than the
        # server has worker threads (6 on 2 cores), which once all waited on compiles.
        regexes = [slow_regex(8000 + i) for i in range(5)] + [slow_regex(9000)] * 3
        threads = [threading.Thread(target=guided, args=(rx,)) for rx in regexes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(answers) == 8
        for r in answers:  # each refused at the bound ...
            assert r.status_code == 400, r.text
            assert "structured_outputs.regex" in r.json()["error"]["message"]
            assert "--max-grammar-compile-seconds" in r.json()["error"]["message"]
        # ... before any of the six compiles ended (their demotion may lag a busy machine's answers).
        deadline = time.time() + 60
        while compiling(proc.pid) < 6:
            assert time.time() < deadline, f"{compiling(proc.pid)} of 6 compiles running after the refusals"
            time.sleep(0.05)
        for _ in range(3):
            plain()
        # Requests without a grammar were answered while all six compiles still ran: none waited for one.
        assert compiling(proc.pid) == 6


def test_identical_grammars_compiling_at_once_compile_once(embedded_dir):
    from ferry.core.sampling_params import StructuredOutputs
    from ferry.executor.structured import GrammarCompiler
    from ferry.model.tokenizer import load_tokenizer

    tok = load_tokenizer(embedded_dir)
    g = GrammarCompiler(tok, 49152, [tok.eos_token_id], max_compile_seconds=60)
    spec = {"type": "object", "properties": {"a": {"enum": [f"v{i}" for i in range(300)]}}, "required": ["a"]}
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(g.compile(StructuredOutputs(json=spec))))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 6 and all(c is got[0] for c in got)
    assert g.num_compiles == 1
    g.close()


def test_a_grammar_over_the_bound_is_refused_and_refused_at_once_when_sent_again(embedded_dir):
    from ferry.core.sampling_params import StructuredOutputs
    from ferry.executor.structured import GrammarCompiler
    from ferry.model.tokenizer import load_tokenizer

    tok = load_tokenizer(embedded_dir)
    g = GrammarCompiler(tok, 49152, [tok.eos_token_id], max_compile_seconds=0.5)
    g.compile(StructuredOutputs(regex="a+"))  # builds the compiler
    spec = StructuredOutputs(regex=slow_regex(3000))
    for _ in range(2):
        t = time.perf_counter()
        with pytest.raises(ValueError, match="--max-grammar-compile-seconds"):
            g.compile(spec)
        took = time.perf_counter() - t
    assert took < 0.1  # the second time: no wait, no second compile
    assert g.num_compiles == 2
    g.close()


# ---------------------------------------------------------------- the key guards every route
@pytest.mark.parametrize("method,path", [
    ("POST", "/tokenize"), ("POST", "/tokenize/"), ("POST", "/%74okenize"), ("POST", "/%74okenize/"),
    ("POST", "/detokenize"), ("POST", "/%64etokenize"), ("POST", "/v1/embeddings"), ("POST", "/v1/%63ompletions"),
    ("POST", "/v1/messages/count_tokens"), ("POST", "/reset_prefix_cache"), ("GET", "/openapi.json"),
    ("GET", "/docs"), ("GET", "/v1/models/"), ("GET", "/no-such-route"), ("GET", "/health/../tokenize")])
def test_every_route_but_health_and_metrics_needs_the_key(srv, method, path):
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "tokens": [1], "input": "hi"}
    r = httpx.request(method, srv.url + path, json=body if method == "POST" else None, timeout=30)
    assert r.status_code == 401, (path, r.status_code, r.text[:200])
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_health_and_metrics_stay_open_without_the_key(srv):
    for path in ("/health", "/metrics", "/metrics/"):
        r = httpx.get(srv.url + path, timeout=30, follow_redirects=True)
        assert r.status_code == 200, (path, r.status_code)


@pytest.mark.parametrize("query", ["ke%79={key}", "KEY={key}", "Key={key}", "api_key={key}", "{key}={key}",
                                   "x={key}", "{key}=1", "a=1;token={key}", "auth=Bearer%20{key}",
                                   "auth=Bearer+{key}", "x=%{hex}"])
def test_no_spelling_of_the_key_in_a_query_reaches_the_access_log(srv, query):
    hex_key = "%".join(f"{b:02x}" for b in KEY.encode())
    r = httpx.get(f"{srv.url}/v1/models?a=1&" + query.format(key=KEY, hex=hex_key), timeout=30)
    assert r.status_code == 401  # a key in the query opens only the dashboard page
    time.sleep(0.3)
    assert KEY not in srv.log() and hex_key not in srv.log()


def test_a_cors_preflight_never_logs_a_key_in_its_query(srv):
    r = httpx.options(f"{srv.url}/v1/models?key={KEY}", timeout=30, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "GET"})
    assert r.status_code == 200, r.text  # answered by CORS, before the guard
    time.sleep(0.3)
    assert "OPTIONS /v1/models" in srv.log() and KEY not in srv.log()


# ---------------------------------------------------------------- type-confused input is a 400
@pytest.mark.parametrize("path,body,param", [
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": 5}]}]}, "messages[0].content[0].content"),
    ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/embeddings", {"input": "a\ud800b"}, "input"),
    ("/v1/embeddings", {"input": ["ok", "a\udfffb"]}, "input"),
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 1}, "prompt"),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": []}]}, "messages"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": []}]}, "messages"),
    ("/v1/responses", {"input": "a\ud800b", "max_output_tokens": 1}, "input"),
])
def test_type_confused_input_is_a_400_naming_the_field(srv, path, body, param):
    raw = json.dumps(body)  # json.dumps writes a lone surrogate as its \\ud800 escape, as a client would
    r = httpx.post(srv.url + path, content=raw, headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in (error.get("param") or "") + error["message"], r.text


# ---------------------------------------------------------------- defaults: no key, the 8 MiB limit
@pytest.fixture(scope="module")
def open_srv():
    with logged_server() as proc:
        yield proc


def test_a_body_of_millions_of_tiny_values_is_refused_without_holding_up_health(open_srv):
    url = open_srv.url

    def health() -> float:
        t = time.perf_counter()
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        return time.perf_counter() - t

    baseline = sorted(health() for _ in range(5))[2]
    junk = "[" + "0," * (4 * 2**20 - 40) + "0]"  # 4 million values in 8 MB, under the byte limit
    body = f'{{"prompt": "hi", "max_tokens": 1, "junk": {junk}}}'.encode()
    assert len(body) < 8 * 2**20
    took: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            took.append(health())

    t = threading.Thread(target=probe)
    t.start()
    try:
        for _ in range(4):
            r = httpx.post(url + "/v1/completions", content=body, timeout=120,
                           headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text[:300]
            assert "--max-request-json-values" in r.json()["error"]["message"]
    finally:
        stop.set()
        t.join(60)
    worst = max(took)
    print(f"/health: {baseline * 1000:.1f} ms alone, worst {worst * 1000:.1f} ms beside 8 MB bodies")
    assert worst < max(10 * baseline, 0.3), (baseline, worst)  # parsing one such body took 0.5-2 s


def test_a_body_under_the_value_bound_is_served(open_srv):
    ids = [1] * 100
    r = httpx.post(open_srv.url + "/v1/completions", json={"prompt": ids, "max_tokens": 1, "junk": [0] * 200_000},
                   timeout=120)
    assert r.status_code == 200, r.text[:300]


def test_an_anthropic_assistant_prefill_is_continued(open_srv):
    """A last assistant message is the start of the answer: the reply continues it, as Anthropic's API does."""
    prefill = "The three primary colors are red,"
    msgs = [{"role": "user", "content": "Name the three primary colors."}]
    body = {"max_tokens": 12, "temperature": 0, "messages": msgs + [{"role": "assistant", "content": prefill}]}
    r = httpx.post(open_srv.url + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text = r.json()["content"][0]["text"]
    # The same prompt through /tokenize: the conversation rendered up to the prefill, no new turn opened.
    tok = httpx.post(open_srv.url + "/tokenize", json={"messages": msgs + [{"role": "assistant", "content": prefill}],
                                                       "add_generation_prompt": False, "continue_final_message": True},
                     timeout=60).json()["tokens"]
    want = httpx.post(open_srv.url + "/v1/completions", timeout=120, json={
        "prompt": tok, "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
    assert text == want, (text, want)
    rendered = httpx.post(open_srv.url + "/detokenize", json={"tokens": tok}, timeout=60).json()["prompt"]
    assert rendered.rstrip().endswith(prefill), rendered[-200:]
