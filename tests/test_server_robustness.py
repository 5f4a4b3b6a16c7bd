"""What a serving engine is trusted for, against a real `ferry serve` process on 127.0.0.1:
disconnects abort, oversized input is refused fast, the API refuses what it cannot honour, every
error has one body shape, and shutdown ends every stream in good order."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.test_server import MODEL, metric, server, wait_idle

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded():
    with server("--api-key", KEY, "--max-waiting-requests", "8", "--max-request-bytes", "1000000",
                "--allowed-origins", "http://ui.example") as proc:
        yield proc.url


def post(url: str, path: str, body: dict | str, headers: dict | None = None, timeout: float = 120) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(url + path, content=content, timeout=timeout,
                      headers={"content-type": "application/json", **AUTH, **(headers or {})})


def assert_error(r: httpx.Response, status: int, param: str | None = None, says: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    assert says in err["message"], err
    return err


# ---------------------------------------------------------------- input the engine must refuse up front
@pytest.mark.parametrize("body,param,says", [
    ({"prompt": "hi", "seed": 2**64}, "seed", "64-bit"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens", "valid integer"),
    ({"prompt": [True, False]}, "prompt", ""),
    ({"prompt": "hi", "temperature": float("inf")}, "temperature", "finite"),
    ({"prompt": "hi", "presence_penalty": "1e309"}, "presence_penalty", ""),
    ({"prompt": "hi", "n": 2, "best_of": 3}, "best_of", "not supported"),
    ({"prompt": "hi", "suffix": "!"}, "suffix", "not supported"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "0 only with echo"),
    ({"prompt": "hi", "logit_bias": {"49152": 5}}, "logit_bias", "[0, 49152)"),
    ({"prompt": "hi", "response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "one"),
])
def test_bad_completion_fields_are_400s_naming_the_field(guarded, body, param, says):
    raw = json.dumps(body).replace('"1e309"', "1e309")
    assert_error(post(guarded, "/v1/completions", raw), 400, param, says)


@pytest.mark.parametrize("body,param,says", [
    ({"max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
    ({"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens", ">= 1"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools[0].function.parameters", "not valid JSON Schema"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
])
def test_bad_chat_fields_are_400s_naming_the_field(guarded, body, param, says):
    r = post(guarded, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
    assert_error(r, 400, param, says)


def test_max_completion_tokens_wins_over_max_tokens(guarded):
    r = post(guarded, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to fifty."}],
                                               "max_completion_tokens": 3, "max_tokens": 40, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_lone_surrogates_are_a_400_not_a_500(guarded):
    raw = '{"prompt": "hi \\ud800 there", "max_tokens": 2}'
    assert_error(post(guarded, "/v1/completions", raw), 400, "prompt", "surrogate")
    raw = '{"messages": [{"role": "user", "content": "\\udfff"}]}'
    assert_error(post(guarded, "/v1/chat/completions", raw), 400, "messages", "surrogate")


def test_a_request_that_can_never_be_queued_is_a_400_not_a_503(guarded):
    # 3 prompts x n=3 = 9 sequences, over --max-waiting-requests 8 even on an idle server.
    err = assert_error(post(guarded, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 3}), 400, "n")
    assert "--max-waiting-requests 8" in err["message"]


def test_every_error_has_the_openai_body(guarded):
    assert_error(httpx.get(guarded + "/no/such/route", headers=AUTH), 404)
    assert_error(httpx.get(guarded + "/no/such/route"), 401)  # the key guards every route, known or not
    assert_error(httpx.delete(guarded + "/health"), 405)
    assert_error(post(guarded, "/v1/completions", "{not json"), 400, None, "malformed JSON")
    assert_error(post(guarded, "/v1/completions", "[1, 2]"), 400)
    assert_error(httpx.post(guarded + "/v1/completions", content=b"prompt=hi", headers=AUTH), 400)
    assert_error(httpx.get(guarded + "/v1/models/other-model", headers=AUTH), 404, "model")


def test_models_health_auth_docs_and_cors(guarded):
    assert httpx.head(guarded + "/health").status_code == 200
    card = httpx.get(guarded + f"/v1/models/{MODEL}", headers=AUTH).json()
    assert card["id"] == MODEL and card["max_model_len"] == 8192  # SmolLM2's max_position_embeddings
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert httpx.get(guarded + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    assert_error(httpx.get(guarded + "/v1/models", headers={"Authorization": f"Bearer {KEY}x"}), 401)
    for page in ("/docs", "/openapi.json"):
        assert_error(httpx.get(guarded + page), 401)
        assert httpx.get(guarded + page, headers=AUTH).status_code == 200
    pre = httpx.options(guarded + "/v1/completions", headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.example"
    other = httpx.get(guarded + "/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_logit_bias_steers_greedy_output(guarded):
    base = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = post(guarded, "/v1/completions", base).json()["choices"][0]["text"]
    forced = post(guarded, "/v1/completions", {**base, "logit_bias": {"21285": 100}}).json()  # " banana"
    assert "banana" not in plain and forced["choices"][0]["text"] == " banana" * 4


# ---------------------------------------------------------------- oversized input
def test_oversized_bodies_are_413_and_huge_prompts_fail_fast_while_health_answers(guarded):
    big = json.dumps({"prompt": "x " * 600_000})  # 1.2 MB, over this server's 1 MB limit
    assert_error(post(guarded, "/v1/completions", big), 413, None, "--max-request-bytes")

    def chunks():
        yield big[:500_000].encode()
        yield big[500_000:].encode()

    r = httpx.post(guarded + "/v1/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert_error(r, 413)  # no Content-Length: counted as it arrives

    # Under the body limit but obviously over max_model_len: refused before tokenizing it all.
    long_text = "word " * 190_000
    t0 = time.perf_counter()
    assert_error(post(guarded, "/v1/completions", {"prompt": long_text, "max_tokens": 1}), 400, "prompt",
                 "max_model_len")
    assert time.perf_counter() - t0 < 1.0

    # Prompts that must be tokenized to be refused do it off the event loop and outside the engine.
    stop = threading.Event()
    worst = []

    def probe():
        while not stop.is_set():
            t = time.perf_counter()
            assert httpx.get(guarded + "/health", timeout=5).status_code == 200
            worst.append(time.perf_counter() - t)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    senders = [threading.Thread(target=lambda: post(guarded, "/v1/completions", {"prompt": "ab " * 150_000,
                                                                                 "max_tokens": 1}))
               for _ in range(4)]
    for s in senders:
        s.start()
    for s in senders:
        s.join()
    stop.set()
    prober.join()
    assert max(worst) < 1.0, max(worst)


# ---------------------------------------------------------------- disconnects
def _raw_post(url: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_a_non_streaming_client_that_leaves_aborts_its_request(guarded):
    before = metric(guarded, "ferry:request_success_total", 'finished_reason="abort"')
    tokens_before = metric(guarded, "ferry:generation_tokens_total")
    sock = _raw_post(guarded, {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True})
    deadline = time.time() + 30
    while metric(guarded, "ferry:num_requests_running") == 0:
        assert time.time() < deadline
        time.sleep(0.05)
    sock.close()
    wait_idle(guarded, timeout=20)
    # Stopped early: before the fix it ran all 3000 tokens (over a minute here) for no one.
    assert metric(guarded, "ferry:generation_tokens_total") - tokens_before < 1000
    assert metric(guarded, "ferry:request_success_total", 'finished_reason="abort"') == before + 1


# ---------------------------------------------------------------- shutdown
def test_shutdown_past_the_timeout_ends_streams_with_an_error_and_done():
    with server("--shutdown-timeout", "1", "--log-level", "info") as proc:
        url = proc.url
        lines: list[str] = []
        plain: dict = {}

        def stream():
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "prompt": "Once", "max_tokens": 4000, "ignore_eos": True, "stream": True}) as s:
                lines.extend(line for line in s.iter_lines() if line)

        def nonstream():
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"prompt": "Once", "max_tokens": 4000, "ignore_eos": True})
            plain.update(status=r.status_code, body=r.json())

        threads = [threading.Thread(target=stream), threading.Thread(target=nonstream)]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while metric(url, "ferry:num_requests_running") < 2:
            assert time.time() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for t in threads:
            t.join(10)
        log = proc.stdout.read()
    assert lines[-1] == "data: [DONE]"
    assert "aborted" in json.loads(lines[-2].removeprefix("data: "))["error"]["message"]
    assert plain["status"] == 503 and plain["body"]["error"]["code"] == "aborted"
    assert "2 request(s) still running after 1 s were aborted" in log
    assert "CancelledError" not in log and "Traceback" not in log


# ---------------------------------------------------------------- an unexpected error, in process
def test_an_unexpected_error_is_a_json_500_and_the_server_goes_on(llm):
    from ferry.engine.async_engine import AsyncEngine
    from ferry.engine.llm_engine import LLMEngine
    from ferry.server.app import build_app
    from tests.test_server import serve_in_thread

    engine = AsyncEngine(LLMEngine.from_config(llm.config, llm.engine.executor))
    submit = engine.submit

    async def buggy_submit(subs):  # a bug the server does not expect, for one prompt only
        if subs[0].prompt == "boom":
            raise RuntimeError("unexpected")
        return await submit(subs)

    engine.submit = buggy_submit
    with serve_in_thread(build_app(engine, MODEL), "critical") as url, \
            httpx.Client(base_url=url, timeout=60) as client:  # one kept-alive connection
        for _ in range(2):
            bad = client.post("/v1/completions", json={"prompt": "boom", "max_tokens": 2})
            assert_error(bad, 500, None, "internal error: RuntimeError")
            ok = client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_anthropic_clients_authenticate_with_x_api_key(guarded):
    import anthropic

    good = anthropic.Anthropic(base_url=guarded, api_key=KEY, max_retries=0)
    assert good.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
    bad = anthropic.Anthropic(base_url=guarded, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
