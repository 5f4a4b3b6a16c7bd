"""Chat content parts as every API sends them, turned into what a chat template renders.

A message's content stays a string while it holds no image (what every text model's template
expects). With images it becomes Hugging Face's list of parts: ``{"type": "text", "text": ...}``
and ``{"type": "image", "image": ImageRef}``; ``take_images`` then leaves the template a bare
``{"type": "image"}`` per image and gives the sources, in the order the template renders them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferry.multimodal.images import ImageError, ImageLimits, load_image

TEXT_TYPES = ("text", "input_text", "output_text")
URL_SCHEMES = ("data:", "http://", "https://", "file://")


@dataclass(frozen=True)
class ImageRef:
    """An image not yet loaded: its source (a URL, bytes, a Path or a PIL image) and its field."""

    source: Any
    field: str


def image_part(source: Any, field: str) -> dict[str, Any]:
    """The content part of an image from ``field`` (what each API's own image block becomes)."""
    return {"type": "image", "image": ImageRef(source, field)}


def message_content(content: Any, field: str, role: str | None, own_images: bool = False) -> str | list[dict[str, Any]]:
    """A message's content as the template renders it: its text when it holds no image, else its
    text and image parts in order. OpenAI's ``image_url`` parts (a URL, or ``{"url": ...}``;
    ``detail`` is ignored) and the Responses API's ``input_image`` are images; ``own_images``: so is
    ``{"type": "image", "image": PATH | bytes | PIL image}`` (the offline API's). Images only in
    user messages. Raises ImageError naming the field at fault."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ImageError(f"{field} must be a string or a list of content parts", field)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{field}[{j}]"
        if not isinstance(part, dict):
            raise ImageError(f"{at} must be a content part (an object with a type), got {part!r:.60}", at)
        if part.get("type") in TEXT_TYPES:
            parts.append({"type": "text", "text": str(part.get("text", ""))})
            continue
        ref = image_ref(part, at, own_images)
        if ref is None:
            raise ImageError(f"{field}: content of type {part.get('type')!r} is not supported (text and images "
                             f"only)", field)
        if role != "user":
            raise ImageError(f"{at}: images are taken in user messages only, not in a {role} message", at)
        parts.append({"type": "image", "image": ref})
    if not any(p["type"] == "image" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def image_ref(part: dict[str, Any], at: str, own_images: bool) -> ImageRef | None:
    """The image a content part names (None: the part is not an image)."""
    kind = part.get("type")
    if kind == "image_url":  # OpenAI chat: {"url": ..., "detail": ...}, or the URL itself (as vLLM takes it)
        value = part.get("image_url")
        url, where = ((value.get("url"), f"{at}.image_url.url") if isinstance(value, dict)
                      else (value, f"{at}.image_url"))
        return ImageRef(url_string(url, where), where)
    if kind == "input_image":  # the Responses API
        if part.get("image_url") is None and part.get("file_id") is not None:
            raise ImageError(f"{at}.file_id: files are not served here; send the image as image_url", f"{at}.file_id")
        return ImageRef(url_string(part.get("image_url"), f"{at}.image_url"), f"{at}.image_url")
    if kind == "image":
        value = part.get("image")
        if isinstance(value, ImageRef):  # an API's own image block, converted already
            return value
        if own_images:
            if isinstance(value, str) and not value.lower().startswith(URL_SCHEMES):
                value = Path(value)  # the offline API's caller names its own file
            return ImageRef(value, f"{at}.image")
    return None


def url_string(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise ImageError(f"{field} must be an image URL (a non-empty string), got {value!r:.60}", field)
    return value


def take_images(conv: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """The conversation as the template gets it (each image a bare ``{"type": "image"}``) and the
    images' sources in the order the template renders them."""
    refs: list[ImageRef] = []
    out = []
    for m in conv:
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
            bare = []
            for p in content:
                if p.get("type") == "image":
                    refs.append(p["image"])
                    p = {"type": "image"}
                bare.append(p)
            m = {**m, "content": bare}
        out.append(m)
    return out, refs


def load_images(refs: list[ImageRef], limits: ImageLimits) -> list[Any]:
    """Each image decoded (``load_image``), after the count is checked; ImageError names the field."""
    if len(refs) > limits.max_images:
        extra = refs[limits.max_images]
        raise ImageError(f"{extra.field}: {len(refs)} images in one request, more than {limits.max_images} "
                         f"(--limit-mm-per-prompt)", extra.field)
    return [load_image(r.source, limits=limits, field=r.field) for r in refs]
