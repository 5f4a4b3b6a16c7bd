"""The Llama-family shape ferry runs, read from a Hugging Face config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: list[int]
    sliding_window: int | None = None  # attention looks this many tokens back (Mistral); None: all

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:
            arch = _BY_MODEL_TYPE.get(d.get("model_type", ""))
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or d.get('model_type')!r} in {where}; "
                             f"ferry runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} in {where}; ferry runs 'silu'")
        try:
            heads = d["num_attention_heads"]
            rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
            return cls(
                architecture=arch,
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_layers=d["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                rope_scaling=_rope_scaling(rope, where),
                max_position_embeddings=d.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
                eos_token_ids=_id_list(d.get("eos_token_id")),
                # Qwen2 configs carry a window they do not use unless use_sliding_window is set.
                sliding_window=d.get("sliding_window") if arch != "Qwen2ForCausalLM" or d.get("use_sliding_window")
                else None,
            )
        except KeyError as e:
            raise ValueError(f"{where} lacks the field {e.args[0]!r}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {str(model_dir)!r} has no config.json")
        return cls.from_dict(json.loads(path.read_text()), where=str(path))


def generation_eos_ids(model_dir: str | Path) -> list[int]:
    """The end-of-sequence ids in ``generation_config.json`` (one id or a list), if there is one."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    return _id_list(json.loads(path.read_text()).get("eos_token_id"))


def _id_list(ids: int | list[int] | None) -> list[int]:
    return [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))


def _rope_scaling(rope: dict[str, Any], where: str) -> dict[str, Any] | None:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    if kind in ("llama3", "linear"):
        return dict(rope, rope_type=kind)
    raise ValueError(f"unsupported rope scaling {kind!r} in {where}; ferry supports default, linear and llama3")
