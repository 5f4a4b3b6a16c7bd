"""The executor's encoder for Gemma 3 checkpoints: one image (an ``ImageFeature`` of
``ferry.multimodal.gemma3``) through the SigLIP tower (``ferry.model.layers.siglip``) and Gemma 3's
multi-modal projector, with the interface of ``ferry.model.multimodal.ImageEncoder`` that
``ferry.executor.images.ImageSteps`` reads.

The projector (transformers' ``Gemma3MultiModalProjector``): the tower's patch rows as their square
grid, average-pooled down to ``mm_tokens_per_image`` cells (raster order), a Gemma RMS norm
(``1 + w``, float32) and a product with ``mm_input_projection_weight`` ([vision, text] hidden).
The rows replace the image tokens' embeddings as they are: Gemma's sqrt(hidden) embedding scale
is for text tokens only. Rope stays 1-D (each token at its index).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ferry.core.multimodal import ImageFeature
from ferry.model.arch.gemma3 import TOWER_PREFIXES
from ferry.model.encoding import Pieces, run_all
from ferry.model.layers.siglip import SiglipVision
from ferry.model.layers.vision import VisionOutput
from ferry.model.mmproj import tower_source
from ferry.model.multimodal import FLAT_SECTION, checked, flat_positions


class Gemma3Projector:
    """Pooling, norm and projection of one tower output [B, patches, vision hidden] -> [B, tokens, text hidden]."""

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype,
                 device: torch.device) -> None:
        vc = config["vision_config"]
        self.side = int(vc["image_size"]) // int(vc["patch_size"])  # patches per image side
        tokens_side = int(int(config.get("mm_tokens_per_image", 256)) ** 0.5)
        self.kernel = self.side // tokens_side
        self.eps = float(vc.get("layer_norm_eps", 1e-6))
        self.norm = tensors[f"{prefix}mm_soft_emb_norm.weight"].to(device=device, dtype=torch.float32)
        self.weight = tensors[f"{prefix}mm_input_projection_weight"].to(device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        if n != self.side * self.side:
            raise ValueError(f"the tower gave {n} patch rows, not {self.side}x{self.side}")
        grid = x.transpose(1, 2).reshape(b, c, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        pf = pooled.float()
        normed = pf * torch.rsqrt(pf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.norm)
        return torch.matmul(normed.to(x.dtype), self.weight)


def _prefixes(tensors: dict[str, torch.Tensor]) -> tuple[str, str]:
    """The tower's and the projector's name prefixes, as checkpoints name them (vision_tower. or
    vision_tower.vision_model., multi_modal_projector., with or without a leading model.)."""
    towers = [t for t in ("model.vision_tower.vision_model.", "model.vision_tower.", "vision_tower.vision_model.",
                          "vision_tower.") if f"{t}embeddings.patch_embedding.weight" in tensors]
    projectors = [p for p in ("model.multi_modal_projector.", "multi_modal_projector.")
                  if f"{p}mm_input_projection_weight" in tensors]
    if not towers or not projectors:
        raise ValueError("the checkpoint has no SigLIP tower (vision_tower.) or no projector (multi_modal_projector.)")
    return towers[0], projectors[0]


class Gemma3Encoder:
    """A Gemma 3 checkpoint's tower and projector (``load``: None where it has none)."""

    section = FLAT_SECTION
    positions = staticmethod(flat_positions)

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        tower, projector = _prefixes(tensors)
        self.vision = SiglipVision(config["vision_config"], tensors, tower, dtype, device)
        self.projector = Gemma3Projector(config, tensors, projector, dtype, device)
        self.image_token_id = config.get("image_token_index", config.get("image_token_id"))
        self.num_encoded = 0  # images run through the tower (a preempted request's again)

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: torch.device, mmproj: Any = None
             ) -> "Gemma3Encoder | None":
        """The tower of a checkpoint directory (None for a directory without a vision_config), or
        of ``mmproj`` (``ferry.model.mmproj.Mmproj``) where one is given."""
        source = tower_source(Path(model_dir), mmproj, "gemma3", "Gemma 3", TOWER_PREFIXES)
        return None if source is None else cls(*source, dtype, device)

    def pieces(self, image: ImageFeature) -> Pieces:
        """One image's rows as pieces (``ferry.model.encoding``; its ``data``: the image
        processor's ``pixel_values`` [3, H, W])."""
        patches = yield from self.vision.encode_pieces(image.data["pixel_values"][None])
        with torch.inference_mode():
            rows = self.projector.forward(patches)[0]
        self.num_encoded += 1
        return checked(VisionOutput(rows, []), image)

    def encode(self, image: ImageFeature) -> VisionOutput:
        """One image's rows at once."""
        return run_all(self.pieces(image))
