"""Gemma 3's image prompt: ``<start_of_image>`` once per image in the chat template's text.

transformers' ``Gemma3Processor`` replaces each ``<start_of_image>`` with the full image sequence
``"\\n\\n<start_of_image>" + "<image_soft_token>" * N + "<end_of_image>\\n\\n"`` (N = config.json's
``mm_tokens_per_image``) and tokenizes the expanded text whole; this prompter does the same, so the
ids are the processor's. The image processor (transformers', from preprocessor_config.json) resizes
each image to the tower's square; pan-and-scan crops are off. Each image is one
:class:`ImageFeature` over its N soft tokens, the span the model attends to both ways in prefill.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ferry.core.multimodal import ImageFeature
from ferry.multimodal.processor import ImagePrompter, image_hash, load_prompter_parts

_DEFAULT_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def special_tokens(model_dir: Path) -> dict[str, str]:
    """The begin-of-image, end-of-image and soft image tokens from tokenizer_config.json (top-level
    keys, or transformers 5's ``extra_special_tokens``), else Gemma 3's."""
    cfg = _json(model_dir / "tokenizer_config.json")
    extra = cfg.get("extra_special_tokens") if isinstance(cfg.get("extra_special_tokens"), dict) else {}
    return {k: cfg.get(k) if isinstance(cfg.get(k), str) else extra.get(k) or v for k, v in _DEFAULT_TOKENS.items()}


class Gemma3Prompter(ImagePrompter):
    """The image prompter of a Gemma 3 model directory (see the module's docstring)."""

    placeholder = "<start_of_image>"
    image_token = "<image_soft_token>"

    def __init__(self, model_dir: Path, tokenizer: Any = None, preprocessor: dict[str, Any] | None = None,
                 config: dict[str, Any] | None = None) -> None:
        """``preprocessor``: preprocessor_config.json's fields in place of the directory's file;
        ``config``: config.json's fields over the directory's (an mmproj's)."""
        self.model_dir = Path(model_dir)
        self.tokenizer, self.image_processor = load_prompter_parts(self.model_dir, tokenizer, preprocessor)
        tokens = special_tokens(self.model_dir)
        self.placeholder, self.image_token = tokens["boi_token"], tokens["image_token"]
        config = {**_json(self.model_dir / "config.json"), **(config or {})}
        self.num_image_tokens = int(config.get("mm_tokens_per_image", 256))
        self.full_sequence = (f"\n\n{tokens['boi_token']}{tokens['image_token'] * self.num_image_tokens}"
                              f"{tokens['eoi_token']}\n\n")
        self.image_token_id = self._token_id(self.image_token)

    def process(self, images: list[Any]) -> list[dict[str, Any]]:
        """Each image resized and normalized to the tower's square: pixel_values [3, H, W]."""
        out = []
        for image in images:
            batch = self.image_processor(images=[image], do_pan_and_scan=False, return_tensors="pt")
            out.append({"pixel_values": batch["pixel_values"][0]})
        return out

    def encode(self, prompt_text: str, images: list[Any]) -> tuple[list[int], tuple[ImageFeature, ...]]:
        """Token ids of ``prompt_text`` with each ``<start_of_image>`` expanded, and one feature per image."""
        count = prompt_text.count(self.placeholder)
        if count != len(images):
            raise ValueError(f"the prompt has {count} image placeholder(s) for {len(images)} image(s)")
        if self.image_token in prompt_text:
            raise ValueError(f"the prompt holds {self.image_token!r} outside an image placeholder")
        processed = self.process(images)
        ids = self.tokenizer.encode(prompt_text.replace(self.placeholder, self.full_sequence))
        n = self.num_image_tokens
        spots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(spots) != n * len(images):
            raise ValueError(f"the prompt has {len(spots)} image tokens for {len(images)} image(s) of {n}")
        features = []
        for k, (image, data) in enumerate(zip(images, processed)):
            at = spots[k * n]
            if spots[k * n + n - 1] != at + n - 1:
                raise ValueError("an image's tokens are not contiguous in the prompt")
            features.append(ImageFeature(hash=image_hash(image), offset=at, length=n, data=data))
        return ids, tuple(features)
