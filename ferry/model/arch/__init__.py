"""The architectures ferry runs: one module each, one registry line each.

An architecture declares how to read its config.json (``configure``: the fields that differ
from the Llama shape), its GGUF name and tensor names, whether llama.cpp permuted its q/k rows,
and whether the fused C decode (``kernels/decode_layers.c``) can run its layers. The decoder
(``ferry.model.llama``) composes the shared layers from those fields. Pure Python (the simulator
reads configs without torch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


def _nothing(d: dict[str, Any]) -> dict[str, Any]:
    return {}


def _none(meta: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Architecture:
    hf_name: str  # config.json's ``architectures`` entry
    model_type: str  # config.json's ``model_type`` (used when ``architectures`` is absent)
    gguf_name: str | None = None  # a GGUF's ``general.architecture``
    # config.json -> ModelConfig fields that differ from the Llama defaults (qkv_bias, qk_norm, windows...).
    configure: Callable[[dict[str, Any]], dict[str, Any]] = _nothing
    # llama.cpp's per-layer tensor names that differ from the Llama ones -> the Hugging Face names
    # ("{e}" in a name: a 3-D tensor of every expert, split into one per expert).
    gguf_tensors: dict[str, str] = field(default_factory=dict)
    gguf_permuted_qk: bool = False  # llama.cpp interleaves q/k rows for its "normal" rope (llama-like)
    # config.json fields from the GGUF's metadata (``meta(key, default)`` reads "{gguf_name}.KEY")
    # and its float tensors by Hugging Face name (it may pop those that are config, not weights).
    gguf_configure: Callable[[Callable[..., Any], dict[str, Any]], dict[str, Any]] = _none
    gguf_norm_shift: float = 0.0  # llama.cpp stores every norm weight plus this (Gemma's 1 + w)
    fused_decode: bool = True  # the C decode has every operation of these layers
    # Checkpoint tensors that hold several of ferry's, split by rows at load (Phi-3's qkv_proj).
    checkpoint_fused: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _registry() -> dict[str, Architecture]:
    from ferry.model.arch import gemma3, llama, mistral, phi3, qwen2, qwen3, qwen3_moe, smollm3

    archs = [llama.ARCH, mistral.ARCH, qwen2.ARCH, qwen3.ARCH, qwen3_moe.ARCH, gemma3.ARCH, phi3.ARCH,
             smollm3.ARCH]
    return {a.hf_name: a for a in archs}


ARCHITECTURES: dict[str, Architecture] = _registry()


def supported() -> str:
    return ", ".join(ARCHITECTURES)


def find(names: list[str], model_type: str | None, where: str) -> Architecture:
    """The registered architecture among ``names`` (else by ``model_type``), or a ValueError naming it."""
    for n in names:
        if n in ARCHITECTURES:
            return ARCHITECTURES[n]
    if not names:
        for a in ARCHITECTURES.values():
            if a.model_type == model_type:
                return a
    raise ValueError(f"unsupported architecture {names or model_type!r} in {where}; ferry runs {supported()}")


def by_gguf(name: str | None, where: str) -> Architecture:
    """The architecture of a GGUF's ``general.architecture``, or a ValueError listing the ones ferry reads."""
    for a in ARCHITECTURES.values():
        if a.gguf_name == name:
            return a
    names = ", ".join(a.gguf_name for a in ARCHITECTURES.values() if a.gguf_name)
    raise ValueError(f"{where}: unsupported GGUF architecture {name!r}; ferry reads {names}")
