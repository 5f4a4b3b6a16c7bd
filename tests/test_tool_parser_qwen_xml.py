"""The XML call format of Qwen3.5 / Qwen3.6 / Qwen3-Coder (``<tool_call><function=NAME><parameter=KEY>
value</parameter></function></tool_call>``) as such a model writes it after Qwen3.5's chat template:
each text streamed token by token, character by character and read whole, the three agreeing;
values typed by the tool's schema; calls in the think block, content before a call, a call missing
its opening tag; the format chosen from the template; and the chat route end to end against a
real `ferry serve` (the model made to write the text by a regex)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from ferry.server.openai.chat import ChoiceText, tool_overrides
from ferry.server.tools.parsers import PARSERS, extract, parser_for_template
from ferry.server.tools.render import with_tools
from ferry.server.tools.spec import tool_spec
from tests.test_tool_call_recovery import both, first_arguments_chunk, streamed, token_pieces

TEMPLATES = Path(__file__).with_name("chat_templates")
QWEN35 = "Qwen3.5-4B.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
PLAN = {"type": "function", "function": {"name": "plan_trip", "description": "Plan a trip",
        "parameters": {"type": "object", "properties": {
            "days": {"type": "integer"}, "budget": {"type": "number"}, "refundable": {"type": "boolean"},
            "options": {"type": "object"}, "stops": {"type": "array", "items": {"type": "string"}},
            "notes": {"type": "string"}, "travellers": {"type": ["integer", "null"]}, "count": {"type": "integer"}}}}}
TOOLS = [WEATHER, TIME, PLAN]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def call(name: str, **params: str) -> str:
    """A call as Qwen3.5's template writes one: each value between line breaks."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


PARIS = call("get_weather", city="Paris", days="3")
NOTES = "Pack light.\nIf a < b, take <b>both</b> trains </p> <parameter\n"  # its own last line break kept


@pytest.fixture(scope="module")
def tok(embedded_dir):
    from ferry.model.tokenizer import load_tokenizer

    return load_tokenizer(embedded_dir)


@pytest.fixture(scope="module")
def qwen(tok):
    """Qwen3.5's prompt with the tools (its template opens the think block), and a maker of the
    choice reading a model's text after it, with the parser the template speaks."""
    template = (TEMPLATES / QWEN35).read_text()
    parser = parser_for_template(template).name
    conv, tools = with_tools(ASK, tool_spec(TOOLS, "auto", None), template)
    ids = tok.encode(tok.render_chat(conv, tools, chat_template=template))
    ctx = SimpleNamespace(reasoning_parser="qwen3", tokenizer=tok)
    return lambda: ChoiceText(ctx, tool_spec(TOOLS, "auto", None), PARSERS[parser], ids)


def test_one_call_after_the_think_block(tok, qwen):
    got = both(tok, qwen, f"The user wants Paris.\n</think>\n\n{PARIS}")
    assert got == {"reasoning": "The user wants Paris.\n", "content": None,
                   "calls": [("get_weather", {"city": "Paris", "days": 3})]}


def test_two_calls(tok, qwen):
    text = f"Both, then.\n</think>\n\n{PARIS}\n{call('get_time', zone='CET')}"
    got = both(tok, qwen, text)
    assert got["content"] is None and got["calls"] == [("get_weather", {"city": "Paris", "days": 3}),
                                                       ("get_time", {"zone": "CET"})]


def test_values_are_typed_by_the_schema(tok, qwen):
    text = "Planning.\n</think>\n\n" + call(
        "plan_trip", days="5", budget="1234.5", refundable="true", options='{"seat": "window", "meals": [1, 2]}',
        stops='[\n  "Lyon",\n  "Nice"\n]', notes=NOTES, travellers="null", count="a few")
    got = both(tok, qwen, text)
    assert got["content"] is None and got["calls"] == [("plan_trip", {
        "days": 5, "budget": 1234.5, "refundable": True, "options": {"seat": "window", "meals": [1, 2]},
        "stops": ["Lyon", "Nice"], "notes": NOTES, "travellers": None, "count": "a few"})]  # not JSON: as written


def test_a_call_inside_the_think_block(tok, qwen):
    got = both(tok, qwen, f"I need the weather.\n{PARIS}\n</think>\n\n")
    assert got["calls"] == [("get_weather", {"city": "Paris", "days": 3})] and got["content"] is None
    assert got["reasoning"].strip() == "I need the weather."


def test_content_before_a_call(tok, qwen):
    got = both(tok, qwen, f"Easy.\n</think>\n\nLet me check the weather in Paris.\n\n{PARIS}")
    assert got["content"] == "Let me check the weather in Paris.\n\n"
    assert got["calls"] == [("get_weather", {"city": "Paris", "days": 3})]


def test_a_call_missing_its_opening_tag(tok, qwen):
    bare = PARIS.removeprefix("<tool_call>\n")
    got = both(tok, qwen, f"Paris.\n</think>\n\n{bare}")
    assert got["calls"] == [("get_weather", {"city": "Paris", "days": 3})] and got["content"] is None
    got = both(tok, qwen, f"Paris.\n</think>\n\nI will check.\n{bare}\n{call('get_time', zone='CET')}")
    assert got["content"] == "I will check.\n\n"
    assert got["calls"] == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]
    # Not a call: a function not offered, or no closing tag after it; the text stays as written.
    for answer in (call("get_stock", ticker="X").removeprefix("<tool_call>\n"),
                   bare.removesuffix("\n</tool_call>") + " is how I would ask."):
        got = both(tok, qwen, f"Hm.\n</think>\n\n{answer}")
        assert got["calls"] == [] and got["content"] == answer, answer


LONG = "Saint-Martin-de-Belleville in the Tarentaise valley"


def test_a_string_value_streams_as_it_is_written(tok, qwen):
    text = "Looking.\n</think>\n\n" + call("get_weather", city=LONG, days="2")
    assert both(tok, qwen, text)["calls"] == [("get_weather", {"city": LONG, "days": 2})]
    chunks = token_pieces(tok, text)
    assert streamed(qwen, chunks + [""])["pieces"][0] >= 5
    first = first_arguments_chunk(qwen, chunks)
    assert first is not None and first < len(chunks) - 5  # long before the call is complete


def test_the_format_is_chosen_from_the_template_and_reads_back_what_it_renders(tok):
    """Qwen3.5's template speaks this format (others keep theirs), and a call it renders in the
    conversation parses back to the same arguments, values typed."""
    template = (TEMPLATES / QWEN35).read_text()
    assert parser_for_template(template).name == "qwen3_xml" and PARSERS["qwen3_coder"] is PARSERS["qwen3_xml"]
    for other in ("Qwen-Qwen3-0.6B.jinja", "Qwen-QwQ-32B.jinja", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"):
        assert parser_for_template((TEMPLATES / other).read_text()).name == "hermes", other
    args = {"days": 4, "budget": 99.5, "refundable": False, "options": {"seat": "aisle"}, "stops": ["Lyon"],
            "notes": NOTES}
    conv = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "plan_trip", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "booked"}]
    spec = tool_spec(TOOLS, "auto", None)
    conv, tools = with_tools(conv, spec, template)
    rendered = tok.render_chat(conv, tools, chat_template=template)
    written = re.search(r"<tool_call>\n<function=plan_trip>.*?</tool_call>", rendered, re.S).group(0)
    schemas = {f.name: f.parameters for f in spec.functions}
    content, calls = extract(PARSERS["qwen3_xml"], written, spec.names, schemas)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("plan_trip", args)]


def test_required_and_named_choices_read_the_grammar_json_with_this_parser(tok):
    """tool_choice required / named: the grammar makes the model write JSON, read whatever the
    format; under auto no structural tag (it would hold JSON, not parameter tags)."""
    parser = PARSERS["qwen3_xml"]
    ctx = SimpleNamespace(reasoning_parser="qwen3", tokenizer=tok)
    required = tool_spec(TOOLS, "required", None)
    assert tool_overrides(required, parser) == {"structured_outputs": required.grammar()}
    assert tool_overrides(tool_spec(TOOLS, "auto", None), parser) == {}
    text = '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'
    got = both(tok, lambda: ChoiceText(ctx, required, parser), text)
    assert got["calls"] == [("get_weather", {"city": "Paris", "days": 3})] and got["content"] is None
    named = tool_spec(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)
    got = both(tok, lambda: ChoiceText(ctx, named, parser), '{"zone": "CET"}')
    assert got["calls"] == [("get_time", {"zone": "CET"})] and got["content"] is None


# ------------------------------------------------------------------ the chat route, end to end
@pytest.fixture(scope="module")
def server():
    from tests.test_server_hardening import logged_server

    with logged_server("--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3") as proc:
        yield proc


def _ask(server, stream: bool, **body) -> dict:
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 120, "temperature": 0, "stream": stream, **body}
    if not stream:
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300).json()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        return {"chunks": [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]}


def test_chat_route_reads_the_xml_calls_whole_and_streamed(server):
    said = f"<think>\nParis.\n</think>\n\n{call('get_weather', city=LONG, days='3')}"
    c = _ask(server, False, guided_regex=re.escape(said))["choices"][0]
    m = c["message"]
    assert m["content"] is None and c["finish_reason"] == "tool_calls", c
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in m["tool_calls"]] == \
        [("get_weather", {"city": LONG, "days": 3})]
    deltas = [ch["choices"][0]["delta"] for ch in _ask(server, True, guided_regex=re.escape(said))["chunks"]
              if ch["choices"]]
    args = [t["function"]["arguments"] for d in deltas for t in d.get("tool_calls") or []
            if t["function"].get("arguments")]
    assert len(args) > 3 and json.loads("".join(args)) == {"city": LONG, "days": 3}  # in pieces, as sampled
    assert not any(d.get("content") for d in deltas)


def test_chat_route_takes_a_required_call_with_this_parser(server):
    c = _ask(server, False, tool_choice="required", tools=[WEATHER])["choices"][0]
    assert c["message"]["content"] is None and c["message"]["tool_calls"], c
    f = c["message"]["tool_calls"][0]["function"]
    assert f["name"] == "get_weather" and "city" in json.loads(f["arguments"])  # the grammar's JSON, read
