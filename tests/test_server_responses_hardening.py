"""The Responses API (``POST /v1/responses``) under careless or heavy use, against a real `ferry serve`
on 127.0.0.1 driven by the official openai SDK: stored responses cost the memory they are counted
at, ``text.format`` constrains the output, and type-confused input is a 400 naming the field."""
from __future__ import annotations

import gc
import json
import tracemalloc

import httpx
import openai
import pytest
from jsonschema import validate

from tests.test_server import MODEL, server
from tests.test_structured import SCHEMA, max_tokens_for


@pytest.fixture(scope="module")
def srv():
    with server() as proc:
        yield proc


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def large_input(k: int, n: int, note_bytes: int) -> list[dict]:
    """Input items as a request's parsed JSON holds them: one short message the model reads, then
    ``n`` reasoning items (many small objects, and each a long string) that are never rendered."""
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"My name is Ada{k}."}]}]
    items += [{"type": "reasoning", "id": f"rs_{k}_{i}", "summary": [{"type": "summary_text", "text": f"step {i}"}],
               "content": [{"type": "reasoning_text", "text": "because"}], "encrypted_content": "z" * note_bytes}
              for i in range(n)]
    return json.loads(json.dumps(items))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


# ---------------------------------------------------------------- the store's memory
def test_the_store_counts_the_memory_it_holds_and_drops_the_oldest_first():
    from ferry.server.openai.response_store import ResponseStore

    entry = len(json.dumps(large_input(0, 3000, 100), separators=(",", ":")))
    store = ResponseStore(max_entries=100, max_bytes=int(3.5 * entry))
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for k in range(6):
            items = large_input(k, 3000, 100)
            store.put(f"resp_{k}", {"id": f"resp_{k}", "output": []}, items)
            del items
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert [k for k in range(6) if store.get(f"resp_{k}") is not None] == [3, 4, 5]  # the oldest went first
    counted = store._bytes
    assert counted <= store.max_bytes
    assert counted / 1.25 <= held <= counted * 1.25, (held, counted)  # counted as what it really holds
    assert store.get("resp_5").items == large_input(5, 3000, 100) and store.get("resp_5").body["id"] == "resp_5"


def test_stored_large_inputs_hold_only_what_is_rendered_and_still_continue(srv, client):
    sizes, rss, ids = [], [], []
    for k in range(6):
        body = {"model": MODEL, "input": large_input(k, 15_000, 300), "max_output_tokens": 4, "temperature": 0}
        sizes.append(len(json.dumps(body)))
        r = httpx.post(srv.url + "/v1/responses", json=body, timeout=600)
        assert r.status_code == 200, r.text[:500]
        ids.append(r.json()["id"])
        rss.append(rss_bytes(srv.pid))
    # The first two requests size the allocator's pools (the process's RSS moves by ~10 MB from run
    # to run there); four more stored responses then grow the server by less than one request body
    # each (each held whole once took ~7x its body).
    assert rss[-1] - rss[1] < 4 * max(sizes), ([x >> 20 for x in rss], max(sizes) >> 20)
    last = client.responses.retrieve(ids[-1])
    assert last.output_text and last.id == ids[-1]
    follow = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=ids[-1],
                                     max_output_tokens=8, temperature=0)
    whole = [{"role": "user", "content": "My name is Ada5."}, {"role": "assistant", "content": last.output_text},
             {"role": "user", "content": "What is my name?"}]
    again = client.responses.create(model=MODEL, input=whole, max_output_tokens=8, temperature=0, store=False)
    assert (follow.usage.input_tokens, follow.output_text) == (again.usage.input_tokens, again.output_text)
    # One more turn on the follow-up, which was stored from the parsed-back conversation.
    more = client.responses.create(model=MODEL, input="Say it again.", previous_response_id=follow.id,
                                   max_output_tokens=8, temperature=0)
    whole += [{"role": "assistant", "content": follow.output_text}, {"role": "user", "content": "Say it again."}]
    again = client.responses.create(model=MODEL, input=whole, max_output_tokens=8, temperature=0, store=False)
    assert (more.usage.input_tokens, more.output_text) == (again.usage.input_tokens, again.output_text)


# ---------------------------------------------------------------- text.format
@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema_constrains_the_output_and_is_reported(client, stream):
    fmt = {"type": "json_schema", "name": "account", "schema": SCHEMA, "strict": True}
    kw = {"model": MODEL, "input": "Describe a user account as JSON.", "text": {"format": fmt},
          "max_output_tokens": max_tokens_for(SCHEMA), "temperature": 0}
    if stream:
        events = list(client.responses.create(**kw, stream=True))
        assert events[-1].type == "response.completed", events[-1]
        final = events[-1].response
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == final.output_text
    else:
        final = client.responses.create(**kw)
        text = final.output_text
    assert final.status == "completed"
    validate(json.loads(text), SCHEMA)
    for shown in (final.text.format, client.responses.retrieve(final.id).text.format):
        assert (shown.type, shown.name, shown.schema_, shown.strict) == ("json_schema", "account", SCHEMA, True)


def test_text_format_json_object_and_text(client):
    r = client.responses.create(model=MODEL, input='Reply with {"ok": true} only.', max_output_tokens=40,
                                text={"format": {"type": "json_object"}}, temperature=0)
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict) and r.text.format.type == "json_object"
    plain = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4, temperature=0,
                                    text={"format": {"type": "text"}})
    assert plain.text.format.type == "text" and plain.output_text


@pytest.mark.parametrize("fmt,param", [
    ({"type": "bogus"}, "text.format"),
    ("json", "text.format"),
    ({"type": "json_schema", "name": "x"}, "text.format"),
    ({"type": "json_schema", "name": "x", "schema": 5}, "text.format"),
    ({"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": "yes"}, "text.format"),
    ({"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}, "text.format"),
    ({"type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "(("}}, "text.format"),
])
def test_a_bad_text_format_is_a_400_naming_it(client, fmt, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=4, text={"format": fmt})
    assert e.value.body["param"] == param, e.value.body


def test_text_format_with_a_required_tool_call_is_a_400(client):
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=4, tools=[tool], tool_choice="required",
                                text={"format": {"type": "json_object"}})
    assert e.value.body["param"] == "tool_choice", e.value.body


# ---------------------------------------------------------------- type-confused input
def message(content: object) -> dict:
    return {"type": "message", "role": "user", "content": content}


@pytest.mark.parametrize("items,param", [
    ([message(5)], "input[0].content"),
    ([message(1.5)], "input[0].content"),
    ([message(True)], "input[0].content"),
    ([message({"type": "input_text", "text": "a"})], "input[0].content"),
    ([message([1, 2])], "input[0].content"),
    ([message(["a"])], "input[0].content"),
    ([message([None])], "input[0].content"),
    ([message([[]])], "input[0].content"),
    ([message([{"type": "input_text", "text": 5}])], "input[0].content"),
    ([message("fine"), message([{"type": "input_text", "text": "ok"}, 7])], "input[1].content"),
    ([{"type": "function_call", "call_id": "c1", "name": 5, "arguments": "{}"}], "input[0].name"),
    ([{"type": "function_call", "call_id": "c1", "name": "f", "arguments": 5}], "input[0].arguments"),
    ([{"type": "function_call_output", "call_id": 5, "output": "x"}], "input[0].call_id"),
])
def test_type_confused_input_is_a_400_naming_the_field(srv, items, param):
    r = httpx.post(srv.url + "/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 2},
                   timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    ok = httpx.post(srv.url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2},
                    timeout=120)
    assert ok.status_code == 200, ok.text
