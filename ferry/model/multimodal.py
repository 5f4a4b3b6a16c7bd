"""The language model's side of images: the family's vision tower loaded beside the decoder, each
request's multimodal rope positions, and the rows a step splices in (``ImageRows``).

Torch; the core's view of an image is ``ferry.core.multimodal.ImageFeature``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ferry.core.multimodal import ImageFeature
from ferry.model.arch.idefics3 import IDEFICS3_ARCHITECTURES
from ferry.model.arch.qwen3_vl import IMAGE_ARCHITECTURES, column_axes, mrope_section, rope_positions
from ferry.model.encoding import Pieces, run_all
from ferry.model.layers.vision import Qwen3VLVision, VisionOutput
from ferry.model.mmproj import tower_source


@dataclass
class ImageRows:
    """A step's image rows: the packed rows their embeddings replace, the deepstack features added
    to those rows after each of the first layers, and every row's (t, h, w) rope position."""

    rows: torch.Tensor  # [N] packed row indices
    embeds: torch.Tensor  # [N, hidden]
    deepstack: list[torch.Tensor]  # [N, hidden] per layer, from the first layer on
    rope_positions: torch.Tensor  # [3, T]
    section: tuple[int, ...]  # rope frequencies per axis (t, h, w), interleaved

    def row_tables(self, ropes: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each rope table gathered per row: row r's column j at its axis-j position."""
        out = []
        for cos, sin in ropes:
            axes = torch.tensor(column_axes(cos.shape[1], self.section), dtype=torch.long, device=cos.device)
            idx = self.rope_positions[axes].T.contiguous()  # [T, width]
            out.append((torch.gather(cos, 0, idx), torch.gather(sin, 0, idx)))
        return out


@dataclass
class RequestPositions:
    """A request's rope positions: (t, h, w) of its first ``table.shape[1]`` tokens, and past them
    every axis at token index + ``delta``."""

    table: torch.Tensor  # [3, end] int64
    delta: int

    def at(self, start: int, n: int) -> torch.Tensor:
        """[3, n] positions of token indices [start, start + n)."""
        idx = torch.arange(start, start + n)
        end = self.table.shape[1]
        shifted = (idx + self.delta).expand(3, n).clone()
        inside = idx < end
        if bool(inside.any()):
            shifted[:, inside] = self.table[:, idx[inside]]
        return shifted


def checked(out: VisionOutput, image: ImageFeature, what: str = "an image") -> VisionOutput:
    """``out``, once its rows are as many as the image's placeholder tokens (else a ValueError)."""
    if out.embeds.shape[0] != image.length:
        raise ValueError(f"{what} of {image.length} placeholder tokens encodes to {out.embeds.shape[0]} rows")
    return out


# Rope frequencies per axis of the towers without a 2-D rope (SigLIP): none turned by rows or columns.
FLAT_SECTION = (0, 0, 0)


def flat_positions(images: tuple[ImageFeature, ...]) -> RequestPositions:
    """1-D rope: no table, no shift (each token at its index on every axis)."""
    return RequestPositions(torch.zeros(3, 0, dtype=torch.long), 0)


class ImageEncoder:
    """A Qwen3-VL (or Qwen3.5) checkpoint's vision tower and rope layout (``load``: None for text models)."""

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        vc = config["vision_config"]
        self.vision = Qwen3VLVision(vc, tensors, dtype, device)
        self.merge = self.vision.merge
        self.section = tuple(mrope_section(config))
        self.image_token_id = config.get("image_token_id")
        self.num_encoded = 0  # images run through the tower (a preempted request's again)

    @classmethod
    def load(cls, model_dir: Path, architecture: str, dtype: torch.dtype, device: torch.device,
             mmproj: Any = None) -> "ImageEncoder | None":
        """The tower of a model directory whose architecture takes images, else None; ``mmproj``
        (``ferry.model.mmproj.Mmproj``): the tower of a GGUF's directory, which has none of its own
        (without one such a directory runs its text alone)."""
        if architecture not in IMAGE_ARCHITECTURES:
            return None
        if architecture in IDEFICS3_ARCHITECTURES:  # SigLIP tiles and a pixel-shuffle connector
            from ferry.model.idefics3_images import Idefics3Encoder

            return Idefics3Encoder.load(Path(model_dir), dtype, device, mmproj)
        if architecture == "Gemma3ForConditionalGeneration":  # SigLIP and a pooling projector
            from ferry.model.gemma3_images import Gemma3Encoder

            return Gemma3Encoder.load(Path(model_dir), dtype, device, mmproj)  # type: ignore[return-value]
        source = tower_source(Path(model_dir), mmproj, "qwen3vl_merger", "Qwen3-VL", ("model.visual.",))
        return None if source is None else cls(*source, dtype, device)

    def pieces(self, image: ImageFeature) -> Pieces:
        """One image's rows as pieces (``ferry.model.encoding``; its ``data``: the image processor's
        pixel_values and image_grid_thw)."""
        out = yield from self.vision.encode_pieces(image.data["pixel_values"], image.data["image_grid_thw"])
        self.num_encoded += 1
        return checked(out, image)

    def encode(self, image: ImageFeature) -> VisionOutput:
        """One image's rows at once."""
        return run_all(self.pieces(image))

    def positions(self, images: tuple[ImageFeature, ...]) -> RequestPositions:
        """A request's rope positions from its images' spans and grids."""
        spans = [(im.offset, im.length, tuple(int(v) for v in im.data["image_grid_thw"])) for im in images]
        end = images[-1].end if images else 0
        axes, delta = rope_positions(end, spans, self.merge)
        return RequestPositions(torch.tensor(axes, dtype=torch.long).reshape(3, -1), delta)
