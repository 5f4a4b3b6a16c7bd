"""Images through every API of a real `ferry serve` on 127.0.0.1: the openai SDK's chat
(``image_url``: a data: URL or an http URL) and Responses (``input_image``), the anthropic SDK's
``image`` blocks (base64, url). A tiny random Qwen3-VL (made by transformers, its image processor
saved beside it, a small chat template of its own) answers; the embedded text-only model refuses.
Every bad image is a 400 naming its field, and a request beside it runs as it would alone."""
from __future__ import annotations

import base64
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler

import anthropic
import openai
import pytest
from PIL import Image

from tests.test_images_input import png_header, serve_locally
from tests.test_server_hardening import logged_server
from tests.vl_models import CHAT_TEMPLATE as TEMPLATE

GREEDY = {"temperature": 0}  # sent as it is: this anthropic SDK takes no temperature argument
IMAGE_TOKENS = 16 + 2  # a 64x64 image: 8-pixel patches merged 2x2, between vision_start and vision_end


def png(w: int = 64, h: int = 64, k: int = 1) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise((w, h), 40 + k).convert("RGB").save(buf, "PNG")
    return buf.getvalue()


PNG = png()
B64 = base64.b64encode(PNG).decode()
DATA_URL = f"data:image/png;base64,{B64}"


def data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


class Images(BaseHTTPRequestHandler):
    """/a.png the test image; /big.png more than --image-url-max-bytes; /slow.png a 20 s trickle."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path not in ("/a.png", "/big.png", "/slow.png"):
            return self.send_error(404)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        try:
            if self.path == "/a.png":
                self.wfile.write(PNG)
            elif self.path == "/big.png":
                self.wfile.write(PNG + b"\0" * 60_000)
            else:
                for _ in range(400):
                    self.wfile.write(b"\0" * 10)
                    self.wfile.flush()
                    time.sleep(0.05)
        except OSError:  # the fetcher hung up: what the cap is for
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http():
    yield from serve_locally(Images)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """A `ferry serve` of the tiny Qwen3-VL, image URLs on for 127.0.0.1, tight image limits."""
    from tests.vl_models import make_vl_model

    path = tmp_path_factory.mktemp("vl") / "vl"
    path.mkdir()
    make_vl_model(path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    with logged_server("--model", str(path), "--enable-image-urls", "--allowed-media-domains", "127.0.0.1",
                       "--image-url-max-bytes", "40000", "--image-url-timeout", "1",
                       "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", "1000000") as proc:
        proc.name = "vl"  # its directory's
        yield proc


@pytest.fixture(scope="module")
def text_only():
    """A `ferry serve` of the embedded text-only model, image settings left at their defaults."""
    with logged_server() as proc:
        proc.name = "SmolLM2-135M-Instruct"
        yield proc


def oa(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


def an(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=120)


def chat_parts(*images: object, text: str = "w5 w7") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         *({"type": "image_url", "image_url": im} for im in images)]}]


def chat(srv, messages: list[dict], **kw):
    return oa(srv).chat.completions.create(model=srv.name, messages=messages, max_tokens=6, temperature=0, **kw)


def bad_chat(srv, messages: list[dict]) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        chat(srv, messages)
    return e.value.body


def test_an_image_is_answered_and_counted_in_usage_streaming_or_not(vl):
    plain = chat(vl, [{"role": "user", "content": "w5 w7"}])
    whole = chat(vl, chat_parts({"url": DATA_URL, "detail": "high"}))
    assert whole.usage.prompt_tokens == plain.usage.prompt_tokens + IMAGE_TOKENS
    assert whole.choices[0].message.content and whole.choices[0].message.content != plain.choices[0].message.content
    other = chat(vl, chat_parts({"url": data_url(png(k=9))}))  # as many tokens, other pixels: the model sees them
    assert other.usage.prompt_tokens == whole.usage.prompt_tokens
    assert other.choices[0].message.content != whole.choices[0].message.content
    chunks = list(chat(vl, chat_parts(DATA_URL), stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_an_image_url_is_fetched_and_answered_as_its_data_url(vl, http):
    by_data = chat(vl, chat_parts({"url": DATA_URL}))
    by_url = chat(vl, chat_parts({"url": f"{http}/a.png"}))
    assert by_url.choices[0].message.content == by_data.choices[0].message.content
    assert by_url.usage.prompt_tokens == by_data.usage.prompt_tokens


def test_responses_and_anthropic_images(vl, http):
    want = chat(vl, chat_parts({"url": DATA_URL}))
    r = oa(vl).responses.create(model="vl", max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "w5 w7"},
                                     {"type": "input_image", "image_url": DATA_URL, "detail": "auto"}]}])
    assert r.output_text == want.choices[0].message.content and r.usage.input_tokens == want.usage.prompt_tokens
    for source in ({"type": "base64", "media_type": "image/png", "data": B64}, {"type": "url", "url": f"{http}/a.png"}):
        m = an(vl).messages.create(model="vl", max_tokens=6, extra_body=GREEDY, messages=[
            {"role": "user", "content": [{"type": "text", "text": "w5 w7"}, {"type": "image", "source": source}]}])
        assert m.content[0].text == want.choices[0].message.content
        assert m.usage.input_tokens == want.usage.prompt_tokens
    with an(vl).messages.stream(model="vl", max_tokens=6, extra_body=GREEDY, messages=[
            {"role": "user", "content": [{"type": "text", "text": "w5 w7"}, {"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": B64}}]}]) as s:
        assert s.get_final_text() == want.choices[0].message.content


BAD = [  # (the image_url part, what the error says); the field is messages[0].content[1].image_url.url
    (data_url(b"hello, not an image"), "not an image"),
    (data_url(PNG[: len(PNG) // 2]), "truncated"),
    (data_url(png_header(100_000, 100_000)), "pixels"),  # a decompression bomb: its header alone
    (data_url(png_header(2000, 2000)), "more than 1,000,000 pixels (--max-image-pixels)"),
    (data_url(png_header(0, 0)), "no pixels"),
    (data_url(b""), "empty"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("/etc/hostname", "data: URL"),
    ("http://localhost/a.png", "not allowed"),
    ("file:///etc/hostname", "file:// image URLs are not allowed"),
]


@pytest.mark.parametrize("url,says", BAD)
def test_a_bad_image_is_a_400_naming_its_field(vl, url, says):
    err = bad_chat(vl, chat_parts({"url": url}))
    assert err["param"] == "messages[0].content[1].image_url.url" and says in err["message"], err


def test_image_urls_past_their_caps_are_a_400(vl, http):
    for path, says in (("big.png", "larger than 40,000 bytes"), ("slow.png", "took more than 1 s"),
                       ("missing.png", "HTTP 404")):
        err = bad_chat(vl, chat_parts({"url": f"{http}/{path}"}))
        assert err["param"] == "messages[0].content[1].image_url.url" and says in err["message"], err


def test_more_images_than_allowed_is_a_400(vl):
    err = bad_chat(vl, chat_parts(DATA_URL, DATA_URL, DATA_URL))
    assert err["param"] == "messages[0].content[3].image_url" and "more than 2" in err["message"]


def test_bad_images_in_responses_and_anthropic_name_their_fields(vl):
    with pytest.raises(openai.BadRequestError) as e:
        oa(vl).responses.create(model="vl", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "w5"}, {"type": "input_image", "image_url": data_url(b"nope")}]}])
    assert e.value.body["param"] == "input[0].content[1].image_url"
    for source, field in (({"type": "base64", "media_type": "image/bmp", "data": B64}, "source.media_type"),
                          ({"type": "base64", "media_type": "image/png", "data": "bm9wZQ=="}, "source.data"),
                          ({"type": "file", "file_id": "f"}, "source.type")):
        with pytest.raises(anthropic.BadRequestError) as e:
            an(vl).messages.create(model="vl", max_tokens=4, messages=[
                {"role": "user", "content": [{"type": "text", "text": "w5"}, {"type": "image", "source": source}]}])
        assert e.value.body["error"]["message"].startswith(f"messages[0].content[1].{field}"), e.value.body


def test_bad_images_leave_a_request_beside_them_as_it_was(vl):
    alone = chat(vl, chat_parts(DATA_URL))
    with ThreadPoolExecutor(8) as pool:
        good = pool.submit(chat, vl, chat_parts(DATA_URL))
        bad = [pool.submit(bad_chat, vl, chat_parts({"url": url})) for url, _ in BAD[:6]]
        assert all(b.result()["param"] for b in bad)
        assert good.result().choices[0].message.content == alone.choices[0].message.content


def test_a_text_only_model_refuses_images_naming_the_field(text_only):
    err = bad_chat(text_only, chat_parts({"url": DATA_URL}))
    assert err["param"] == "messages[0].content[1].image_url.url" and "does not accept images" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oa(text_only).responses.create(model=text_only.name, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": DATA_URL}]}])
    assert e.value.body["param"] == "input[0].content[0].image_url"
    with pytest.raises(anthropic.BadRequestError) as e:
        an(text_only).messages.create(model=text_only.name, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}]}])
    assert "messages[0].content[0].source.data: model" in json.dumps(e.value.body)
    # Image URLs are off unless the server's operator turns them on.
    err = bad_chat(text_only, chat_parts({"url": "https://example.com/a.png"}))
    assert err["param"] == "messages[0].content[1].image_url.url" and "--enable-image-urls" in err["message"]
    assert chat(text_only, [{"role": "user", "content": "Hi"}]).choices[0].message.content


def _metric(srv, name: str) -> float:
    import httpx

    for line in httpx.get(srv.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_count_the_encoders_images_its_time_and_cache_hits(vl):
    names = ("ferry:encoder_images_total", "ferry:encoder_cache_hits_total", "ferry:encoder_time_seconds_count",
             "ferry:encoder_time_seconds_sum")
    before = {n: _metric(vl, n) for n in names}
    chat(vl, chat_parts({"url": data_url(png(k=21))}))  # a new image: encoded
    twice = data_url(png(k=22))  # (png draws new noise at every call)
    chat(vl, chat_parts({"url": twice}, {"url": twice}))  # the same image twice in one prompt: one hit
    after = {n: _metric(vl, n) for n in names}
    assert after["ferry:encoder_images_total"] - before["ferry:encoder_images_total"] == 2
    assert after["ferry:encoder_cache_hits_total"] - before["ferry:encoder_cache_hits_total"] == 1
    assert after["ferry:encoder_time_seconds_count"] - before["ferry:encoder_time_seconds_count"] == 2
    assert after["ferry:encoder_time_seconds_sum"] > before["ferry:encoder_time_seconds_sum"]
