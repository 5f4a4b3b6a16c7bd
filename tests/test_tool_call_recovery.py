"""Tool calls and reasoning as models really write them: a call inside the think block, a call
missing its opening tag, arguments streamed in pieces, content null beside calls, and a think block
the chat template opened. Each model text goes through the streamed path token by token (and
character by character) and through the whole path, and the two must agree; prompts come from the
real chat templates in tests/chat_templates/. Two requests against a real `ferry serve` check the chat
route end to end (the model made to write the text by a regex)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from ferry.server.openai.chat import ChoiceText
from ferry.server.reasoning import REASONING_PARSERS, ReasoningStream
from ferry.server.tools.parsers import PARSERS, ToolStream, parser_for_template
from ferry.server.tools.render import with_tools
from ferry.server.tools.spec import tool_spec

TEMPLATES = Path(__file__).with_name("chat_templates")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def tok(embedded_dir):
    from ferry.model.tokenizer import load_tokenizer

    return load_tokenizer(embedded_dir)


def prompt(tok, file: str | None, tools: bool = True, **kwargs) -> tuple[list[int], str]:
    """The prompt's token ids through a real template (the embedded model's own for None), with its
    tool-call format's name."""
    template = (TEMPLATES / file).read_text() if file else tok.chat_template
    spec = tool_spec([WEATHER, TIME], "auto", None) if tools else None
    conv, template_tools = with_tools(ASK, spec, template)
    text = tok.render_chat(conv, template_tools, chat_template=template, **kwargs)
    return tok.encode(text), parser_for_template(template).name


def token_pieces(tok, text: str) -> list[str]:
    """``text`` as the engine's detokenizer gives it, one token's text at a time."""
    ids = tok.encode(text)
    out = [tok.decode(ids[:k + 1]) for k in range(len(ids))]
    assert out[-1] == text
    return [b[len(a):] for a, b in zip([""] + out, out)]


def choice(tok, parser: str, ids: list[int] | None, reasoning: str | None = "qwen3", tools=(WEATHER, TIME)):
    ctx = SimpleNamespace(reasoning_parser=reasoning, tokenizer=tok)
    spec = tool_spec(list(tools), "auto", None) if tools else None
    return ChoiceText(ctx, spec, PARSERS[parser], ids)


def streamed(make, chunks: list[str]) -> dict:
    """What a client assembles from the deltas (OpenAI's rules: content null until some is sent), and
    how many deltas each call's arguments came in."""
    ct = make()
    reasoning, content, calls, pieces = [], None, {}, {}
    for k, chunk in enumerate(chunks):
        r, c, deltas = ct.feed(chunk, k == len(chunks) - 1)
        reasoning.append(r)
        if c:
            content = (content or "") + c
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            if "id" in d:
                call["name"] = d["function"]["name"]
            args = d["function"].get("arguments")
            if args:
                call["arguments"] += args
                pieces[d["index"]] = pieces.get(d["index"], 0) + 1
    return {"reasoning": "".join(reasoning) or None, "content": content,
            "calls": [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], "pieces": pieces}


def first_arguments_chunk(make, chunks: list[str]) -> int | None:
    """The index of the first chunk whose feeding sends some of a call's arguments."""
    ct = make()
    for k, chunk in enumerate(chunks):
        if any(d["function"].get("arguments") for d in ct.feed(chunk, False)[2]):
            return k
    return None


def whole(make, text: str) -> dict:
    """The non-streamed message (the chat route's rule: content null beside calls when empty)."""
    reasoning, content, calls = make().whole(text)
    return {"reasoning": reasoning or None, "content": content if content or not calls else None,
            "calls": [(c.name, json.loads(c.arguments)) for c in calls]}


def both(tok, make, text: str) -> dict:
    """The whole result, checked equal to the streamed one token by token and character by character."""
    w = whole(make, text)
    for chunks in (token_pieces(tok, text), list(text)):
        s = streamed(make, chunks + [""])
        assert {k: s[k] for k in w} == w, (chunks, s, w)
    return w


# ------------------------------------------------------------------ calls inside the think block
@pytest.mark.parametrize("file,kwargs,text", [
    # QwQ's template opens the think block itself; the model calls before closing it.
    ("Qwen-QwQ-32B.jinja", {"enable_thinking": True},
     f"The user wants the weather in Paris.\n<tool_call>\n{PARIS}\n</tool_call>\n</think>\n\n"),
    # Qwen3's does not: the model opens it, calls inside, and ends the turn without closing it.
    ("Qwen-Qwen3-0.6B.jinja", {}, f"<think>\nThe user wants the weather in Paris.\n<tool_call>{PARIS}</tool_call> "),
    # Both calls in the think block, the block closed, nothing after.
    ("Qwen-Qwen3-0.6B.jinja", {},
     f"<think>\nThe user wants the weather in Paris.\n<tool_call>\n{PARIS}\n</tool_call>\n"
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n</think>\n\n'),
])
def test_a_call_inside_the_think_block_is_a_tool_call(tok, file, kwargs, text):
    ids, parser = prompt(tok, file, **kwargs)
    assert parser == "hermes"
    got = both(tok, lambda: choice(tok, parser, ids), text)
    assert got["calls"][0] == ("get_weather", {"city": "Paris"}) and got["content"] is None
    assert got["reasoning"].strip() == "The user wants the weather in Paris."
    if "get_time" in text:
        assert got["calls"][1] == ("get_time", {"zone": "CET"})


# ------------------------------------------------------------------ a call missing its opening tag
def test_a_call_missing_its_opening_tag_is_taken_when_it_calls_an_offered_function(tok):
    ids, parser = prompt(tok, "Qwen-Qwen3-0.6B.jinja")
    make = lambda: choice(tok, parser, ids)  # noqa: E731
    got = both(tok, make, f"{PARIS}\n</tool_call>")
    assert got["calls"] == [("get_weather", {"city": "Paris"})] and got["content"] is None
    got = both(tok, make, f"I will check.\n{PARIS}</tool_call>\n<tool_call>\n"
                          '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    assert got["content"] == "I will check.\n\n"  # the line break between the calls is text too
    assert got["calls"] == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    got = both(tok, make, f"<think>\nLooking it up.\n{PARIS}</tool_call>\n</think>\n\n")  # in reasoning too
    assert got["calls"] == [("get_weather", {"city": "Paris"})] and got["reasoning"].strip() == "Looking it up."
    # Not a call: a function not offered, or no closing tag after the object; the text stays as written.
    for text in ('{"name": "get_stock", "arguments": {"ticker": "X"}}</tool_call>',
                 f"The call would be {PARIS}, if you want it.", '{"name": "get_weather"} and {"name"'):
        got = both(tok, make, text)
        assert got["calls"] == [] and got["content"] == text, text


# ------------------------------------------------------------------ arguments in pieces
LONG = "Saint-Martin-de-Belleville in the Tarentaise valley"
LONG_CALL = f'{{"name": "get_weather", "arguments": {{"city": "{LONG}"}}}}'


@pytest.mark.parametrize("file,parser,text", [
    ("Qwen-Qwen3-0.6B.jinja", "hermes", f"<tool_call>\n{LONG_CALL}\n</tool_call>"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes", f"<tool_call>\n{LONG_CALL}\n</tool_call>"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json",
     f'{{"name": "get_weather", "parameters": {{"city": "{LONG}"}}}}'),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", f"[TOOL_CALLS][{LONG_CALL}]"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", f'[TOOL_CALLS]get_weather[ARGS]{{"city": "{LONG}"}}'),
    (None, "generic_json", f'{{"tool_calls": [{LONG_CALL}]}}'),
])
def test_streamed_arguments_arrive_in_pieces_as_they_are_written(tok, file, parser, text):
    ids, speaks = prompt(tok, file)
    assert speaks == parser
    make = lambda: choice(tok, parser, ids, reasoning=None)  # noqa: E731
    assert both(tok, make, text)["calls"] == [("get_weather", {"city": LONG})]
    chunks = token_pieces(tok, text)
    assert streamed(make, chunks + [""])["pieces"][0] >= 5
    # The arguments begin going out long before the call is complete.
    first = first_arguments_chunk(make, chunks)
    assert first is not None and first < len(chunks) - 5


def test_a_call_broken_after_its_arguments_began_stands_as_written_when_streamed(tok):
    """Once a call's name and arguments went out they cannot be taken back: a call broken later
    stays a call with the arguments written; whole, such text is the model's content."""
    text = 'No call: <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    ct = choice(tok, "hermes", None, reasoning=None)
    content, calls = "", []
    for k, c in enumerate(list(text) + [""]):
        _, more, deltas = ct.feed(c, k == len(text))
        content += more
        calls += deltas
    assert content == "No call: " and calls[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in calls) == '{"city": '
    assert whole(lambda: choice(tok, "hermes", None, reasoning=None), text) == \
        {"reasoning": None, "content": text, "calls": []}


# ------------------------------------------------------------------ content null beside calls
WHITESPACE_BESIDE_CALLS = [
    ("Qwen-Qwen3-0.6B.jinja", "hermes", f"\n<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>{PARIS}</tool_call>\n"),
    ("Qwen-Qwen3-0.6B.jinja", "hermes", f"<think>\nParis, then.\n</think>\n\n \n<tool_call>{PARIS}</tool_call>\n\n"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", f"\n [TOOL_CALLS][{PARIS}]"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", '\n[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}\n'),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json",
     '\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n'),
    (None, "generic_json", f'  {{"tool_calls": [{PARIS}]}}\n'),
]


def test_content_is_null_beside_calls_when_only_whitespace_is_left_for_every_parser(tok):
    for file, parser, text in WHITESPACE_BESIDE_CALLS:
        ids, speaks = prompt(tok, file)
        assert speaks == parser
        got = both(tok, lambda: choice(tok, parser, ids), text)
        assert got["calls"][0] == ("get_weather", {"city": "Paris"}) and got["content"] is None, (parser, text)
        # The same whitespace with no call is the answer, as written.
        plain = both(tok, lambda: choice(tok, parser, ids), "\n \n")
        assert plain["content"] == "\n \n" and plain["calls"] == []


# ------------------------------------------------------------------ a think block the template opened
def test_text_before_a_lone_end_tag_is_reasoning_streamed_and_whole(tok):
    text = "The user says hello; I answer briefly.\n</think>\n\nHello! How can I help?"
    assert ReasoningStream(REASONING_PARSERS["qwen3"]).whole(text) == (
        "The user says hello; I answer briefly.\n", "Hello! How can I help?")
    # Qwen3.5's template opens the block (its prompt ends "<think>\n"): streamed as reasoning at once.
    ids, _ = prompt(tok, "Qwen3.5-4B.jinja", tools=False)
    make = lambda: choice(tok, "hermes", ids, tools=())  # noqa: E731
    got = both(tok, make, text)
    assert got == {"reasoning": "The user says hello; I answer briefly.\n", "content": "Hello! How can I help?",
                   "calls": []}
    ct = make()
    assert ct.feed("The user", False)[:2] == ("The user", "")  # not held back, not content
    # Thinking switched off, the template closes the block itself: the output is the answer.
    off, _ = prompt(tok, "Qwen3.5-4B.jinja", tools=False, enable_thinking=False)
    got = both(tok, lambda: choice(tok, "hermes", off, tools=()), "Hello! How can I help?")
    assert got == {"reasoning": None, "content": "Hello! How can I help?", "calls": []}


# ------------------------------------------------------------------ the chat route, end to end
@pytest.fixture(scope="module")
def server():
    from tests.test_server_hardening import logged_server

    with logged_server("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3") as proc:
        yield proc


def _ask(server, said: str, stream: bool) -> dict:
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 80, "temperature": 0,
            "guided_regex": re.escape(said), "stream": stream}
    if not stream:
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300).json()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        return {"chunks": [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]}


def _final(server, said: str):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    with client.chat.completions.stream(model=None, messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0,
                                        extra_body={"guided_regex": re.escape(said)}) as s:
        list(s)
        return s.get_final_completion().choices[0]


def test_chat_route_takes_a_call_from_the_think_block_with_content_null(server):
    said = f"<think>\nI will look it up.\n<tool_call>\n{PARIS}\n</tool_call>\n</think>\n\n"
    c = _ask(server, said, False)["choices"][0]
    m = c["message"]
    assert m["content"] is None and c["finish_reason"] == "tool_calls", c
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in m["tool_calls"]] == \
        [("get_weather", {"city": "Paris"})]
    assert m["reasoning_content"].strip() == "I will look it up."
    chunks = _ask(server, said, True)["chunks"]
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    args = [t["function"]["arguments"] for d in deltas for t in d.get("tool_calls") or []
            if t["function"].get("arguments")]
    assert len(args) > 1 and json.loads("".join(args)) == {"city": "Paris"}  # in pieces, as sampled
    assert not any(d.get("content") for d in deltas)
    final = _final(server, said)
    assert final.message.content is None and final.message.tool_calls[0].function.name == "get_weather"


def test_chat_route_takes_a_call_missing_its_opening_tag_with_content_null(server):
    said = f"\n{PARIS}\n</tool_call>\n"
    m = _ask(server, said, False)["choices"][0]["message"]
    assert m["content"] is None and m["tool_calls"][0]["function"]["name"] == "get_weather", m
    final = _final(server, said)
    assert final.message.content is None and json.loads(final.message.tool_calls[0].function.arguments) == \
        {"city": "Paris"}
