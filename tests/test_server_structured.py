"""Structured outputs over HTTP: OpenAI's response_format and vLLM's guided fields, streaming or
not, against a real `ferry serve` process."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_server import server
from tests.test_structured import PROMPT, SCHEMA, _schemas, check, max_tokens_for


@pytest.fixture(scope="module")
def url():
    with server() as proc:
        yield proc.url


def complete(url: str, path: str, body: dict, stream: bool) -> tuple[str, str]:
    """(text, finish_reason) of one request, read from the stream's chunks when streaming."""
    if not stream:
        r = httpx.post(url + path, json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"], choice["finish_reason"]
    text, finish = "", None
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=300) as s:
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    for line in lines[:-1]:
        choice = json.loads(line.removeprefix("data: "))["choices"][0]
        text += choice.get("delta", {}).get("content") or choice.get("text") or ""
        finish = choice["finish_reason"] or finish
    return text, finish


def chat(schema_field: dict, temperature: float, seed: int, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": "Describe a user account as JSON."}],
            "temperature": temperature, "seed": seed, "max_tokens": max_tokens, **schema_field}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_validates(url, stream):
    rf = {"response_format": {"type": "json_schema", "json_schema": {"name": "account", "schema": SCHEMA}}}
    bodies = [chat(rf, 0.0, 0, max_tokens_for(SCHEMA))] + [chat(rf, 1.0, s, max_tokens_for(SCHEMA)) for s in (1, 2)]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda b: complete(url, "/v1/chat/completions", b, stream), bodies))
    for text, finish in results:
        assert finish == "stop", text
        check(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_and_vllm_guided_fields(url, stream):
    obj = complete(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": 'Reply with {"ok": true} only.'}], "max_tokens": 40,
        "response_format": {"type": "json_object"}, "temperature": 0.8, "seed": 3}, stream)
    assert isinstance(json.loads(obj[0]), dict)
    base = {"prompt": PROMPT, "temperature": 1.0, "seed": 5}
    choice, _ = complete(url, "/v1/completions", {**base, "max_tokens": 8, "guided_choice": ["red", "green"]}, stream)
    assert choice in ("red", "green")
    regex, _ = complete(url, "/v1/completions", {**base, "max_tokens": 16, "guided_regex": "[A-Z][a-z]{2,5}-[0-9]{3}"},
                        stream)
    assert re.fullmatch("[A-Z][a-z]{2,5}-[0-9]{3}", regex), regex
    small = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}
    for field in ({"guided_json": small}, {"structured_outputs": {"json": small}}):
        text, _ = complete(url, "/v1/completions", {**base, "max_tokens": 16, **field}, stream)
        check(json.loads(text), small)


def test_invalid_schemas_are_400s_naming_the_field(url):
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "guided_regex": "(unclosed"})
    assert r.status_code == 400 and "structured_outputs.regex" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "response_format": {"type": "json_schema"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


@settings(max_examples=2, deadline=None)
@given(schemas=st.lists(_schemas, min_size=2, max_size=2), seed=st.integers(0, 2**31))
def test_random_schemas_validate_over_http(url, schemas, seed):
    bodies = [(chat({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": sch}}},
                    1.0, seed + i, max_tokens_for(sch)), stream, sch)
              for i, sch in enumerate(schemas) for stream in (False, True)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(lambda b: complete(url, "/v1/chat/completions", b[0], b[1]), bodies))
    for (_, _, sch), (text, finish) in zip(bodies, results):
        assert finish == "stop", text
        check(json.loads(text), sch)
