"""Image inputs as the core sees them: spans of placeholder tokens in a prompt.

Pure Python (no torch): the scheduler, the KV cache manager and the executor read
``offset``/``length``/``hash``; only the model's encoder looks inside ``data``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageFeature:
    """One image of a prompt: where its placeholder tokens sit and what fills them."""

    hash: bytes  # content hash of the decoded RGB image (sha256 of mode+size+pixel bytes)
    offset: int  # index in prompt_token_ids of this image's first placeholder token
    length: int  # its number of placeholder tokens (= rows of encoder output)
    # Opaque to the core: the processed inputs (e.g. {"pixel_values": ..., "image_grid_thw": ...}).
    data: Any = None

    @property
    def end(self) -> int:
        """One past the index of the image's last placeholder token."""
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether the token range [start, end) touches this image's span."""
        return self.offset < end and start < self.end
