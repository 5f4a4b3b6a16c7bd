"""The executor's encoder for Idefics3 / SmolVLM checkpoints: one tile (an ``ImageFeature`` of
``ferry.multimodal.idefics3``) through ``ferry.model.layers.idefics3`` per call, and the ordinary
1-D rope positions (every axis the token index), with the interface of
``ferry.model.multimodal.ImageEncoder`` that ``ferry.executor.images.ImageSteps`` reads.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ferry.core.multimodal import ImageFeature
from ferry.model.encoding import Pieces, run_all
from ferry.model.layers.idefics3 import Idefics3Vision
from ferry.model.layers.vision import VisionOutput
from ferry.model.mmproj import tower_source
from ferry.model.multimodal import FLAT_SECTION, checked, flat_positions

TOWER_PREFIXES = ("model.vision_model.", "model.connector.")


class Idefics3Encoder:
    """An Idefics3 / SmolVLM checkpoint's tower and connector (``load``: None where it has none)."""

    section = FLAT_SECTION
    positions = staticmethod(flat_positions)

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.vision = Idefics3Vision(config, tensors, dtype, device)
        self.image_token_id = config.get("image_token_id")
        self.num_encoded = 0  # tiles run through the tower (a preempted request's again)

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: torch.device, mmproj: Any = None
             ) -> "Idefics3Encoder | None":
        """The tower of a checkpoint directory (None for a directory without a vision_config), or
        of ``mmproj`` (``ferry.model.mmproj.Mmproj``) where one is given."""
        source = tower_source(Path(model_dir), mmproj, "idefics3", "Idefics3 / SmolVLM", TOWER_PREFIXES)
        return None if source is None else cls(*source, dtype, device)

    def pieces(self, image: ImageFeature) -> Pieces:
        """One tile's rows as pieces (``ferry.model.encoding``; its ``data``: ``pixel_values``
        [3, H, W], ``pixel_attention_mask`` [H, W])."""
        rows = yield from self.vision.encode_pieces(image.data["pixel_values"][None],
                                                    image.data["pixel_attention_mask"][None])
        self.num_encoded += 1
        return checked(VisionOutput(rows[0], []), image, "an image tile")

    def encode(self, image: ImageFeature) -> VisionOutput:
        """One tile's rows at once."""
        return run_all(self.pieces(image))
