"""A model family's image prompt: placeholder expansion, the image processor, image hashes.

``ImagePrompter.for_model(model_dir)`` is None for a text-only model. ``encode`` takes the chat
template's rendered text, holding the family's single placeholder once per image, and returns
the prompt token ids with every placeholder grown to the image's number of tokens, plus one
:class:`ImageFeature` per image (its span, content hash and processed pixels).
"""
from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from ferry.core.multimodal import ImageFeature
from ferry.model.arch.idefics3 import IDEFICS3_ARCHITECTURES
from ferry.model.arch.qwen3_vl import IMAGE_ARCHITECTURES

# transformers' processors are loaded lazily and are not safe to load from two threads at once.
_LOAD_LOCK = threading.Lock()


def image_hash(image: Any) -> bytes:
    """sha256 of a decoded image's mode, size and pixel bytes (the prefix cache's key for it)."""
    h = hashlib.sha256()
    h.update(image.mode.encode())
    h.update(repr(tuple(image.size)).encode())
    h.update(image.tobytes())
    return h.digest()


def model_architecture(model_dir: Path) -> str | None:
    """The first architecture named in a model directory's config.json (None without one)."""
    cfg = Path(model_dir) / "config.json"
    if not cfg.is_file():
        return None
    archs = json.loads(cfg.read_text()).get("architectures") or [None]
    return archs[0]


def load_prompter_parts(model_dir: Path, tokenizer: Any = None, preprocessor: dict[str, Any] | None = None
                        ) -> tuple[Any, Any]:
    """An image prompter's tokenizer (``tokenizer``, else the directory's) and transformers' image
    processor of the directory, or of ``preprocessor`` (preprocessor_config.json's fields, an
    mmproj's) in place of its file."""
    from transformers import AutoImageProcessor

    if tokenizer is None:
        from ferry.model.tokenizer import Tokenizer

        tokenizer = Tokenizer(model_dir)
    with _LOAD_LOCK:
        if preprocessor is None:
            return tokenizer, AutoImageProcessor.from_pretrained(str(model_dir))
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:  # through a file: transformers picks the class as for a directory
            (Path(tmp) / "preprocessor_config.json").write_text(json.dumps(preprocessor))
            return tokenizer, AutoImageProcessor.from_pretrained(tmp)


class ImagePrompter:
    """Qwen3-VL's (and Qwen3.5's) image prompt: ``<|vision_start|><|image_pad|><|vision_end|>`` per image."""

    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    image_token = "<|image_pad|>"

    def __init__(self, model_dir: Path, tokenizer: Any = None, preprocessor: dict[str, Any] | None = None) -> None:
        """``preprocessor``: preprocessor_config.json's fields (an mmproj's, ``ferry.model.mmproj``)
        in place of the directory's file."""
        self.model_dir = Path(model_dir)
        self.tokenizer, self.image_processor = load_prompter_parts(self.model_dir, tokenizer, preprocessor)
        self.merge_size = int(getattr(self.image_processor, "merge_size", 2))
        self.image_token_id = self._token_id(self.image_token)

    @classmethod
    def for_model(cls, model_dir: Path | str, tokenizer: Any = None, preprocessor: dict[str, Any] | None = None,
                  mmproj: Any = None, architecture: str | None = None) -> ImagePrompter | None:
        """The prompter of a model directory, or None for a model that takes no images.
        ``preprocessor``: image rules in place of the directory's file; ``mmproj`` (a GGUF's tower,
        ``ferry.model.mmproj.Mmproj``): its image rules and config fields, for a GGUF's directory
        (which has neither); ``architecture``: the image model's, where config.json names its text model."""
        architecture = architecture or model_architecture(Path(model_dir))
        config = None
        if mmproj is not None:
            preprocessor, config = mmproj.preprocessor, {**mmproj.config, "vision_config": mmproj.vision_config}
        if architecture not in IMAGE_ARCHITECTURES:
            return None
        if architecture in IDEFICS3_ARCHITECTURES:  # tiles, row/column markers and a global image
            from ferry.multimodal.idefics3 import Idefics3Prompter

            return Idefics3Prompter(Path(model_dir), tokenizer, preprocessor,  # type: ignore[return-value]
                                    architecture, config)
        if architecture == "Gemma3ForConditionalGeneration":  # <start_of_image> grown to its soft tokens
            from ferry.multimodal.gemma3 import Gemma3Prompter

            return Gemma3Prompter(Path(model_dir), tokenizer, preprocessor, config)
        return cls(Path(model_dir), tokenizer, preprocessor)

    def _token_id(self, token: str) -> int:
        ids = self.tokenizer.encode(token)
        if len(ids) != 1:
            raise ValueError(f"the tokenizer has no single token for {token!r}")
        return ids[0]

    def process(self, images: list[Any]) -> list[dict[str, Any]]:
        """Each image through the family's image processor: its pixel patches and (t, h, w) grid."""
        out = []
        for image in images:
            batch = self.image_processor(images=[image], return_tensors="pt")
            out.append({"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"][0]})
        return out

    def num_tokens(self, data: dict[str, Any]) -> int:
        """Placeholder tokens of one processed image (its merged patches)."""
        t, h, w = (int(x) for x in data["image_grid_thw"])
        return t * h * w // (self.merge_size ** 2)

    def encode(self, prompt_text: str, images: list[Any]) -> tuple[list[int], tuple[ImageFeature, ...]]:
        """Token ids of ``prompt_text`` with each image's placeholder expanded, and the images' features."""
        count = prompt_text.count(self.placeholder)
        if count != len(images):
            raise ValueError(f"the prompt has {count} image placeholder(s) for {len(images)} image(s)")
        if self.image_token in prompt_text.replace(self.placeholder, ""):
            raise ValueError(f"the prompt holds {self.image_token!r} outside an image placeholder")
        processed = self.process(images)
        pieces = prompt_text.split(self.placeholder)
        ids: list[int] = []
        features = []
        start_id, end_id = (self._token_id(t) for t in self.placeholder.split(self.image_token))
        for i, piece in enumerate(pieces):
            ids.extend(self.tokenizer.encode(piece) if piece else [])
            if i == len(images):
                break
            n = self.num_tokens(processed[i])
            ids.append(start_id)
            features.append(ImageFeature(hash=image_hash(images[i]), offset=len(ids), length=n, data=processed[i]))
            ids.extend([self.image_token_id] * n)
            ids.append(end_id)
        return ids, tuple(features)
