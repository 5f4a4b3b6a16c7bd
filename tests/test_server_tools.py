"""Tool calling and reasoning through /v1/chat/completions, driven by the official openai SDK against
an in-process server. The model is tiny, so valid calls come from required and named choices,
which the grammar enforces."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.test_server import MODEL, serve_in_thread

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def url(llm):
    from ferry.engine.async_engine import AsyncEngine
    from ferry.engine.llm_engine import LLMEngine
    from ferry.server.app import build_app

    engine = AsyncEngine(LLMEngine.from_config(llm.config, llm.engine.executor))
    with serve_in_thread(build_app(engine, MODEL, reasoning_parser="qwen3")) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _valid(call) -> dict:
    """The call's arguments, checked against its function's schema."""
    from jsonschema import validate

    args = json.loads(call.function.arguments)
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    validate(args, schema)
    return args


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_required_or_named_choice_is_a_valid_call(client, choice):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       max_tokens=60, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.tool_calls and c.message.tool_calls[0].id.startswith("call_")
    for call in c.message.tool_calls:
        _valid(call)
    if choice is NAMED:
        assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_streamed_calls_accumulate_to_valid_json_in_the_sdk(client, choice):
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                        max_tokens=60, temperature=0) as s:
        events = list(s)
        final = s.get_final_completion()
    c = final.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        _valid(call)
    assert any(e.type == "tool_calls.function.arguments.done" for e in events)


def test_named_streaming_sends_openai_deltas(url):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 60,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"].get("tool_calls") for c in chunks if c["choices"]]
    deltas = [item for d in deltas if d for item in d]
    first, rest = deltas[0], deltas[1:]
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert rest and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
    assert len(rest) > 1  # the arguments stream as they are sampled, not in one piece
    json.loads("".join(d["function"]["arguments"] for d in rest))
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_is_one_call(client):
    ask = [{"role": "user", "content": "Weather in Paris, in Rome, and in Oslo? Call get_weather for each."}]
    r = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=0)
    assert len(r.choices[0].message.tool_calls) == 1


def test_a_tool_result_goes_back_and_the_model_answers(client, url):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                       max_tokens=60, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    conv = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    final = client.chat.completions.create(model=MODEL, messages=conv, tools=TOOLS, tool_choice="none",
                                           max_tokens=30, temperature=0)
    c = final.choices[0]
    assert c.message.tool_calls is None and c.message.content and c.finish_reason in ("stop", "length")
    # The call and its result are in the prompt (as /tokenize renders it, the same way).
    t = httpx.post(url + "/tokenize", json={"messages": conv, "return_token_strs": True}, timeout=60).json()
    assert t["count"] == final.usage.prompt_tokens == len(t["tokens"])
    rendered = "".join(t["token_strs"])
    assert '"name": "get_weather"' in rendered and "18 degrees and sunny" in rendered


@pytest.mark.parametrize("body,param,says", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters", "not valid JSON Schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "already constrains"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x",
                                                                                      "format": "wav"}}]}]},
     "messages[0].content", "not supported"),
])
def test_bad_tool_input_is_a_400_naming_the_field(client, body, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and says in err["message"]


THINK = {"guided_regex": "<think>[a-z ]{4,20}</think>\n\nParis is sunny[.]"}  # a thinking model's shape


def test_reasoning_is_split_from_the_answer(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0, extra_body=THINK)
    m = r.choices[0].message
    assert m.content == "Paris is sunny." and m.reasoning_content and "<think>" not in m.reasoning_content
    assert m.reasoning == m.reasoning_content  # vLLM's newer name, too
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                                 stream=True, extra_body=THINK))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == m.reasoning_content
    assert "".join(d.content or "" for d in deltas) == "Paris is sunny."


def test_chat_template_kwargs_reach_the_template():
    from pathlib import Path

    from ferry.model.loader import resolve_model_dir
    from ferry.model.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_dir(None))
    qwen3 = (Path(__file__).with_name("chat_templates") / "Qwen-Qwen3-0.6B.jinja").read_text()
    off = tok.render_chat(ASK, None, chat_template=qwen3, enable_thinking=False)
    on = tok.render_chat(ASK, None, chat_template=qwen3, enable_thinking=True)
    assert off.endswith("<think>\n\n</think>\n\n") and not on.endswith("</think>\n\n")


# ------------------------------------------------------------------ Anthropic's Messages API
WEATHER_ANT = {"name": "get_weather", "description": "The weather in a city",
               "input_schema": WEATHER["function"]["parameters"]}


# Anthropic's SDK 2.x dropped `temperature` from its signature; the body field still reaches the server.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def ant(url):
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)


def test_anthropic_messages_create_and_count_tokens(ant):
    r = ant.messages.create(model=MODEL, max_tokens=12, system="Answer briefly.", extra_body=GREEDY,
                            messages=[{"role": "user", "content": "Name a colour."}])
    assert r.type == "message" and r.role == "assistant" and r.content[0].type == "text" and r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens") and r.usage.output_tokens <= 12
    n = ant.messages.count_tokens(model=MODEL, system="Answer briefly.",
                                  messages=[{"role": "user", "content": "Name a colour."}])
    assert n.input_tokens == r.usage.input_tokens


def test_anthropic_stop_sequences(ant):
    ask = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=[{"role": "user", "content": "Tell me about Paris."}])
    free = ant.messages.create(**ask).content[0].text
    word = free.split()[3]  # greedy, so the same text comes again: stop at its fourth word
    r = ant.messages.create(**ask, stop_sequences=[word])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert r.content[0].text == free[:free.index(word)]


def test_anthropic_stream_event_sequence(ant):
    with ant.messages.stream(model=MODEL, max_tokens=10, extra_body=GREEDY,
                             messages=[{"role": "user", "content": "Name a colour."}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].text and final.usage.output_tokens > 0


def test_anthropic_tool_use_with_any_and_a_result_back(ant):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = ant.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, tools=[WEATHER_ANT],
                            tool_choice={"type": "any"}, messages=ask)
    assert r.stop_reason == "tool_use"
    use = next(b for b in r.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.id.startswith("toolu_") and use.input["city"]
    with ant.messages.stream(model=MODEL, max_tokens=60, extra_body=GREEDY, tools=[WEATHER_ANT],
                             tool_choice={"type": "tool", "name": "get_weather"}, messages=ask) as s:
        final = s.get_final_message()
    streamed = next(b for b in final.content if b.type == "tool_use")
    assert final.stop_reason == "tool_use" and set(streamed.input) == {"city", "unit"}
    back = ask + [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "18 degrees and sunny"}]}]
    after = ant.messages.create(model=MODEL, max_tokens=20, extra_body=GREEDY, tools=[WEATHER_ANT],
                                tool_choice={"type": "none"}, messages=back)
    assert after.content and after.content[0].type == "text"
    assert ant.messages.count_tokens(model=MODEL, messages=back, tools=[WEATHER_ANT]).input_tokens > \
        ant.messages.count_tokens(model=MODEL, messages=ask, tools=[WEATHER_ANT]).input_tokens


@pytest.mark.parametrize("extra,says", [
    ({"tools": [{"name": "f", "input_schema": {"type": "objekt"}}]}, "not valid JSON Schema"),
    ({"tools": [WEATHER_ANT], "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
])
def test_anthropic_bad_input_is_a_400_in_anthropics_shape(ant, extra, says):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(**{"model": MODEL, "max_tokens": 5,
                               "messages": [{"role": "user", "content": "hi"}], **extra})
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert says in body["error"]["message"]


def test_anthropic_validation_errors_have_anthropics_shape(url):
    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]


# ------------------------------------------------------------------ OpenAI's Responses API
RESP_WEATHER = {"type": "function", **WEATHER["function"]}


def test_responses_create_text_and_instructions(client):
    r = client.responses.create(model=MODEL, input="Name a colour.", instructions="Answer in one word.",
                                max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    assert r.output[0].type == "message" and r.usage.output_tokens <= 8
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_responses_stream_events_and_final_text(client):
    with client.responses.stream(model=MODEL, input="Name a colour.", instructions="Answer in one word.",
                                 max_output_tokens=40, temperature=0) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()  # the SDK needs response.completed: the answer ended by itself
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.output_item.done"} <= set(kinds)
    assert final.output_text


def test_responses_function_call_and_its_output_back(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(model=MODEL, input=ask, tools=[RESP_WEATHER], tool_choice="required",
                                max_output_tokens=60, temperature=0)
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "unit"}
    with client.responses.stream(model=MODEL, input=ask, tools=[RESP_WEATHER], max_output_tokens=60,
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    streamed = next(o for o in final.output if o.type == "function_call")
    assert "response.function_call_arguments.delta" in kinds and json.loads(streamed.arguments)["city"]
    back = ask + [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                  {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}]
    after = client.responses.create(model=MODEL, input=back, tools=[RESP_WEATHER], tool_choice="none",
                                    max_output_tokens=20, temperature=0)
    alone = client.responses.create(model=MODEL, input=ask, tools=[RESP_WEATHER], tool_choice="none",
                                    max_output_tokens=1, temperature=0)
    assert after.output_text and after.usage.input_tokens > alone.usage.input_tokens + 10  # call and output rendered


def test_responses_are_stored_and_continued_with_previous_response_id(client, llm):
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hi.", instructions="Be brief.",
                                    max_output_tokens=6, temperature=0)
    assert first.store and client.responses.retrieve(first.id).output_text == first.output_text
    follow = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    assert follow.previous_response_id == first.id
    # The same conversation sent whole: the same prompt (instructions are not carried over), the same answer.
    whole = [{"role": "user", "content": "My name is Ada. Say hi."},
             {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}]
    again = client.responses.create(model=MODEL, input=whole, max_output_tokens=6, temperature=0, store=False)
    assert again.usage.input_tokens == follow.usage.input_tokens and again.output_text == follow.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(again.id)  # store=False kept nothing
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id=first.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_the_response_store_is_bounded():
    from ferry.server.openai.response_store import ResponseStore

    store = ResponseStore(max_entries=3, max_bytes=2000)
    for i in range(5):
        store.put(f"r{i}", {"id": f"r{i}"}, [{"text": "x" * 100}])
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.get("r2")  # used: the least recently used goes first
    store.put("big", {"id": "big"}, [{"text": "y" * 900}])
    assert store.get("r2") is not None and store.get("r3") is None
    store.put("huge", {}, [{"text": "z" * 5000}])  # over the whole bound: not kept
    assert store.get("huge") is None and store._bytes <= 2000


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [RESP_WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
])
def test_responses_bad_input_is_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra})
    assert e.value.body["param"] == param


def test_metrics_count_requests_by_endpoint(client, url):
    def count(endpoint: str, status: str) -> float:
        text = httpx.get(url + "/metrics", timeout=30).text
        line = next((ln for ln in text.splitlines() if ln.startswith("ferry:http_requests_total{")
                     and f'endpoint="{endpoint}"' in ln and f'status="{status}"' in ln), None)
        return float(line.rsplit(" ", 1)[1]) if line else 0.0

    before_ok, before_bad = count("/v1/responses", "200"), count("/v1/messages", "400")
    client.responses.create(model=MODEL, input="hi", max_output_tokens=1)
    httpx.post(url + "/v1/messages", json={"messages": []}, timeout=30)
    httpx.get(url + "/no/such/path", timeout=30)
    assert count("/v1/responses", "200") == before_ok + 1 and count("/v1/messages", "400") == before_bad + 1
    assert count("other", "404") >= 1


def test_tokenize_and_detokenize_round_trip(url):
    t = httpx.post(url + "/tokenize", json={"prompt": "The ferry left at dawn.", "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] == 8192
    back = httpx.post(url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert back["prompt"] == "The ferry left at dawn."
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(url + "/tokenize", json={"prompt": "x", "messages": ASK})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]


def test_a_tool_schema_the_grammar_engine_refuses_runs_unconstrained_under_auto(client):
    """Under auto the structural tag is a help, not a condition: a schema JSON Schema accepts but
    xgrammar cannot compile (a look-behind in a pattern) leaves the call unconstrained, not a 400."""
    odd = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "(?<=x)y"}}}}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Look up code 7."}],
                                       tools=[odd], tool_choice="auto", max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
