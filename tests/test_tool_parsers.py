"""Tool-call and reasoning parsers on fixed model texts (whole, split across stream chunks, partial,
malformed), and real chat templates rendering tools, calls and results."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferry.server.errors import APIError
from ferry.server.reasoning import REASONING_PARSERS, ReasoningStream
from ferry.server.tools.output import ToolOutput
from ferry.server.tools.parsers import PARSERS, ToolStream, extract, parser_for_template
from ferry.server.tools.render import with_tools
from ferry.server.tools.spec import tool_spec

TEMPLATES = Path(__file__).with_name("chat_templates")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# (parser, model text, content it leaves, calls as (name, arguments))
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
               '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
     "\n", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    ("hermes", 'Unknown tool <tool_call>{"name": "nope", "arguments": {}}</tool_call>',
     'Unknown tool <tool_call>{"name": "nope", "arguments": {}}</tool_call>', []),
    ("hermes", "a < b and <tool_ is not a call", "a < b and <tool_ is not a call", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
     [("get_weather", {"city": "Paris"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", {"city": "Paris"})]),
    ("mistral", "[TOOL_CALLS]get_weather(city=Paris)", "[TOOL_CALLS]get_weather(city=Paris)", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris; France"}}', "",
     [("get_weather", {"city": "Paris; France"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "A"}}; '
                    '{"name": "get_weather", "parameters": {"city": "B"}}', "",
     [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})]),
    ("llama3_json", 'It is {"name": "get_weather"} in text', 'It is {"name": "get_weather"} in text', []),
    ("generic_json", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}', "",
     [("get_weather", {"city": "Paris"})]),
    ("generic_json", '  {"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}', "",
     [("get_weather", {"city": "Oslo"})]),
    ("generic_json", "Paris is sunny.", "Paris is sunny.", []),
]

# Calls broken after their arguments began: whole, the model's text; streamed, the call had started
# going out and stands as written (tests/test_tool_call_recovery.py).
BROKEN_AFTER_START = [
    ("hermes", 'No call: <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
     'No call: <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', []),
    ("generic_json", '{"tool_calls": [{"name": "get_weather", "arguments": {"city"',
     '{"tool_calls": [{"name": "get_weather", "arguments": {"city"', []),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", CASES + BROKEN_AFTER_START)
def test_parser_on_whole_text(name, text, content, calls):
    got_content, got = extract(PARSERS[name], text, {"get_weather"})
    assert got_content == content and _calls(got) == calls


@pytest.mark.parametrize("size", [1, 2, 5, 11])
@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parser_split_across_stream_chunks(name, text, content, calls, size):
    stream = ToolStream(PARSERS[name], {"get_weather"})
    pieces, got = [], []
    for i in range(0, len(text), size):
        c, new = stream.feed(text[i:i + size])
        pieces.append(c)
        got += new
    c, new = stream.feed("", finished=True)
    assert "".join(pieces) + c == content and _calls(got + new) == calls


def test_a_call_is_held_back_until_closed_and_content_is_not():
    stream = ToolStream(PARSERS["hermes"], {"get_weather"})
    assert stream.feed("Checking <tool") == ("Checking ", [])  # "<tool" may open a call: held back
    assert stream.feed('_call>{"name": "get_weather", ') == ("", [])
    content, calls = stream.feed('"arguments": {"city": "Oslo"}}</tool_call> ok')
    assert content == " ok" and _calls(calls) == [("get_weather", {"city": "Oslo"})]


def test_a_named_call_streams_its_arguments_as_openai_does():
    spec = tool_spec([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    out = ToolOutput(spec, PARSERS["hermes"])
    first = out.feed('{"city": ', False)[1]
    assert first[0]["id"].startswith("call_") and first[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1] == {"index": 0, "function": {"arguments": '{"city": '}}
    assert out.feed('"Paris"}', True)[1] == [{"index": 0, "function": {"arguments": '"Paris"}'}}]
    assert out.calls[0].arguments == '{"city": "Paris"}'


@pytest.mark.parametrize("parser,text,reasoning,content", [
    ("qwen3", "<think>\nThe user wants weather.\n</think>\n\nIt is sunny.", "\nThe user wants weather.\n",
     "It is sunny."),
    ("qwen3", "It is sunny.", None, "It is sunny."),
    ("qwen3", "<think>still thinking", "still thinking", ""),
    ("deepseek_r1", "The user wants weather.</think>It is sunny.", "The user wants weather.", "It is sunny."),
    ("deepseek_r1", "<think>x</think>y", "x", "y"),
])
@pytest.mark.parametrize("size", [1, 3, 100])
def test_reasoning_parser(parser, text, reasoning, content, size):
    assert ReasoningStream(REASONING_PARSERS[parser]).whole(text) == (reasoning, content)
    stream = ReasoningStream(REASONING_PARSERS[parser])
    parts = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)] + [stream.feed("", True)]
    assert "".join(p[0] for p in parts) == (reasoning or "") and "".join(p[1] for p in parts) == content


# ------------------------------------------------------------------ real chat templates
@pytest.fixture(scope="module")
def tok(embedded_dir):
    from ferry.model.tokenizer import load_tokenizer

    return load_tokenizer(embedded_dir)


@pytest.mark.parametrize("file,parser,call_mark", [
    ("Qwen-Qwen3-0.6B.jinja", "hermes", "<tool_call>"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes", "<tool_call>"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json", '"name": "get_weather"'),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", "[TOOL_CALLS]"),
])
def test_real_templates_render_tools_calls_and_results(tok, file, parser, call_mark):
    template = (TEMPLATES / file).read_text()
    assert parser_for_template(template).name == parser
    spec = tool_spec([WEATHER], "auto", None)
    conv = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "abc123xyz", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "abc123xyz", "content": "18 C and sunny"}]
    conv, tools = with_tools(conv, spec, template)
    assert tools is not None  # each of these templates takes tools itself
    text = tok.render_chat(conv, tools, chat_template=template)
    assert "Weather in a city" in text  # the tool's description reached the prompt
    assert call_mark in text and "Paris" in text  # the earlier call
    assert "18 C and sunny" in text  # the tool's result


def test_mistral_call_ids_are_what_its_template_takes():
    _, calls = extract(PARSERS["mistral"], '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}]')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


def test_a_template_without_tools_gets_the_generic_prompt(tok):
    spec = tool_spec([WEATHER], "auto", None)
    conv = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    conv, tools = with_tools(conv, spec, tok.chat_template)
    assert tools is None and parser_for_template(tok.chat_template).name == "generic_json"
    text = tok.render_chat(conv, tools)
    assert '"name": "get_weather"' in text and "Weather in a city" in text and "18 C" in text
    assert json.loads(conv[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}


@pytest.mark.parametrize("tools,choice,says", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], "auto",
     "tools[0].function.parameters.type is not valid JSON Schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto", "must be a JSON Schema object"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "'nope', which is not among the tools"),
    (None, "required", "needs tools"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    ([WEATHER, WEATHER], "auto", "two tools are named"),
])
def test_bad_tools_name_the_field(tools, choice, says):
    with pytest.raises(APIError) as e:
        tool_spec(tools, choice, None)
    assert e.value.status == 400 and says in e.value.message
    assert e.value.param.startswith("tool_choice" if choice not in ("auto",) else "tools")


def test_every_route_asks_for_the_same_tool_settings():
    """chat, responses and messages all take their sampling overrides from tool_overrides: the grammar
    for required / named calls, and special tokens kept under auto when the call marker is one
    (responses and messages once dropped Mistral's [TOOL_CALLS] and Llama 3's <|python_tag|>)."""
    import inspect

    from ferry.server.anthropic import messages
    from ferry.server.openai import chat, responses
    from ferry.server.openai.chat import tool_overrides

    auto = tool_spec([WEATHER], "auto", None)
    # Mistral's marker is a special token, no text for a structural tag to trigger on.
    assert tool_overrides(auto, PARSERS["mistral"]) == {"skip_special_tokens": False}
    assert set(tool_overrides(auto, PARSERS["llama3_json"])) == {"skip_special_tokens", "structured_outputs"}
    assert tool_overrides(auto, PARSERS["hermes"])["structured_outputs"].structural_tag
    assert tool_overrides(auto, PARSERS["hermes"], constrained=True) == {}  # the request's own constraint wins
    assert tool_overrides(None, PARSERS["mistral"]) == {}
    named = tool_spec([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert set(tool_overrides(named, PARSERS["mistral"])) == {"structured_outputs"}
    for route in (chat.chat, responses.responses, messages.messages):
        assert "tool_overrides(spec, parser" in inspect.getsource(route), route.__name__


@pytest.mark.parametrize("parser", ["generic_json", "hermes", "llama3_json"])
def test_under_auto_text_is_free_until_a_call_opens_then_the_call_is_valid(llm, parser):
    """The structural tag of tool_choice auto: any text passes; once the model writes the format's
    call opening, only an offered function's name and arguments valid for its schema may follow."""
    import torch

    from ferry.server.tools.spec import call_tags

    trigger, begin, end = PARSERS[parser].call_frame
    so = call_tags(tool_spec([WEATHER], "auto", None), PARSERS[parser].call_frame)
    grammars, tok, vocab = llm.engine.executor.grammars, llm.tokenizer, llm.engine.executor.vocab_size

    def allowed(g, ids: list[int]) -> torch.Tensor:
        row = torch.zeros(vocab)
        g.mask(row, ids)
        return torch.isfinite(row)

    call = begin.format(name='"get_weather"') + '{"city": "Paris"}' + end
    for text in ("Sure, I can check that for you. " + call + " Done.", "No tools needed: 42."):
        ids, g = tok.encode(text, add_special_tokens=False), grammars.new_request(so)
        for k, t in enumerate(ids):
            assert allowed(g, ids[:k])[t], (text, tok.decode(ids[:k + 1]))
            g.advance(t)
    # Once the opening is written, a name that is not offered, or arguments off the schema, are not.
    head = "Let me look. " + begin.format(name='"get_weather"')
    for wrong in ("Let me look. " + begin.format(name='"get_time"'), head + '{"town": "Paris"}'):
        ids, g = tok.encode(wrong, add_special_tokens=False), grammars.new_request(so)
        ok = True
        for k, t in enumerate(ids):
            if not allowed(g, ids[:k])[t]:
                ok = False
                break
            g.advance(t)
        assert not ok and len(tok.decode(ids[:k])) >= len("Let me look. ") + len(trigger) - 1, wrong
