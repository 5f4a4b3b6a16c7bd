"""`ferry serve` of an image model as the pair of files llama.cpp's converter writes: the text GGUF
and its ``--mmproj`` GGUF (the tiny Qwen3-VL of ``tests.test_qwen3_vl_gguf``), the mmproj named by
``--mmproj`` from another directory or found beside the text file. An OpenAI chat with a data: URL
image, streaming and not, is answered as ``LLM.chat`` answers it from the same files, its usage
counting the image's tokens; a file that is no mmproj given as ``--mmproj`` stops the server with
an error naming it."""
from __future__ import annotations

import base64
import io
import shutil
import subprocess
import sys

import openai
import pytest

from ferry import LLM, SamplingParams
from ferry.model.mmproj import find_mmproj
from tests.gguf_vl import HAVE_CONVERTER
from tests.test_qwen3_vl_gguf import pair  # noqa: F401 (the fixture: the text GGUF and its mmproj side by side)
from tests.test_server import free_port
from tests.test_server_hardening import logged_server
from tests.vl_models import image

pytestmark = pytest.mark.skipif(not HAVE_CONVERTER, reason="no llama.cpp source tree here")

IMAGE_TOKENS = 16  # a 64x64 image: 8-pixel patches merged 2x2
NEW = 6


def data_url(w: int, h: int, k: int) -> str:
    buf = io.BytesIO()
    image(w, h, k).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Look at"},
                                         {"type": "image_url", "image_url": {"url": data_url(64, 64, 1)}},
                                         {"type": "text", "text": "and say what it is"}]}]


@pytest.fixture(scope="module", params=["mmproj given", "mmproj beside"])
def served(request, pair, tmp_path_factory):  # noqa: F811 (pytest passes the imported fixture)
    """(the engine settings, the server): the text GGUF copied alone into another directory with
    ``--mmproj`` naming the tower, or the text GGUF beside its mmproj and no flag."""
    model_dir, text, mmproj, model, pad = pair
    if request.param == "mmproj given":
        alone = tmp_path_factory.mktemp("text_alone") / text.name
        shutil.copy(text, alone)
        assert find_mmproj(alone) is None  # nothing beside it: only the flag brings the tower
        settings = {"model": str(alone), "mmproj": str(mmproj)}
    else:
        settings = {"model": str(text)}
    with logged_server(*(a for k, v in settings.items() for a in (f"--{k}", v))) as proc:
        yield settings, proc


def test_an_image_chat_is_answered_as_llm_chat_answers_it_from_the_same_files(served, pair):  # noqa: F811
    settings, proc = served
    model_dir, text, mmproj, model, pad = pair
    assert f"vision tower from {mmproj}" in proc.log()
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    kw = {"model": name, "messages": MESSAGES, "max_tokens": NEW, "temperature": 0}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    llm = LLM(**settings)
    out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=NEW), use_tqdm=False)[0]
    assert out.prompt_token_ids.count(pad) == IMAGE_TOKENS
    assert whole.choices[0].message.content == streamed == out.outputs[0].text and streamed
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == len(out.prompt_token_ids)
    assert whole.usage.completion_tokens == len(out.outputs[0].token_ids)


@pytest.mark.parametrize("wrong,says", [
    ("text", "is a text model's GGUF (architecture 'qwen3vl'), not an mmproj GGUF"),
    ("config.json", "is not a GGUF file"),
    ("missing.gguf", "does not exist"),
])
def test_an_mmproj_flag_naming_no_tower_stops_the_server_with_an_error_naming_it(pair, wrong, says):  # noqa: F811
    model_dir, text, mmproj, model, pad = pair
    path = {"text": text, "config.json": model_dir / "config.json"}.get(wrong, text.parent / wrong)
    done = subprocess.run([sys.executable, "-m", "ferry.cli", "serve", "--port", str(free_port()), "--model",
                           str(text), "--mmproj", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("ferry: error: mmproj") and repr(str(path)) in done.stderr, done.stderr
    assert says in done.stderr, done.stderr
    assert "serving" not in done.stdout
