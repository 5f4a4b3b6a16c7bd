"""The architectures ferry runs: one module each, one registry line each.

An architecture declares how to read its config.json (``configure``: the fields that differ from
the Llama shape, and its layers as parts, ``ferry.model.arch.parts``), its GGUF name, the names of
its tensors where they differ from ``parts.NAMES``, whether llama.cpp permuted its q/k rows, and
conventions such as Gemma's (1 + w) norms. The loader, tensor-parallel slicing and the decoder
(``ferry.model.decoder``) read only these declarations. Pure Python (the simulator reads configs
without torch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ferry.model.arch.parts import MODEL_ROLES, NAMES


def _nothing(d: dict[str, Any]) -> dict[str, Any]:
    return {}


def _none(meta: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Architecture:
    hf_name: str  # config.json's ``architectures`` entry
    model_type: str  # config.json's ``model_type`` (used when ``architectures`` is absent)
    gguf_name: str | None = None  # a GGUF's ``general.architecture``
    gguf_aliases: tuple[str, ...] = ()  # other names llama.cpp writes it under (Nemotron-H with experts)
    # config.json -> ModelConfig fields that differ from the Llama defaults, ``layers`` among them.
    configure: Callable[[dict[str, Any]], dict[str, Any]] = _nothing
    # Tensor roles whose (Hugging Face, GGUF) names differ from parts.NAMES.
    names: dict[str, tuple[str, str]] = field(default_factory=dict)
    gguf_permuted_qk: bool = False  # llama.cpp interleaves q/k rows for its "normal" rope (llama-like)
    # config.json fields from the GGUF's metadata (``meta(key, default)`` reads "{gguf_name}.KEY")
    # and its float tensors by Hugging Face name (it may pop those that are config, not weights).
    gguf_configure: Callable[[Callable[..., Any], dict[str, Any]], dict[str, Any]] = _none
    # RMS norms scale by (norm_offset + w) (Gemma's 1 + w); llama.cpp stores such a weight plus it.
    norm_offset: float = 0.0
    # Checkpoint tensors that hold several roles' rows (Phi-3's qkv_proj): Hugging Face name ->
    # (GGUF name, the roles in row order); split at load.
    checkpoint_fused: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    layer_prefix: str = "model.layers"  # the checkpoint's layers are "{layer_prefix}.{i}." (Nemotron-H: backbone.layers)
    # A GGUF tensor as llama.cpp stores it -> as the checkpoint keeps it (Hugging Face name, array):
    # conventions such as a stored -exp(A_log) or a squeezed conv weight.
    gguf_tensor: Callable[[str, Any], Any] | None = None
    # config.json's hidden_act names the MLP's activation (Nemotron-H's is a key transformers ignores).
    checks_hidden_act: bool = True
    # A multimodal checkpoint run as its language model: config.json's text_config holds the model's
    # fields, and the checkpoint's tensors under these prefixes are not read (its vision tower).
    text_config: bool = False
    skip_prefixes: tuple[str, ...] = ()
    # A safetensors checkpoint's tensors as the declarations name them, where it stores them otherwise
    # (gpt-oss: each layer's experts stacked, transposed, gate and up columns interleaved).
    checkpoint_tensors: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # In prefill an image's tokens attend to every token of the same image, later ones included
    # (Gemma 3; transformers' token_type_ids mask): the scheduler never cuts such an image across chunks.
    bidirectional_images: bool = False

    def name_table(self) -> dict[str, tuple[str, str]]:
        """Every role's (Hugging Face, GGUF) names for this architecture."""
        return {**NAMES, **self.names}

    def gguf_layer_names(self) -> dict[str, str]:
        """llama.cpp's per-layer tensor names -> Hugging Face's, for a GGUF of this architecture."""
        out = {gg: hf for role, (hf, gg) in self.name_table().items() if role not in MODEL_ROLES}
        out.update({gg: hf for hf, (gg, _) in self.checkpoint_fused.items()})
        return out


def _registry() -> dict[str, Architecture]:
    from ferry.model.arch import (gemma3, granite4, lfm2, llama, mistral, nemotron_h, phi3, qwen2, qwen3, qwen3_5,
                                  qwen3_moe, smollm3)
    from ferry.model.arch import qwen3_vl
    from ferry.model.arch import gpt_oss
    from ferry.model.arch import gemma4

    archs = [llama.ARCH, mistral.ARCH, qwen2.ARCH, qwen3.ARCH, qwen3_moe.ARCH, gemma3.ARCH, phi3.ARCH,
             smollm3.ARCH, lfm2.ARCH, qwen3_5.ARCH, qwen3_5.MOE_ARCH, qwen3_5.VL_ARCH, qwen3_5.VL_MOE_ARCH,
             granite4.ARCH, nemotron_h.ARCH, qwen3_vl.ARCH, gpt_oss.ARCH]
    archs += [gemma4.ARCH, gemma4.MM_ARCH]
    from ferry.model.arch import idefics3
    archs += [idefics3.IDEFICS3_ARCH, idefics3.SMOLVLM_ARCH]
    archs += [gemma3.MM_ARCH]
    return {a.hf_name: a for a in archs}


ARCHITECTURES: dict[str, Architecture] = _registry()


def register(arch: Architecture) -> Architecture:
    """Add an architecture to the registry (its config.json name must be new)."""
    if arch.hf_name in ARCHITECTURES:
        raise ValueError(f"architecture {arch.hf_name!r} is already registered")
    ARCHITECTURES[arch.hf_name] = arch
    return arch


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
        if name is not None and (a.gguf_name == name or name in a.gguf_aliases):
            return a
    names = ", ".join(a.gguf_name for a in ARCHITECTURES.values() if a.gguf_name)
    raise ValueError(f"{where}: unsupported GGUF architecture {name!r}; ferry reads {names}")
