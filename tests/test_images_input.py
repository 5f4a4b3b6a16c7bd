"""Images as requests bring them (``ferry.multimodal.images`` and ``parts``): decoded to upright RGB,
one frame, and every bad one refused with an ImageError naming its field. Images are made here,
tiny; URLs are served by an http.server on 127.0.0.1 that the test starts."""
from __future__ import annotations

import base64
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from ferry.multimodal.images import ImageError, ImageLimits, load_image
from ferry.multimodal.parts import ImageRef, load_images, message_content, take_images

LIMITS = ImageLimits()
RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)


def encoded(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` and that holds (almost) no pixel data."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    head = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def near(pixel: tuple[int, ...], want: tuple[int, int, int], tol: int = 40) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(pixel, want))


def load(source, limits: ImageLimits = LIMITS) -> Image.Image:
    return load_image(source, limits=limits, field="messages[0].content[1].image_url.url")


def refused(source, says: str, limits: ImageLimits = LIMITS) -> ImageError:
    with pytest.raises(ImageError) as e:
        load(source, limits)
    assert e.value.field == "messages[0].content[1].image_url.url" and says in e.value.message, e.value.message
    return e.value


def test_exif_orientation_is_applied():
    # 40x20: left half red, right half blue; EXIF 6 says "rotate 90 degrees clockwise to show".
    img = Image.new("RGB", (40, 20), RED)
    img.paste(BLUE, (20, 0, 40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    out = load(encoded(img, "JPEG", exif=exif.tobytes(), quality=95))
    assert out.size == (20, 40) and out.mode == "RGB"
    assert near(out.getpixel((10, 5)), RED) and near(out.getpixel((10, 35)), BLUE)


def test_transparency_is_composited_on_white():
    rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 0))
    rgba.putpixel((0, 0), (0, 0, 255, 255))
    out = load(data_url(encoded(rgba, "PNG")))
    assert out.mode == "RGB" and out.getpixel((4, 4)) == WHITE and out.getpixel((0, 0)) == BLUE
    la = load(encoded(Image.new("LA", (4, 4), (0, 0)), "PNG"))
    assert la.getpixel((1, 1)) == WHITE


def test_palette_grey_cmyk_and_16_bit_become_rgb():
    pal = Image.new("P", (4, 4), 1)
    pal.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    pal.info["transparency"] = 0
    pal.putpixel((0, 0), 0)  # the transparent index
    out = load(encoded(pal, "PNG", transparency=0))
    assert out.mode == "RGB" and out.getpixel((1, 1)) == RED and out.getpixel((0, 0)) == WHITE
    assert load(encoded(Image.new("L", (4, 4), 77), "PNG")).getpixel((0, 0)) == (77, 77, 77)
    assert near(load(encoded(Image.new("CMYK", (4, 4), (0, 255, 255, 0)), "JPEG")).getpixel((0, 0)), RED)
    grey16 = Image.new("I;16", (4, 4), 128 * 256)
    assert near(load(encoded(grey16, "PNG")).getpixel((0, 0)), (128, 128, 128), 2)


def test_animation_gives_its_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in (RED, BLUE, BLUE)]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    out = load(gif)
    assert out.mode == "RGB" and near(out.getpixel((4, 4)), RED, 8)


def test_a_pil_image_and_a_path_are_taken(tmp_path):
    assert load(Image.new("RGBA", (3, 5), (0, 0, 0, 0))).getpixel((1, 1)) == WHITE
    path = tmp_path / "a.png"
    path.write_bytes(encoded(Image.new("RGB", (6, 4), BLUE), "PNG"))
    assert load(path).size == (6, 4)


@pytest.mark.parametrize("data,says", [
    (b"hello, not an image", "not an image"),
    (b"", "empty"),
    (png_header(0, 0), "no pixels"),
    (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "not an image"),  # a decoder that runs Ghostscript
])
def test_what_is_not_an_image_is_refused(data, says):
    refused(data, says)


def test_a_truncated_image_is_refused():
    whole = encoded(Image.effect_noise((64, 64), 50).convert("RGB"), "PNG")
    refused(whole[: len(whole) // 2], "truncated")
    jpeg = encoded(Image.effect_noise((64, 64), 50).convert("RGB"), "JPEG")
    refused(jpeg[: len(jpeg) // 2], "truncated")


def test_a_decompression_bomb_is_refused_before_it_is_decoded():
    refused(png_header(100_000, 100_000), "pixels")  # past Pillow's own bound
    refused(png_header(6000, 6000), "more than 33,554,432 pixels")  # within Pillow's, past ours
    small = ImageLimits(max_pixels=100)
    refused(encoded(Image.new("RGB", (11, 10)), "PNG"), "11x10", small)
    refused(Image.new("RGB", (11, 10)), "11x10", small)
    assert load(encoded(Image.new("RGB", (10, 10)), "PNG"), small).size == (10, 10)


def test_a_zero_sized_pil_image_is_refused():
    refused(Image.new("RGB", (0, 3)), "no pixels")


@pytest.mark.parametrize("url,says", [
    ("data:image/png,abc", "base64"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("/etc/hostname", "data: URL"),  # a server never reads a path a request names
    ("ftp://example.com/a.png", "data: URL"),
    ("https://example.com/a.png", "does not fetch image URLs"),
    ("file:///etc/hostname", "file:// image URLs are not allowed"),
])
def test_bad_urls_are_refused(url, says):
    refused(url, says)


def test_file_urls_only_under_the_allowed_path(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.png").write_bytes(encoded(Image.new("RGB", (2, 3)), "PNG"))
    (tmp_path / "out.png").write_bytes(encoded(Image.new("RGB", (2, 3)), "PNG"))
    limits = ImageLimits(local_media_path=str(tmp_path / "in"))
    assert load(f"file://{tmp_path}/in/a.png", limits).size == (2, 3)
    refused(f"file://{tmp_path}/in/../out.png", "not under the allowed", limits)


class Images(BaseHTTPRequestHandler):
    """/ok.png an image; /big.png more bytes than the cap; /slow.png a trickle; /hop a redirect to
    /ok.png, /away one to the same image at localhost."""

    png = encoded(Image.new("RGB", (5, 7), BLUE), "PNG")

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path in ("/hop", "/away"):
            self.send_response(302)
            port = self.server.server_address[1]
            self.send_header("Location", "/ok.png" if self.path == "/hop" else f"http://localhost:{port}/ok.png")
            self.end_headers()
            return
        if self.path not in ("/ok.png", "/big.png", "/slow.png"):
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path == "/big.png":
            self.end_headers()  # no Content-Length: the cap is found while reading
            self.wfile.write(self.png + b"\0" * 50_000)
        elif self.path == "/slow.png":
            self.end_headers()
            try:
                for _ in range(400):  # 20 s
                    self.wfile.write(b"\0" * 10)
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass
        else:
            self.send_header("Content-Length", str(len(self.png)))
            self.end_headers()
            self.wfile.write(self.png)

    def log_message(self, *args):
        pass


def serve_locally(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """An HTTP server of ``handler`` on 127.0.0.1 in a thread; yields its base URL, then stops it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def http():
    yield from serve_locally(Images)


def test_urls_are_fetched_within_their_caps(http):
    on = ImageLimits(url_fetch=True, allowed_domains=("127.0.0.1",), url_max_bytes=10_000, url_timeout=1.0)
    assert load(f"{http}/ok.png", on).size == (5, 7)
    assert load(f"{http}/hop", on).size == (5, 7)
    refused(f"{http}/ok.png", "does not fetch")
    refused(f"{http}/ok.png", "not allowed", ImageLimits(url_fetch=True, allowed_domains=("example.com",)))
    refused(f"{http}/big.png", "larger than 10,000 bytes", on)
    t0 = time.monotonic()
    refused(f"{http}/slow.png", "took more than 1 s", on)
    assert time.monotonic() - t0 < 10  # the trickle lasts 20 s: the cap, not the server, ended it
    refused(f"{http}/missing", "HTTP 404", on)


def test_a_redirect_may_not_leave_the_allowed_hosts(http):
    on = ImageLimits(url_fetch=True, allowed_domains=("127.0.0.1",))
    refused(f"{http}/away", "'localhost' is not allowed", on)  # the same server, by a name not allowed
    assert load(f"{http}/away", ImageLimits(url_fetch=True)).size == (5, 7)


def test_parts_of_every_api_become_template_parts():
    png = data_url(encoded(Image.new("RGB", (4, 4), RED), "PNG"))
    content = [{"type": "text", "text": "look: "},
               {"type": "image_url", "image_url": {"url": png, "detail": "low"}},
               {"type": "image_url", "image_url": png},
               {"type": "input_image", "image_url": png, "detail": "auto"}]
    parts = message_content(content, "messages[0].content", "user")
    conv, refs = take_images([{"role": "user", "content": parts}])
    assert conv[0]["content"] == [{"type": "text", "text": "look: "}] + [{"type": "image"}] * 3
    assert [r.field for r in refs] == ["messages[0].content[1].image_url.url", "messages[0].content[2].image_url",
                                       "messages[0].content[3].image_url"]
    assert message_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "m", "user") == "ab"
    with pytest.raises(ImageError) as e:
        message_content(content, "messages[1].content", "assistant")
    assert e.value.field == "messages[1].content[1]"
    with pytest.raises(ImageError) as e:
        message_content([{"type": "image", "image": "/etc/hostname"}], "messages[0].content", "user")
    assert e.value.field == "messages[0].content" and "not supported" in e.value.message


def test_more_images_than_allowed_are_refused_before_any_is_decoded():
    refs = [ImageRef(b"not decoded", f"messages[0].content[{j}]") for j in range(3)]
    with pytest.raises(ImageError) as e:
        load_images(refs, ImageLimits(max_images=2))
    assert e.value.field == "messages[0].content[2]" and "more than 2" in e.value.message


def test_llm_chat_takes_images_as_paths_bytes_pil_and_urls(tmp_path):
    from ferry import LLM, SamplingParams
    from tests.test_server_images import TEMPLATE
    from tests.vl_models import image, make_vl_model

    make_vl_model(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    llm = LLM(model=str(tmp_path), num_kv_blocks=64, block_size=4)
    pic = image(64, 64, 1)
    (tmp_path / "a.png").write_bytes(encoded(pic, "PNG"))
    sp = SamplingParams(temperature=0, max_tokens=4)
    ids, feats = llm.engine.image_prompter.encode(f"w5 {llm.engine.image_prompter.placeholder} w1 ", [pic])
    want = llm.generate(ids, sp, use_tqdm=False, images=[feats])[0]
    sources = [{"type": "image", "image": pic}, {"type": "image", "image": str(tmp_path / "a.png")},
               {"type": "image", "image": encoded(pic, "PNG")},
               {"type": "image_url", "image_url": {"url": data_url(encoded(pic, "PNG"))}}]
    outs = llm.chat([[{"role": "user", "content": [{"type": "text", "text": "w5"}, part]}] for part in sources], sp,
                    use_tqdm=False)
    for out in outs:
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ImageError) as e:
        llm.chat([{"role": "user", "content": [{"type": "image", "image": b"nope"}]}], sp, use_tqdm=False)
    assert e.value.field == "messages[0].content[0].image"
