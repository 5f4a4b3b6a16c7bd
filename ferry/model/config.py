"""A model's shape, read from a Hugging Face config.json through its architecture's declaration
(``ferry.model.arch``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferry.model.arch import ARCHITECTURES, Architecture, find
from ferry.model.arch.parts import AttentionSpec, ExpertsSpec, LayerSpec, MLPSpec, hidden_act, llama_layers

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", "freq_factors", "proportional")


@dataclass
class ModelConfig:
    """What every model has; its layers' parts and their options are ``layers`` (the architecture's
    declaration, ``ferry.model.arch.parts``)."""

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
    eos_token_ids: list[int]
    layers: tuple[LayerSpec, ...] = ()
    embed_scale: float = 1.0  # embeddings are multiplied by this (Gemma: sqrt(hidden))
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    residual_scale: float = 1.0  # each block's output is scaled so before its residual add (Granite)
    logits_divisor: float = 1.0  # logits are divided by this (Granite's logits_scaling)
    per_layer_input: int = 0  # each layer's share of the per-layer input embeddings (Gemma 4; 0: none)
    per_layer_vocab: int = 0  # the per-layer embedding's rows (0: vocab_size)

    def __post_init__(self) -> None:
        if not self.layers:
            self.layers = tuple(LayerSpec(AttentionSpec(rope=(self.rope_theta, self.rope_scaling)), MLPSpec())
                                for _ in range(self.num_layers))

    @property
    def arch(self) -> Architecture:
        """The registered architecture's declaration."""
        return ARCHITECTURES[self.architecture]

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """The window of each attention layer (recurrent layers keep no KV)."""
        return tuple(layer.attention.window for layer in self.layers if layer.attention is not None)

    @property
    def attention_layers(self) -> list[int]:
        """The layers that keep K/V in the paged cache."""
        return [i for i, layer in enumerate(self.layers) if layer.attention is not None]

    @property
    def kv_cache_layers(self) -> list[int]:
        """The attention layers that keep K/V of their own (one with a ``kv_source`` reads that layer's)."""
        return [i for i in self.attention_layers if self.layers[i].attention.kv_source is None]

    def kv_heads(self, layer: int) -> tuple[int, int]:
        """(KV heads, head size) of attention layer ``layer``'s cache."""
        return self.layers[layer].attention.cache_heads(self)

    @property
    def recurrent_layers(self) -> list[int]:
        """The layers that keep a fixed-size recurrent state per request."""
        return [i for i, layer in enumerate(self.layers) if layer.recurrent is not None]

    def state_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Layer ``layer``'s per-request recurrent state: name -> shape (float32)."""
        return self.layers[layer].recurrent.state_shapes(self)

    @property
    def state_floats(self) -> int:
        """The float32 values one request's recurrent state holds over every recurrent layer."""
        import math

        return sum(math.prod(s) for i in self.recurrent_layers for s in self.state_shapes(i).values())

    @property
    def max_window(self) -> int | None:
        """The widest window any layer keeps (None: some layer reads every earlier token)."""
        windows = self.layer_windows
        if not windows or None in windows or self.recurrent_layers:
            return None
        return max(windows)

    @property
    def experts(self) -> ExpertsSpec | None:
        """The routed experts of the layers that have them (None: a dense model)."""
        return next((layer.mlp for layer in self.layers if isinstance(layer.mlp, ExpertsSpec)), None)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
        spec = find(archs, d.get("model_type"), where)
        arch = spec.hf_name
        if spec.text_config:  # the language model of a multimodal checkpoint: its own fields win
            outer = {k: v for k, v in d.items() if not k.endswith("_config")}
            d = {**outer, **(d.get("text_config") or {})}
        if spec.checks_hidden_act:
            hidden_act(d, where)  # refused here, naming the file
        try:
            heads = d["num_attention_heads"]
            rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
            fields = dict(
                architecture=arch,
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d.get("intermediate_size") or 0,  # an architecture may read it elsewhere (LFM2)
                num_layers=d.get("num_hidden_layers") or 0,  # an architecture may count its layers itself (Nemotron-H)
                num_heads=heads,
                num_kv_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                rope_scaling=_rope_scaling(rope, where),
                max_position_embeddings=d.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                eos_token_ids=_id_list(d.get("eos_token_id")),
            )
            fields.update(spec.configure(d))
            if "layers" not in fields:
                fields["layers"] = llama_layers(d, bias=bool(d.get("attention_bias", False)))
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
