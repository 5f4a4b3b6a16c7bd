"""Idefics3's (and SmolVLM's) vision side (torch, prefill only): one square tile of an image in, its
``image_seq_len`` rows for the language model out.

The SigLIP tower (``ferry.model.layers.siglip``, tensors under ``model.vision_model.``, Idefics3's
bucketed position ids) gives one row per patch in raster order; the connector's pixel shuffle
folds each ``scale_factor`` x ``scale_factor`` group of neighbouring patches into one row of
``scale_factor ** 2`` times the width, and ``model.connector.modality_projection.proj`` (no bias)
maps it to the language model's width. Row k of a tile is its k-th ``<image>`` token.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ferry.model.encoding import Pieces
from ferry.model.layers.siglip import SiglipVision, patch_mask_from_pixels

VISION_PREFIX = "model.vision_model."
PROJECTION = "model.connector.modality_projection.proj.weight"
# transformers' Idefics3VisionConfig / SmolVLMVisionConfig defaults: some checkpoints (SmolVLM2)
# leave these out of their config.json.
VISION_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 16,
                   "image_size": 224, "patch_size": 32, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[B, side * side, D] rows of a square patch grid in raster order -> [B, (side / scale)**2,
    D * scale**2] (transformers' ``Idefics3Connector.pixel_shuffle``): output row (i, j), in raster
    order of the coarse grid, is its scale x scale group's patches (i * scale + r, j * scale + c)
    side by side in raster order of (r, c)."""
    b, seq, d = x.shape
    side = int(seq ** 0.5)
    if side * side != seq or side % scale:
        raise ValueError(f"a tile of {seq} patches is not a square whose side divides by {scale}")
    x = x.reshape(b, side, side // scale, d * scale)  # each row's neighbouring columns side by side
    x = x.permute(0, 2, 1, 3).reshape(b, side // scale, side // scale, d * scale * scale)  # then rows
    return x.permute(0, 2, 1, 3).reshape(b, seq // (scale * scale), d * scale * scale)


class Idefics3Vision:
    """The tower and connector of an Idefics3 / SmolVLM checkpoint (config.json's vision_config and
    scale_factor; ``tensors`` by checkpoint name)."""

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        vc = {**VISION_DEFAULTS, **(config.get("vision_config") or {})}
        self.tower = SiglipVision(vc, tensors, VISION_PREFIX, dtype, device)
        self.scale = int(config.get("scale_factor", 2))
        self.proj = tensors[PROJECTION].to(device=device, dtype=dtype)
        self.dtype, self.device = dtype, device

    @property
    def tokens_per_tile(self) -> int:
        """Rows of one ``image_size`` square tile: (image_size / patch)**2 / scale_factor**2."""
        return self.tower.side * self.tower.side // (self.scale * self.scale)

    def encode_pieces(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None = None) -> Pieces:
        """[B, 3, H, W] tiles (normalized pixels) and their [B, H, W] pixel masks (1: image) ->
        [B, tokens, text hidden], as the tower's pieces (``ferry.model.encoding``)."""
        if pixel_mask is None:
            pixel_mask = torch.ones(pixel_values.shape[0], *pixel_values.shape[2:], dtype=torch.long)
        patches = patch_mask_from_pixels(pixel_mask.to("cpu"), self.tower.patch)
        rows = yield from self.tower.encode_pieces(pixel_values, patches)
        with torch.inference_mode():
            return F.linear(pixel_shuffle(rows, self.scale), self.proj)
