"""SmolVLM and Gemma 3 (tiny random models made by transformers, their processors saved beside them)
served by a real `ferry serve`: an OpenAI chat with an ``image_url`` data URL, streaming and not, is
answered as ``LLM.chat`` answers the same conversation, and its usage counts the image's tokens."""
from __future__ import annotations

import base64
import io

import openai
import pytest
from PIL import Image

from ferry import LLM, SamplingParams
from tests.test_server_hardening import logged_server
from tests.vl_models import image

GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% for p in m['content'] %}"
                  "{% if p['type'] == 'image' %}<start_of_image> {% else %}{{ p['text'] }} {% endif %}"
                  "{% endfor %}{% endfor %}{% if add_generation_prompt %}w1{% endif %}")


def make(family: str, path):
    if family == "smolvlm":
        from tests.test_smolvlm import make_model

        make_model(path)
    else:
        from tests.test_gemma3_vision import make_gemma3_model

        make_gemma3_model(path)
        (path / "chat_template.jinja").write_text(GEMMA_TEMPLATE)


@pytest.fixture(scope="module", params=["smolvlm", "gemma3"])
def served(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / request.param
    path.mkdir()
    make(request.param, path)
    with logged_server("--model", str(path)) as proc:
        proc.name = request.param
        yield path, proc


def test_an_image_chat_is_answered_as_llm_chat_answers_it(served):
    path, proc = served
    pic = image(64, 64, 1)
    buf = io.BytesIO()
    pic.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "w9 w11"}]}]
    r = client.chat.completions.create(model=proc.name, messages=messages, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(model=proc.name, messages=messages, max_tokens=6, temperature=0,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    llm = LLM(model=str(path))
    conv = [{"role": "user", "content": [{"type": "image", "image": Image.open(io.BytesIO(buf.getvalue()))},
                                         {"type": "text", "text": "w9 w11"}]}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert r.choices[0].message.content == out.outputs[0].text == streamed and out.outputs[0].text
    assert r.usage.prompt_tokens == len(out.prompt_token_ids) > 16  # the image's tokens counted
