"""Find a model directory and load its weights (safetensors, or random for load_format='dummy')."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ferry.model.config import ModelConfig
from ferry.model.gguf_convert import converted_dir, embedded_gguf_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_dir(model: str | None, cache_dir: str | None = None) -> Path:
    """A Hugging Face directory for ``model``: None means the embedded SmolLM2 (converted once)."""
    if model is None:
        return converted_dir(embedded_gguf_path(), Path(cache_dir) if cache_dir else None)
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return converted_dir(path, Path(cache_dir) if cache_dir else None)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {model!r} does not exist (ferry loads local directories only)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {model!r} has no config.json")
    return path


def load_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint."""
    from safetensors.torch import load_file

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
        tensors.update(load_file(str(model_dir / name)))
    return tensors


def dummy_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of the right shapes, for benchmarking sizes we cannot download."""
    g = torch.Generator().manual_seed(seed)
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    w = {"model.embed_tokens.weight": rnd(cfg.vocab_size, h), "model.norm.weight": torch.ones(h)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = rnd(cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = rnd(cfg.num_heads * hd, h)
        w[p + "self_attn.k_proj.weight"] = rnd(cfg.num_kv_heads * hd, h)
        w[p + "self_attn.v_proj.weight"] = rnd(cfg.num_kv_heads * hd, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, cfg.num_heads * hd)
        if cfg.qkv_bias:
            for x, n_out in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
                w[p + f"self_attn.{x}_proj.bias"] = rnd(n_out * hd)
        w[p + "mlp.gate_proj.weight"] = rnd(i, h)
        w[p + "mlp.up_proj.weight"] = rnd(i, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, i)
    return w
