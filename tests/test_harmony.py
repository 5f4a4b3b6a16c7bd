"""gpt-oss's harmony format: llama.cpp's gpt-oss chat template renders tools, calls, their results
and the reasoning effort; ``ferry.server.harmony`` reads the model's channels (analysis ->
reasoning_content, commentary to=functions.NAME -> tool_calls, final -> content) whole and streamed
alike, and the chat route's ChoiceText takes them from it when the template speaks harmony."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ferry.server.errors import APIError
from ferry.server.harmony import HarmonyStream, read_header
from ferry.server.openai.chat import ChoiceText, effort_kwargs
from ferry.server.protocol import ChatCompletionRequest
from ferry.server.template_worker import renderer
from ferry.server.tools.parsers import parser_for_template
from ferry.server.tools.render import with_tools
from ferry.server.tools.spec import tool_spec
from tests.llama_cpp import LLAMA_CPP

TEMPLATE = LLAMA_CPP / "models" / "templates" / "openai-gpt-oss-120b.jinja"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
THINK = "<|channel|>analysis<|message|>The user asks for the weather: call get_weather.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
ANSWER = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 21 C.<|return|>"


@pytest.fixture(scope="module")
def template() -> str:
    if not TEMPLATE.is_file():
        pytest.skip("llama.cpp's gpt-oss template is not here (`make test` fetches it; or set FERRY_LLAMA_CPP)")
    return TEMPLATE.read_text()


def render(template: str, conv: list[dict], effort: str | None = None) -> str:
    conv, tools = with_tools(conv, tool_spec(TOOLS, "auto", None), template)
    return renderer()(template, conv, tools, True, {"reasoning_effort": effort} if effort else {})


def test_the_gpt_oss_template_renders_tools_calls_results_and_the_effort(template):
    conv = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    prompt = render(template, conv, "high")
    assert parser_for_template(template).name == "harmony"
    assert "Reasoning: high" in prompt and "type get_weather = (_: {" in prompt
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            '<|call|>') in prompt
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"21 C"<|end|>' in prompt
    assert prompt.endswith("<|start|>assistant") and "Reasoning: medium" in render(template, conv[:1])


def loaded(arguments: str):
    """Arguments as JSON where they are whole (the streamed text and the normalised call agree), else as text."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def pieces_of(text: str, step: int | None, offered: bool = True) -> tuple[str, str, list[dict]]:
    """(reasoning, content, calls) of ``text`` read whole (``step`` None) or fed ``step`` characters at a time."""
    calls: list = []
    stream = HarmonyStream(calls if offered else None, {"get_weather"})
    parts = []
    if step is None:
        parts = stream.feed(text, finished=True)
    else:
        for i in range(0, len(text), step):
            parts += stream.feed(text[i:i + step], finished=i + step >= len(text))
    reasoning = "".join(v for k, v in parts if k == "reasoning")
    content = "".join(v for k, v in parts if k == "content")
    streamed = {}
    for k, v in parts:
        if k == "call":
            streamed.setdefault(v["index"], "")
            streamed[v["index"]] += v["function"]["arguments"]
            assert ("id" in v) == (v["function"].get("name") is not None)
    assert [loaded(a) for a in streamed.values()] == [loaded(c.arguments) for c in calls]
    return reasoning, content, [c.openai()["function"] for c in calls]


@pytest.mark.parametrize("step", [None, 1, 3, 7])
def test_harmony_channels_are_reasoning_calls_and_content_whole_or_streamed(step):
    assert pieces_of(THINK + CALL, step) == (
        "The user asks for the weather: call get_weather.", "",
        [{"name": "get_weather", "arguments": '{"city": "Paris"}'}])
    assert pieces_of(ANSWER, step) == ("Easy.", "It is 21 C.", [])
    # The recipient before the channel (as the template writes calls), two calls, a preamble to the user.
    two = ('<|channel|>commentary<|message|>Looking it up.<|end|>'
           '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Oslo"}<|call|>'
           '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Rome"}<|call|>')
    assert pieces_of(two, step) == ("", "Looking it up.", [{"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                                                          {"name": "get_weather", "arguments": '{"city": "Rome"}'}])
    # No tools offered, or a function not offered: the message is content as written.
    assert pieces_of(THINK + CALL, step, offered=False)[1:] == ('{"city": "Paris"}', [])
    other = CALL.replace("get_weather", "rm_rf")
    assert pieces_of(other, step)[1:] == ('{"city": "Paris"}', [])
    # Cut short inside a message (length): what came is sent; a call keeps its partial arguments.
    assert pieces_of(ANSWER[:ANSWER.index("It is") + 5], step) == ("Easy.", "It is", [])
    assert pieces_of(THINK + "<|start|>assistant<|chan", step) == ("The user asks for the weather: call get_weather.", "", [])  # a header cut short
    assert pieces_of("plain text", step) == ("", "plain text", [])
    assert pieces_of(THINK + CALL[:-12], step)[2] == [{"name": "get_weather", "arguments": '{"city": "Par'}]


def test_a_header_s_channel_and_recipient():
    assert read_header("assistant<|channel|>commentary to=functions.f <|constrain|>json") == ("commentary", "functions.f")
    assert read_header(" to=functions.g<|channel|>commentary json") == ("commentary", "functions.g")
    assert read_header("<|channel|>final") == ("final", None)


def test_the_chat_route_reads_harmony_where_the_template_speaks_it(template):
    """ChoiceText (the chat, Responses and Messages routes' reader) under the gpt-oss template:
    reasoning, content and the calls in the tools' list (what finish_reason and the reply read),
    streamed token by token as whole."""
    ctx = SimpleNamespace(reasoning_parser=None, tokenizer=None)
    spec, parser = tool_spec(TOOLS, "auto", None), parser_for_template(template)
    text = THINK + CALL
    whole = ChoiceText(ctx, spec, parser).whole(text)
    assert whole[0] == "The user asks for the weather: call get_weather." and whole[1] == ""
    assert [c.name for c in whole[2]] == ["get_weather"] and json.loads(whole[2][0].arguments) == {"city": "Paris"}
    streamed = ChoiceText(ctx, spec, parser)
    got = [streamed.feed(text[i:i + 5], i + 5 >= len(text)) for i in range(0, len(text), 5)]
    assert "".join(r for r, _, _ in got) == whole[0] and streamed.tools.calls[0].arguments == whole[2][0].arguments
    # Without tools the analysis is still reasoning, never content.
    assert ChoiceText(ctx, None, parser).whole(ANSWER) == ("Easy.", "It is 21 C.", [])


def test_reasoning_effort_reaches_the_template_and_a_bad_one_is_named():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], reasoning_effort="low")
    assert effort_kwargs(body) == {"reasoning_effort": "low"}
    with pytest.raises(APIError) as e:
        effort_kwargs(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], reasoning_effort="max"))
    assert e.value.status == 400 and e.value.param == "reasoning_effort"
