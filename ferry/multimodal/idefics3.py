"""Idefics3's and SmolVLM's image prompt: ``<image>`` once per image in the chat template's text.

transformers' image processor (read from the model's preprocessor_config.json) splits an image
into square tiles plus a global (whole image) tile; transformers' processor's own
``replace_image_token`` writes each image's layout::

    <fake_token_around_image><row_1_col_1><image>*N ... <row_1_col_C><image>*N \\n ... (R rows)
    \\n<fake_token_around_image><global-img><image>*N<fake_token_around_image>

(an image that needs no split is its global tile alone), N = ``image_seq_len`` from
processor_config.json. The expanded text is tokenized whole, as the processor does. Each tile is
one :class:`ImageFeature` (its N ``<image>`` tokens are contiguous; the markers between tiles are
text), hashed as the image's hash and the tile's index, so the encoder cache and the prefix cache
key each tile by the image it comes from.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ferry.core.multimodal import ImageFeature
from ferry.multimodal.processor import ImagePrompter, image_hash, load_prompter_parts, model_architecture

_DEFAULT_TOKENS = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                   "global_image_token": "<global-img>"}


def tile_hash(image: bytes, index: int) -> bytes:
    """The content hash of an image's ``index``-th tile: its image's hash and its place."""
    return hashlib.sha256(image + b"tile" + index.to_bytes(4, "little")).digest()


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _processor_class(architecture: str | None) -> Any:
    """transformers' processor class of the family (only its ``replace_image_token`` is used: the
    class is not built, so SmolVLM's video dependencies are not needed)."""
    if architecture == "SmolVLMForConditionalGeneration":
        from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor

        return SmolVLMProcessor
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    return Idefics3Processor


class Idefics3Prompter(ImagePrompter):
    """The image prompter of an Idefics3 / SmolVLM model directory (see the module's docstring)."""

    placeholder = "<image>"
    image_token = "<image>"

    def __init__(self, model_dir: Path, tokenizer: Any = None, preprocessor: dict[str, Any] | None = None,
                 architecture: str | None = None, config: dict[str, Any] | None = None) -> None:
        """``preprocessor``: preprocessor_config.json's fields in place of the directory's file;
        ``architecture``: the model's, where config.json names its text model; ``config``: config.json's
        fields over the directory's (an mmproj's)."""
        self.model_dir = Path(model_dir)
        self.tokenizer, self.image_processor = load_prompter_parts(self.model_dir, tokenizer, preprocessor)
        config = {**_json(self.model_dir / "config.json"), **(config or {})}
        self.image_seq_len = self._seq_len(config)
        tok_cfg = _json(self.model_dir / "tokenizer_config.json")
        tokens = {k: tok_cfg.get(k) or v for k, v in _DEFAULT_TOKENS.items()}
        self.image_token = self.placeholder = tokens["image_token"]
        # The attributes transformers' replace_image_token reads (SmolVLM's and Idefics3's names).
        self._layout = SimpleNamespace(image_seq_len=self.image_seq_len, fake_image_token=tokens["fake_image_token"],
                                       image_token=tokens["image_token"], global_image_token=tokens["global_image_token"],
                                       global_image_tag=tokens["global_image_token"])
        self._replace = _processor_class(architecture or model_architecture(self.model_dir)).replace_image_token
        self.image_token_id = self._token_id(self.image_token)

    def _seq_len(self, config: dict[str, Any]) -> int:
        """Tokens per tile: processor_config.json's image_seq_len, else the tower's
        (image_size / patch_size)**2 / scale_factor**2."""
        proc = _json(self.model_dir / "processor_config.json")
        if "image_seq_len" in proc:
            return int(proc["image_seq_len"])
        from ferry.model.layers.idefics3 import VISION_DEFAULTS

        vc = {**VISION_DEFAULTS, **(config.get("vision_config") or {})}
        side = int(vc["image_size"]) // int(vc["patch_size"])
        return side * side // int(config.get("scale_factor", 2)) ** 2

    def process(self, images: list[Any]) -> list[dict[str, Any]]:
        """Each image's tiles (pixel_values [tiles, 3, H, W], pixel_attention_mask [tiles, H, W])
        and its rows and columns of tiles (0, 0: no split)."""
        out = []
        for image in images:
            batch = self.image_processor(images=[[image]], return_tensors="pt", return_row_col_info=True)
            pixels = batch["pixel_values"][0]
            mask = batch.get("pixel_attention_mask")
            mask = mask[0] if mask is not None else pixels.new_ones(pixels.shape[0], *pixels.shape[2:]).long()
            out.append({"pixel_values": pixels, "pixel_attention_mask": mask,
                        "rows": int(batch["rows"][0][0]), "cols": int(batch["cols"][0][0])})
        return out

    def expansion(self, rows: int, cols: int) -> str:
        """One image's prompt text (transformers' processor's own rule)."""
        return self._replace(self._layout, {"rows": [[rows]], "cols": [[cols]]}, 0)

    def encode(self, prompt_text: str, images: list[Any]) -> tuple[list[int], tuple[ImageFeature, ...]]:
        """Token ids of ``prompt_text`` with each ``<image>`` expanded to its tiles, and one feature per tile."""
        count = prompt_text.count(self.placeholder)
        if count != len(images):
            raise ValueError(f"the prompt has {count} image placeholder(s) for {len(images)} image(s)")
        processed = self.process(images)
        pieces = prompt_text.split(self.placeholder)
        text = pieces[0] + "".join(self.expansion(p["rows"], p["cols"]) + piece
                                   for p, piece in zip(processed, pieces[1:]))
        ids = self.tokenizer.encode(text)
        return ids, self._features(ids, images, processed)

    def _features(self, ids: list[int], images: list[Any], processed: list[dict[str, Any]]
                  ) -> tuple[ImageFeature, ...]:
        """One feature per tile, on the runs of ``image_seq_len`` image tokens in order."""
        n = self.image_seq_len
        spots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        tiles = sum(int(p["pixel_values"].shape[0]) for p in processed)
        if len(spots) != tiles * n:
            raise ValueError(f"the prompt has {len(spots)} image tokens for {tiles} image tiles of {n}")
        features = []
        for image, p in zip(images, processed):
            h = image_hash(image)
            for k in range(int(p["pixel_values"].shape[0])):
                at = spots[len(features) * n]
                if spots[len(features) * n + n - 1] != at + n - 1:
                    raise ValueError("an image tile's tokens are not contiguous in the prompt")
                data = {"pixel_values": p["pixel_values"][k], "pixel_attention_mask": p["pixel_attention_mask"][k]}
                features.append(ImageFeature(hash=tile_hash(h, k), offset=at, length=n, data=data))
        return tuple(features)
