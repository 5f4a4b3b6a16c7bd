"""Qwen3-VL: Qwen3's language model (its fields in text_config, its tensors under
model.language_model.) with interleaved multimodal rope, and a vision tower under model.visual.
(``ferry.model.layers.vision``) whose merged patches stand in for the prompt's image tokens.

Positions (transformers' ``get_rope_index``): text counts up on all three axes; an image's tokens
take (start, start + row, start + column) over its merged grid, and the text after it continues
from the image's largest position + 1. Past the last image every axis is the token index plus one
per-request offset (``delta``), so decode is ordinary rope at a shifted position. Pure Python.
"""
from __future__ import annotations

from typing import Any, Sequence

from ferry.model.arch import Architecture
from ferry.model.arch.parts import NAMES
from ferry.model.arch.qwen3 import configure

_TEXT = {"embed": ("model.language_model.embed_tokens", "token_embd"),
         "final_norm": ("model.language_model.norm", "output_norm")}



def gguf_configure(meta: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json's multimodal rope from llama.cpp's ``qwen3vl`` text GGUF (rope.dimension_sections:
    the frequencies each of t, h, w turns; the tower's fields come from the mmproj)."""
    sections = list(meta("rope.dimension_sections") or (24, 20, 20))[:3]
    return {"rope_scaling": {"rope_type": "default", "mrope_section": sections, "mrope_interleaved": True}}


ARCH = Architecture("Qwen3VLForConditionalGeneration", "qwen3_vl", gguf_name="qwen3vl", configure=configure,
                    names={**NAMES, **_TEXT}, layer_prefix="model.language_model.layers", text_config=True,
                    skip_prefixes=("model.visual.",), gguf_configure=gguf_configure)


# The checkpoints whose images ferry runs: Qwen3-VL, and Qwen3.5 (the same vision tower without
# deepstack, before its hybrid language model of ``ferry.model.arch.qwen3_5``).
IMAGE_ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
                       "Qwen3_5MoeForConditionalGeneration",
                       # Idefics3 and SmolVLM: tiles through a SigLIP tower (``ferry.model.arch.idefics3``).
                       "Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration",
                       # Gemma 3: a SigLIP tower and its pooling projector (``ferry.model.gemma3_images``).
                       "Gemma3ForConditionalGeneration")


def mrope_section(config: dict[str, Any]) -> list[int]:
    """How many rope frequencies each axis (t, h, w) turns, from config.json's text_config."""
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return list(rope.get("mrope_section") or (24, 20, 20))


def column_axes(head_dim: int, section: Sequence[int]) -> list[int]:
    """The axis (0: t, 1: h, 2: w) of each column of a [positions, head_dim] rope table: frequency i
    is h's where i % 3 == 1 and i < 3 * section[1], w's where i % 3 == 2 and i < 3 * section[2],
    else t's (the interleaved layout); the table repeats its frequencies in both halves."""
    half = head_dim // 2
    axes = [0] * half
    for axis, offset in ((1, 1), (2, 2)):
        for i in range(offset, min(3 * section[axis], half), 3):
            axes[i] = axis
    return axes + axes


def rope_positions(num_tokens: int, images: Sequence[tuple[int, int, tuple[int, int, int]]], merge: int
                   ) -> tuple[list[list[int]], int]:
    """The (t, h, w) positions of a prompt's first ``end`` tokens, where ``end`` is the last image's
    end, and ``delta``: every later token index i sits at i + delta on all three axes.
    ``images``: (offset, length, (t, h, w) patch grid) in prompt order."""
    axes: list[list[int]] = [[], [], []]
    cur = prev = 0
    for offset, length, (t, h, w) in images:
        for i in range(offset - prev):  # the text before the image
            for a in axes:
                a.append(cur + i)
        cur += offset - prev
        gh, gw = h // merge, w // merge
        if t * gh * gw != length:
            raise ValueError(f"an image of grid {(t, h, w)} has {t * gh * gw} tokens, not {length}")
        for ti in range(t):
            for hi in range(gh):
                for wi in range(gw):
                    axes[0].append(cur + ti)
                    axes[1].append(cur + hi)
                    axes[2].append(cur + wi)
        cur += max(gh, gw)
        prev = offset + length
    return axes, cur - prev
