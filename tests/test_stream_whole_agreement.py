"""A model's text read as it streams, split at every point (and one character at a time, and in one
piece), gives the same final content, reasoning and calls as the text read whole: for every
tool-call parser on good calls, broken ones, text after a call inside its tags, cut-short output and
functions not offered; where a stream sent a call the whole text does not give, that call stands as
written (``ToolStream``'s rule). The same for a think block closed by a lone ``</think>``, and for
the order of reasoning, content and calls the Responses and Messages routes build."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from ferry.engine.outputs import CompletionOutput, RequestOutput
from ferry.server.anthropic import messages
from ferry.server.openai import responses
from ferry.server.openai.chat import ChoiceText
from ferry.server.reasoning import REASONING_PARSERS, ReasoningStream
from ferry.server.tools.parsers import PARSERS, ToolStream, extract
from ferry.server.tools.spec import tool_spec

NAMES = {"get_weather"}
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
NOPE = '{"name": "nope", "arguments": {}}'


def xml(name: str, city: str = "Paris") -> str:
    return f"<function={name}>\n<parameter=city>\n{city}\n</parameter>\n</function>"


# (parser, model text): streamed at any split, the same as whole.
AGREE = [
    ("hermes", f"Sure.<tool_call>{PARIS}</tool_call> done"),
    ("hermes", f"<tool_call>{PARIS} oops</tool_call> after"),  # text after the object, inside the tags
    ("hermes", f"<tool_call>{PARIS}"),  # cut short (finish length) before the closing tag
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}'),  # the object cut short
    ("hermes", f"<tool_call>[{PARIS}, {NOPE}]</tool_call>"),  # a list naming a function not offered
    ("hermes", f"<tool_call>[{NOPE}, {PARIS}]</tool_call>"),
    ("hermes", f"<tool_call>{NOPE}</tool_call>"),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": 1}"} x</tool_call>'),
    ("mistral", f"[TOOL_CALLS][{PARIS}, {NOPE}]"),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} oops'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]nope[ARGS]{}'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} oops'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}'),
    ("generic_json", f'{{"tool_calls": [{PARIS}, {NOPE}]}}'),
    ("generic_json", f'{{"tool_calls": [{PARIS}'),
    ("generic_json", "Paris is sunny."),
    ("qwen3_xml", f"Sure.<tool_call>\n{xml('get_weather')}\n</tool_call>"),
    ("qwen3_xml", f"<tool_call>\n{xml('get_weather')}\noops</tool_call> after"),
    ("qwen3_xml", f"<tool_call>\n{xml('get_weather')}\n{xml('nope')}\n</tool_call>"),
    ("qwen3_xml", f"<tool_call>\n{xml('nope')}\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),  # cut short in a value
]

# (parser, model text, the result once the stream sent the call): whole, the model's text; a
# stream that sent the call before it broke keeps it as written.
BROKEN = [
    ("hermes", 'No call: <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
     ("No call: ", [("get_weather", '{"city": ')])),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city" "Paris"}}</tool_call>',
     ("", [("get_weather", '{"city" "Paris"}')])),
    ("generic_json", '{"tool_calls": [{"name": "get_weather", "arguments": {"city"',
     ("", [("get_weather", '{"city"')])),
]


def _result(content: str, calls: list[Any]) -> tuple[str, list[tuple[str, Any]]]:
    """(content, calls as (name, arguments read as JSON, or the text where they do not read))."""
    out = []
    for c in calls:
        try:
            out.append((c.name, json.loads(c.arguments)))
        except json.JSONDecodeError:
            out.append((c.name, c.arguments))
    return content, out


def _streamed(parser: str, chunks: list[str]) -> tuple[tuple[str, list], bool]:
    """The final (content, calls) of ``chunks`` streamed, and whether a call went out before the last chunk."""
    stream = ToolStream(PARSERS[parser], NAMES, SCHEMAS)
    content, calls, early = "", [], False
    for k, chunk in enumerate(chunks):
        c, more = stream.feed(chunk, finished=k == len(chunks) - 1)
        content, calls = content + c, calls + more
        early = early or (k < len(chunks) - 1 and any(new for _, new, _ in stream.take_events()))
    return _result(content, calls), early


def _splits(text: str) -> list[list[str]]:
    """``text`` in one piece (then the end), at each split point, and one character at a time."""
    return [[text, ""]] + [[text[:k], text[k:]] for k in range(1, len(text))] + [list(text) + [""]]


@pytest.mark.parametrize("parser,text", AGREE)
def test_streamed_at_any_split_gives_what_the_whole_text_gives(parser, text):
    whole = _result(*extract(PARSERS[parser], text, NAMES, SCHEMAS))
    for chunks in _splits(text):
        assert _streamed(parser, chunks)[0] == whole, chunks


@pytest.mark.parametrize("parser,text,started", BROKEN)
def test_a_call_broken_after_it_went_out_stands_and_otherwise_agrees(parser, text, started):
    whole = _result(*extract(PARSERS[parser], text, NAMES, SCHEMAS))
    assert whole == (text, [])
    for chunks in _splits(text):
        got, early = _streamed(parser, chunks)
        assert got == (started if early else whole), chunks


def test_the_rule_keeps_a_whole_call_and_the_text_after_it():
    """The reviewer's example: the call and the text after it inside the tags, whole or streamed."""
    text = '<tool_call>{"name": "get_weather", "arguments": {"a": 1}} oops</tool_call>'
    assert _result(*extract(PARSERS["hermes"], text, NAMES)) == (" oops", [("get_weather", {"a": 1})])


@pytest.mark.parametrize("members,city", [
    ('"arguments": {"city": "Oslo"}, "parameters": {"city": "Rome, Italy"}', "Oslo"),
    ('"parameters": {"city": "Rome, Italy"}, "arguments": {"city": "Oslo"}', "Oslo"),
])
def test_arguments_win_over_parameters_streamed_and_whole(members, city):
    """Both members written: "arguments" is read (call_from_json's order), streamed too; a stream
    that sent "parameters" before "arguments" came keeps them whole (they cannot be taken back)."""
    text = f'<tool_call>{{"name": "get_weather", {members}}}</tool_call>'
    whole = _result(*extract(PARSERS["hermes"], text, NAMES))
    assert whole == ("", [("get_weather", {"city": city})])
    for chunks in _splits(text):
        got, early = _streamed("hermes", chunks)
        sent_parameters = early and members.startswith('"parameters"') and '"arguments": {' not in chunks[0]
        assert got == (("", [("get_weather", {"city": "Rome, Italy"})]) if sent_parameters else whole), chunks


# ------------------------------------------------------------------ a think block closed by a lone </think>
LONE = "The user says hello.\n</think>\n\nHello!"


@pytest.mark.parametrize("opened,text,reasoning,content", [
    (None, LONE, "The user says hello.\n", "Hello!"),  # the prompt not known: the lone end tag closes a block
    (None, "Hi <think>x</think> y", None, "Hi <think>x</think> y"),  # an opening tag before it: not lone
    (None, "x" * 40 + "</think>y", None, "x" * 40 + "</think>y"),  # past LONE_END_WITHIN: content
    (None, "Plain answer.", None, "Plain answer."),
    (False, LONE, None, LONE),  # the prompt left no block open: the output is the answer
    (True, LONE, "The user says hello.\n", "Hello!"),  # the prompt opened it
])
def test_reasoning_streamed_at_any_split_gives_what_the_whole_text_gives(monkeypatch, opened, text, reasoning,
                                                                         content):
    monkeypatch.setattr(ReasoningStream, "LONE_END_WITHIN", 32)
    qwen3 = REASONING_PARSERS["qwen3"]
    assert ReasoningStream(qwen3, opened).whole(text) == (reasoning, content)
    for chunks in _splits(text):
        stream = ReasoningStream(qwen3, opened)
        parts = [stream.feed(c, k == len(chunks) - 1) for k, c in enumerate(chunks)]
        got = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        assert (got[0] if stream.saw else None, got[1]) == (reasoning, content), chunks


def test_the_held_text_goes_out_once_it_is_told():
    """Not knowing the prompt, the stream holds text back until a lone ``</think>`` closes it, an
    opening tag rules it out, or LONE_END_WITHIN characters pass; it never holds more."""
    stream = ReasoningStream(REASONING_PARSERS["qwen3"])
    assert stream.feed("The user") == ("", "")
    assert stream.feed(" says hi.</think>\n\nHi") == ("The user says hi.", "Hi")
    stream = ReasoningStream(REASONING_PARSERS["qwen3"])
    assert stream.feed("a" * (ReasoningStream.LONE_END_WITHIN - 1)) == ("", "")
    assert stream.feed("ab") == ("", "a" * ReasoningStream.LONE_END_WITHIN + "b")
    assert ReasoningStream(REASONING_PARSERS["qwen3"], opened=False).feed("The user") == ("", "The user")


# ------------------------------------------------------------------ the order of reasoning, content and calls
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
IN_REASONING = (f"<think>Let me look.\n<tool_call>{PARIS}</tool_call>\nThen I answer.\n</think>\n\n"
                f"It may rain.<tool_call>{PARIS}</tool_call>")
ORDER = ["reasoning", "call", "reasoning", "content", "call"]


def _choice() -> ChoiceText:
    ctx = SimpleNamespace(reasoning_parser="qwen3", tokenizer=None)
    return ChoiceText(ctx, tool_spec([WEATHER], "auto", None), PARSERS["hermes"])


def _merged(pieces: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Streamed pieces as a client gathers them: each run of one kind joined, a call's deltas as (name, arguments)."""
    out: list[tuple[str, Any]] = []
    for kind, value in pieces:
        if kind == "call" and "id" in value:
            out.append(("call", [value["function"]["name"], value["function"]["arguments"]]))
        elif kind == "call":
            out[-1][1][1] += value["function"]["arguments"]
        elif out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return [(k, (v[0], json.loads(v[1])) if k == "call" else v) for k, v in out]


def test_a_call_in_the_reasoning_comes_between_it_whole_and_streamed():
    whole = [(k, (v.name, json.loads(v.arguments)) if k == "call" else v)
             for k, v in _choice().whole_pieces(IN_REASONING)]
    assert [k for k, _ in whole] == ORDER
    assert whole[0] == ("reasoning", "Let me look.\n") and whole[3] == ("content", "It may rain.")
    for chunks in _splits(IN_REASONING):
        ct = _choice()
        pieces = [p for k, c in enumerate(chunks) for p in ct.feed_pieces(c, k == len(chunks) - 1)]
        assert _merged(pieces) == whole, chunks


class _Stream:
    """An engine stream giving ``chunks`` as one choice's growing text."""

    def __init__(self, chunks: list[str]) -> None:
        self.chunks = chunks

    async def _outputs(self):
        text = ""
        for k, chunk in enumerate(self.chunks):
            text, last = text + chunk, k == len(self.chunks) - 1
            comp = CompletionOutput(0, text, [0] * (k + 1), "length" if last else None)
            yield 0, RequestOutput("r", None, [1, 2], [comp], finished=last)

    def __aiter__(self):
        return self._outputs()

    async def close(self) -> None:
        pass


def _events(events: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for e in events for line in e.splitlines() if line.startswith("data: ")]


async def _gather(gen) -> list[str]:
    return [e async for e in gen]


@pytest.mark.parametrize("chunks", [[IN_REASONING], list(IN_REASONING)], ids=["one piece", "by character"])
def test_the_responses_and_messages_routes_stream_items_in_the_whole_order(chunks):
    """Both routes build their items (blocks) from ChoiceText's pieces: a stream gives the order
    the whole answer gives (reasoning, the call made in it, more reasoning, the answer, a call)."""
    ctx = SimpleNamespace(reasoning_parser="qwen3", tokenizer=None, model_name="m")
    spec, parser = tool_spec([WEATHER], "auto", None), PARSERS["hermes"]
    body = responses.ResponsesRequest(input="x", store=False)
    got = _events(asyncio.run(_gather(responses._events(ctx, body, _Stream(chunks), spec, parser, "resp_1", 0, []))))
    items = got[-1]["response"]["output"]
    kinds = {"reasoning": "reasoning", "content": "message", "call": "function_call"}
    assert [i["type"] for i in items] == [kinds[k] for k in ORDER]
    assert items[1]["arguments"] == '{"city": "Paris"}' and items[3]["content"][0]["text"] == "It may rain."
    got = _events(asyncio.run(_gather(messages._events(ctx, _Stream(chunks), spec, parser, "msg_1"))))
    blocks = [e["content_block"]["type"] for e in got if e["type"] == "content_block_start"]
    kinds = {"reasoning": "thinking", "content": "text", "call": "tool_use"}
    assert blocks == [kinds[k] for k in ORDER]
