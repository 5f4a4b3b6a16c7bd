"""A model's shape, read from a Hugging Face config.json through its architecture's declaration
(``ferry.model.arch``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferry.model.arch import ARCHITECTURES, find

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", "freq_factors")


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
    qk_norm: bool = False  # an RMS norm on each head's q and k before rope (Qwen3)
    # Per layer: the window it attends within (None: every earlier token); default sliding_window on all.
    layer_windows: tuple[int | None, ...] = ()
    fused_decode: bool = True  # the architecture's layers are what the fused C decode computes
    hidden_act: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    norm_offset: float = 0.0  # RMS norms scale by (offset + w): Gemma's 1 + w
    embed_scale: float = 1.0  # embeddings are multiplied by this (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # softmax scale (None: head_dim ** -0.5)
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too (Gemma)
    # Per layer: (rope theta, rope scaling); default every layer (rope_theta, rope_scaling).
    layer_ropes: tuple[tuple[float, dict[str, Any] | None], ...] = ()
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    # Mixture of experts: routed experts per token of the MLP layers where moe_layers says so.
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = False  # the chosen experts' weights renormalised to sum to 1
    moe_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_windows:
            self.layer_windows = (self.sliding_window,) * self.num_layers
        if not self.layer_ropes:
            self.layer_ropes = ((self.rope_theta, self.rope_scaling),) * self.num_layers
        if not self.moe_layers:
            self.moe_layers = (self.num_experts > 0,) * self.num_layers

    @property
    def max_window(self) -> int | None:
        """The widest window any layer keeps (None: some layer reads every earlier token)."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(self.layer_windows)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
        spec = find(archs, d.get("model_type"), where)
        arch = spec.hf_name
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        act = {"gelu_pytorch_tanh": "gelu_tanh"}.get(act, act)
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_act {act!r} in {where}; ferry runs 'silu' and 'gelu_pytorch_tanh'")
        try:
            heads = d["num_attention_heads"]
            rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
            fields = dict(
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
                qkv_bias=bool(d.get("attention_bias", False)),
                eos_token_ids=_id_list(d.get("eos_token_id")),
                fused_decode=spec.fused_decode,
                hidden_act=act,
            )
            fields.update(spec.configure(d))
            return cls(**fields)
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


def rope_scaling(rope: dict[str, Any], where: str) -> dict[str, Any] | None:
    """A rope parameters dict as ferry keeps it (None: no scaling), or a ValueError naming the kind."""
    return _rope_scaling(rope, where)


def _rope_scaling(rope: dict[str, Any], where: str) -> dict[str, Any] | None:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    if kind in ROPE_TYPES:
        return dict(rope, rope_type=kind)
    raise ValueError(f"unsupported rope scaling {kind!r} in {where}; ferry supports {', '.join(ROPE_TYPES)}")
