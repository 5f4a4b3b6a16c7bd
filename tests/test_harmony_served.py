"""gpt-oss's harmony output through the openai SDK against a real `ferry serve` on 127.0.0.1: a tiny
random gpt-oss with llama.cpp's gpt-oss chat template, whose output a request's structured outputs
(one choice: a chosen harmony text) decides, so the server's own route reads it as it reads any
model's: the analysis channel comes back as reasoning_content, a message to functions.NAME as
tool_calls, the final channel as content; streamed and whole alike."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.test_harmony import ANSWER, CALL, TEMPLATE, THINK, TOOLS
from tests.test_server_hardening import logged_server

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    if not TEMPLATE.is_file():
        pytest.skip("llama.cpp's gpt-oss template is not here")
    import torch

    from ferry.model.loader import resolve_model_dir
    from tests.arch_models import hf_config, perturb_gpt_oss, random_model

    path = tmp_path_factory.mktemp("gpt-oss-served")
    embedded = resolve_model_dir(None)  # its tokenizer: the template's markers are plain text to it
    cfg = hf_config("gpt-oss")
    cfg.vocab_size, cfg.eos_token_id, cfg.bos_token_id, cfg.max_position_embeddings = 49152, 2, 1, 4096
    torch.manual_seed(0)
    random_model(cfg, path, perturb_gpt_oss)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded / name, path / name)
    shutil.copy(TEMPLATE, path / "chat_template.jinja")
    with logged_server("--model", str(path), "--served-model-name", "tiny-gpt-oss") as proc:
        yield proc


def _client(srv):
    from openai import OpenAI

    return OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def _forced(text: str) -> dict:
    """The request fields that make the model write ``text``."""
    return {"structured_outputs": {"choice": [text]}}


def _ask(srv, text: str, stream: bool) -> tuple[str, str, list[dict]]:
    """(reasoning_content, content, tool calls as {name, arguments}) of one chat completion."""
    client = _client(srv)
    kw = dict(model="tiny-gpt-oss", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=200,
              extra_body=_forced(text))
    if not stream:
        msg = client.chat.completions.create(**kw).choices[0].message
        calls = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in msg.tool_calls or []]
        return getattr(msg, "reasoning_content", None) or "", msg.content or "", calls
    reasoning, content, calls = "", "", {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for c in delta.tool_calls or []:
            call = calls.setdefault(c.index, {"name": "", "arguments": ""})
            call["name"] += (c.function.name or "") if c.function else ""
            call["arguments"] += (c.function.arguments or "") if c.function else ""
    return reasoning, content, [dict(c, arguments=json.loads(c["arguments"])) for c in calls.values()]


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_and_a_tool_call_come_back_in_their_fields(srv, stream):
    reasoning, content, calls = _ask(srv, THINK + CALL, stream)
    assert reasoning == "The user asks for the weather: call get_weather."
    assert calls == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert content == ""


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_and_the_final_answer_come_back_in_their_fields(srv, stream):
    reasoning, content, calls = _ask(srv, ANSWER, stream)
    assert (reasoning, content, calls) == ("Easy.", "It is 21 C.", [])
