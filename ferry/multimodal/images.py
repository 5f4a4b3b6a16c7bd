"""Images as requests bring them, decoded to what every model family takes: RGB, upright, one frame.

``load_image`` takes a ``data:`` URL (base64), an ``http(s)://`` URL (fetched only when
``ImageLimits.url_fetch`` allows it, from the allowed domains, within a size and a time cap), a
``file://`` URL under ``ImageLimits.local_media_path``, raw bytes, a ``pathlib.Path`` (the
caller's own file: the offline API) or a PIL image. Every bad input raises :class:`ImageError`
naming the request field it came from, so that a server answers 400 and nothing else is touched.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from PIL import Image, ImageOps, UnidentifiedImageError

# Formats decoded: the common web and camera ones. Others (EPS, which runs Ghostscript; PSD; ...)
# are refused, so that a request never reaches a rarely used decoder.
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")  # JPEG takes a camera's MPO too
# Anthropic's image media types (its API refuses others).
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
MAX_REDIRECTS = 3


class ImageError(ValueError):
    """An image that cannot be used, and the request field it came from."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message, self.field = message, field


@dataclass(frozen=True)
class ImageLimits:
    """What a request's images may be (``ferry serve``'s image settings)."""

    max_pixels: int = 2**25  # --max-image-pixels: width x height of one image, decoded
    max_images: int = 16  # --limit-mm-per-prompt image=N: images in one request
    url_fetch: bool = False  # --enable-image-urls: fetch http(s) URLs at all
    url_max_bytes: int = 20 * 2**20  # --image-url-max-bytes: a fetched image's size
    url_timeout: float = 10.0  # --image-url-timeout: seconds for one fetch, all of it
    allowed_domains: tuple[str, ...] = ()  # --allowed-media-domains: hosts URLs may name (empty: any)
    local_media_path: str | None = None  # --allowed-local-media-path: file:// URLs under it

    def __post_init__(self) -> None:
        for name in ("max_pixels", "max_images", "url_max_bytes", "url_timeout"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def load_image(source: str | bytes | Image.Image | Path, *, limits: ImageLimits, field: str) -> Image.Image:
    """The image ``source`` holds, decoded: RGB, EXIF orientation applied, the first frame of an
    animation, transparency over white. Raises ImageError naming ``field`` on any bad input."""
    if isinstance(source, Image.Image):
        return normalized(source, limits, field)
    if isinstance(source, Path):
        return decode(read_path(source, field), limits, field)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode(bytes(source), limits, field)
    if not isinstance(source, str):
        raise ImageError(f"{field}: an image must be a URL, bytes or an image, got {type(source).__name__}", field)
    scheme = source[:8].split(":", 1)[0].lower() if ":" in source[:8] else ""
    if scheme == "data":
        return decode(data_url_bytes(source, field), limits, field)
    if scheme in ("http", "https"):
        return decode(fetch(source, limits, field), limits, field)
    if scheme == "file":
        return decode(read_path(local_media(source, limits, field), field), limits, field)
    raise ImageError(f"{field}: an image URL must be a data: URL (base64) or an http(s):// URL, got "
                     f"{source[:40]!r}", field)


def data_url_bytes(url: str, field: str) -> bytes:
    """The bytes of a ``data:[<media type>];base64,<data>`` URL."""
    head, comma, data = url.partition(",")
    if not comma or not head.lower().endswith(";base64"):
        raise ImageError(f"{field}: a data: URL must be base64 (data:image/png;base64,...)", field)
    media = head[5:].split(";", 1)[0].strip().lower()
    if media and not media.startswith("image/"):
        raise ImageError(f"{field}: a data: URL of type {media!r} is not an image", field)
    return b64decode(data, field)


def b64decode(data: str, field: str) -> bytes:
    """Base64 text (whitespace allowed), strictly decoded."""
    try:
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{field}: the image data is not valid base64", field) from None


def read_path(path: Path, field: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ImageError(f"{field}: cannot read the image file {str(path)!r}: {e.strerror or e}", field) from None


def local_media(url: str, limits: ImageLimits, field: str) -> Path:
    """The file a ``file://`` URL names, which must lie under ``limits.local_media_path``."""
    if limits.local_media_path is None:
        raise ImageError(f"{field}: file:// image URLs are not allowed on this server (its operator can allow a "
                         f"directory with --allowed-local-media-path)", field)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ImageError(f"{field}: a file:// URL must name a local file", field)
    root = os.path.realpath(limits.local_media_path)
    path = os.path.realpath(unquote(parts.path))  # links resolved: none may lead out of the root
    if os.path.commonpath([root, path]) != root:
        raise ImageError(f"{field}: the file is not under the allowed local media path", field)
    return Path(path)


def check_url(url: str, limits: ImageLimits, field: str) -> None:
    """An http(s) URL the server may fetch: fetching is on and its host is allowed."""
    if not limits.url_fetch:
        raise ImageError(f"{field}: this server does not fetch image URLs; send the image as a data: URL "
                         f"(its operator can allow URLs with --enable-image-urls)", field)
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ImageError(f"{field}: not an http(s) URL with a host: {url[:80]!r}", field)
    if limits.allowed_domains and parts.hostname.lower() not in limits.allowed_domains:
        raise ImageError(f"{field}: the domain {parts.hostname!r} is not allowed for image URLs "
                         f"(--allowed-media-domains)", field)


def fetch(url: str, limits: ImageLimits, field: str) -> bytes:
    """The body at ``url``: at most ``url_max_bytes``, all of it within ``url_timeout`` seconds;
    redirects followed only to allowed hosts."""
    import httpx

    deadline = time.monotonic() + limits.url_timeout
    cap = limits.url_max_bytes
    try:
        with httpx.Client(timeout=limits.url_timeout, follow_redirects=False, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                check_url(url, limits, field)
                with client.stream("GET", url) as r:
                    if r.is_redirect and "location" in r.headers:
                        url = str(r.url.join(r.headers["location"]))
                        continue
                    if r.status_code != 200:
                        raise ImageError(f"{field}: fetching the image URL gave HTTP {r.status_code}", field)
                    length = r.headers.get("content-length")
                    if length is not None and length.isdigit() and int(length) > cap:
                        raise too_large(field, cap)
                    body = bytearray()
                    for chunk in r.iter_bytes():  # as it comes, so that a trickle meets the deadline
                        body += chunk
                        if len(body) > cap:
                            raise too_large(field, cap)
                        if time.monotonic() > deadline:
                            raise too_slow(field, limits)
                    return bytes(body)
    except httpx.TimeoutException:
        raise too_slow(field, limits) from None
    except httpx.HTTPError as e:
        raise ImageError(f"{field}: fetching the image URL failed: {type(e).__name__}", field) from None
    raise ImageError(f"{field}: the image URL redirected more than {MAX_REDIRECTS} times", field)


def too_large(field: str, cap: int) -> ImageError:
    return ImageError(f"{field}: the image at the URL is larger than {cap:,} bytes (--image-url-max-bytes)", field)


def too_slow(field: str, limits: ImageLimits) -> ImageError:
    return ImageError(f"{field}: fetching the image URL took more than {limits.url_timeout:g} s "
                      f"(--image-url-timeout)", field)


def decode(data: bytes, limits: ImageLimits, field: str) -> Image.Image:
    """Encoded image bytes as a normalized image; its size is checked before its pixels are decoded."""
    if not data:
        raise ImageError(f"{field}: the image is empty (0 bytes)", field)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own cap is checked below
            image = Image.open(io.BytesIO(data), formats=FORMATS)
        return normalized(image, limits, field)  # the size is checked first, from the header alone
    except ImageError:
        raise
    except Image.DecompressionBombError:
        raise bomb(field, limits) from None
    except UnidentifiedImageError:
        raise ImageError(f"{field}: not an image (or not one of {', '.join(FORMATS)}), or one with no pixels",
                         field) from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"{field}: the image could not be decoded (truncated or corrupt): {e}", field) from None


def bomb(field: str, limits: ImageLimits) -> ImageError:
    return ImageError(f"{field}: the image claims more than {limits.max_pixels:,} pixels (--max-image-pixels)", field)


def check_size(size: tuple[int, int], limits: ImageLimits, field: str) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageError(f"{field}: the image has no pixels ({width}x{height})", field)
    if width * height > limits.max_pixels:
        raise ImageError(f"{field}: the image is {width}x{height}, more than {limits.max_pixels:,} pixels "
                         f"(--max-image-pixels)", field)


def normalized(image: Image.Image, limits: ImageLimits, field: str) -> Image.Image:
    """``image`` (its first frame: Pillow opens at frame 0) upright and in RGB, transparency over white."""
    check_size(image.size, limits, field)
    image.load()
    return to_rgb(ImageOps.exif_transpose(image) or image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB pixels: alpha (an RGBA/LA image's, or a palette's transparent colour) over white."""
    if image.mode == "RGB":
        return image.copy()
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if image.mode.startswith("I;16"):  # 16-bit grey: scaled to 8 bits, not clipped
        image = image.convert("I").point(lambda v: v / 256).convert("L")
    return image.convert("RGB")
