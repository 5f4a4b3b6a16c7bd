"""Find a model directory and load its weights (safetensors, a GGUF kept quantized, or random for
load_format='dummy')."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from ferry.config import EngineConfig
from ferry.model.config import ModelConfig
from ferry.model.kernels import load_kernels
from ferry.model.quant import cached_gguf_weights, set_activations
from ferry.model.gguf_convert import converted_dir, embedded_gguf_path, ensure_float_weights
from ferry.model.hub import local_model
from ferry.model.weights import dummy_weights, unfuse

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def gguf_file(model: str | None) -> Path | None:
    """The GGUF file ``model`` names (None: the embedded SmolLM2's; a Hugging Face name
    ``ORG/NAME:QUANT`` resolves through ``ferry.model.hub``), or None for a directory."""
    if model is None:
        return embedded_gguf_path()
    path = local_model(model)
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None


def resolve_model_dir(model: str | None, cache_dir: str | None = None, floats: bool = True) -> Path:
    """A Hugging Face directory for ``model`` (a path, or a Hugging Face name ``ORG/NAME[:QUANT]``
    that ``ferry.model.hub`` resolves): a GGUF (None means the embedded SmolLM2) is converted
    once, for its config and tokenizer, and with ``floats`` its float32 weights (else written when
    ``load_safetensors`` first reads the directory: quantization none, or no C kernels)."""
    gguf = gguf_file(model)
    if gguf is not None:
        return converted_dir(gguf, Path(cache_dir) if cache_dir else None, floats)
    path = local_model(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {model!r} does not exist (ferry loads a local directory, a .gguf "
                                f"file or a Hugging Face name ORG/NAME[:QUANT])")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    return path


def load_weights(config: EngineConfig, cfg: ModelConfig, model_dir: Path) -> dict[str, Any]:
    """The weights ``config`` asks for: random (dummy), quantized straight from a GGUF, or float."""
    if config.load_format == "dummy":
        return dummy_weights(cfg, config.seed)
    gguf = gguf_file(config.model)
    # Quantized weights multiply float32 activations: another dtype runs the dequantized model.
    quantization = config.quantization or ("gguf" if gguf is not None and config.dtype == "float32" else "none")
    if quantization == "gguf":
        if gguf is None:
            raise ValueError(f"quantization 'gguf' needs a .gguf model file; {config.model!r} is a directory")
        if config.dtype != "float32":
            raise ValueError(f"quantization 'gguf' computes in float32; dtype {config.dtype!r} needs "
                             f"quantization 'none'")
        if load_kernels() is None:
            log.warning("no C kernels here (no compiler?): quantized weights are dequantized to float32")
        else:
            weights = unfuse(cached_gguf_weights(gguf, model_dir), cfg)
            set_activations(weights, config.quant_activations)
            return weights
    weights = unfuse(load_safetensors(model_dir, cfg.arch.skip_prefixes), cfg)
    set_activations(weights, config.quant_activations)  # blocks a checkpoint keeps (gpt-oss's MXFP4 experts)
    return weights


def mmproj_file(config: EngineConfig) -> Path | None:
    """The mmproj GGUF ``config`` names, else the one beside its GGUF model file (``find_mmproj``)."""
    from ferry.model.mmproj import find_mmproj

    if config.mmproj is not None:
        path = Path(config.mmproj).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"mmproj file {config.mmproj!r} does not exist")
        return path
    gguf = gguf_file(config.model) if config.model is not None else None
    return find_mmproj(gguf) if gguf is not None else None


def load_mmproj(config: EngineConfig, architecture: str) -> tuple[Any, str]:
    """The vision tower (``ferry.model.mmproj.Mmproj``) of an image model's GGUF, or None (a text
    model, or no mmproj given or found: its text alone runs), and the architecture whose images run:
    a text GGUF's own, or the image model it forms with the mmproj (Gemma 3's text GGUF is a
    Gemma3ForCausalLM, with its mmproj a Gemma3ForConditionalGeneration)."""
    from ferry.model.arch.qwen3_vl import IMAGE_ARCHITECTURES
    from ferry.model.mmproj import read_mmproj

    path = mmproj_file(config)
    if path is None:
        return None, architecture
    mmproj = read_mmproj(path)
    image_architecture = mmproj.table.image_architecture(architecture)
    if image_architecture is None:
        if config.mmproj is None:  # found beside the file, of another family: the text runs alone
            log.warning("ignoring %s (a %s tower) beside a %s model", path, mmproj.table.projector_type, architecture)
            return None, architecture
        if architecture not in IMAGE_ARCHITECTURES:
            raise ValueError(f"mmproj {config.mmproj!r}: the model ({architecture}) takes no images")
        raise ValueError(f"mmproj {config.mmproj!r} (projector type {mmproj.table.projector_type!r}) is not a "
                         f"tower of {architecture}")
    log.info("vision tower from %s", path)
    return mmproj, image_architecture


def load_safetensors(model_dir: Path, skip: tuple[str, ...] = (), only: tuple[str, ...] = ()
                     ) -> dict[str, torch.Tensor]:
    """The tensors of a (possibly sharded) safetensors checkpoint, but those whose names start with
    one of ``skip`` (parts of the checkpoint the model does not run, e.g. a vision tower) and, when
    ``only`` is given, those whose names start with none of ``only``."""
    from safetensors import safe_open

    ensure_float_weights(model_dir)  # a converted GGUF's, made without them
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {str(model_dir)!r} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        if not (model_dir / name).is_file():
            raise FileNotFoundError(f"weight file {name!r} is missing from {str(model_dir)!r}")
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():
                if (not skip or not key.startswith(skip)) and (not only or key.startswith(only)):
                    tensors[key] = f.get_tensor(key)
    return tensors
