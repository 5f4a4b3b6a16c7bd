"""Granite 4 (GraniteMoeHybridForCausalLM): Mamba2 layers with a few attention layers between them
(no rotation in the hybrids: position_embedding_type "nope"; rope in the dense ones), every layer
followed by a shared SwiGLU MLP (its gate and up one checkpoint tensor) and, where
num_local_experts > 0, routed experts added to it. Its muP multipliers: on the embeddings
(embed_scale), as the attention scale, on every residual add and as a divisor of the logits."""
from typing import Any, Callable

from ferry.model.arch import Architecture
from ferry.model.arch.parts import (AttentionSpec, LayerSpec, Mamba2Spec, MLPSpec, NoRopeAttentionSpec,
                                    StackedExpertsSpec, hidden_act, mamba2_names)

# layer_types as published ("mamba", "attention") and as transformers 5 writes them.
MAMBA, ATTENTION = ("mamba", "linear_attention"), ("attention", "full_attention")

# config.json's multipliers that need a ModelConfig field the decoder reads (ferry.model.config):
# config key -> field. While a field is missing, a value other than 1 is refused, not run wrong.
SCALES = {"residual_multiplier": "residual_scale", "logits_scaling": "logits_divisor"}


def time_step_limit(d: dict[str, Any], key: str = "time_step_limit") -> tuple[float, float]:
    """(low, high) bounds of Mamba2's time steps: config.json's pair (transformers 5 writes infinity
    as {"__float__": "Infinity"}), (0, inf) when absent."""
    pair = d.get(key) or (0.0, float("inf"))
    return tuple(float(v["__float__"] if isinstance(v, dict) else v) for v in pair)  # type: ignore[return-value]


def mamba(d: dict[str, Any]) -> Mamba2Spec:
    """The Mamba2 mixer of Granite 4's config.json (mamba_d_head "auto": the channels over the heads)."""
    heads = d.get("mamba_n_heads", 128)
    head_dim = d.get("mamba_d_head", "auto")
    if head_dim in ("auto", None):
        head_dim = d.get("mamba_expand", 2) * d["hidden_size"] // heads
    return Mamba2Spec(heads, head_dim, d.get("mamba_d_state", 256), d.get("mamba_n_groups", 1),
                      d.get("mamba_d_conv", 4), d.get("mamba_chunk_size", 256), time_step_limit(d),
                      bool(d.get("mamba_conv_bias", True)), bool(d.get("mamba_proj_bias", False)))


def attention(d: dict[str, Any]) -> AttentionSpec:
    """Its attention: scaled by attention_multiplier; rotated only where position_embedding_type is "rope"."""
    from ferry.model.config import rope_scaling

    if d.get("attention_bias"):  # transformers' would bias o_proj too, which AttentionSpec has no room for
        raise ValueError("unsupported attention_bias true in config.json; ferry runs Granite 4 without biases")
    scale = float(d.get("attention_multiplier", 1.0))
    if d.get("position_embedding_type") != "rope":
        return NoRopeAttentionSpec(scale=scale)
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(d.get("rope_theta") or rp.get("rope_theta") or 10000.0)
    return AttentionSpec(rope=(theta, rope_scaling(rp, "config.json")), scale=scale)


def scales(d: dict[str, Any]) -> dict[str, float]:
    """The residual and logit multipliers as ModelConfig fields, where ModelConfig has them."""
    from ferry.model.config import ModelConfig

    out = {}
    for key, field in SCALES.items():
        value = float(d.get(key) or 1.0)
        if field in ModelConfig.__dataclass_fields__:
            out[field] = value
        elif value != 1.0:
            raise ValueError(f"unsupported {key} {value:g} in config.json; ferry runs Granite 4 with {key} 1")
    return out


def configure(d: dict[str, Any]) -> dict[str, Any]:
    n = d["num_hidden_layers"]
    kinds = d.get("layer_types") or d.get("layers_block_type") or ["mamba"] * n
    unknown = sorted(set(kinds) - set(MAMBA + ATTENTION))
    if unknown or len(kinds) != n:
        raise ValueError(f"config.json's layer_types must be {n} of 'mamba' and 'attention'; "
                         f"got {unknown or len(kinds)}")
    act, experts = hidden_act(d), d.get("num_local_experts") or 0
    mlp = (StackedExpertsSpec(experts, d["num_experts_per_tok"], d["intermediate_size"], True, act,
                              stacked=bool(d.get("stacked_experts", True))) if experts else MLPSpec(act))
    mixers = {kind: (mamba(d) if kind in MAMBA else attention(d)) for kind in set(kinds)}
    return {"layers": tuple(LayerSpec(mixers[kind], mlp) for kind in kinds),
            "intermediate_size": d.get("shared_intermediate_size", 1024),  # the shared MLP's (experts': their spec)
            "embed_scale": float(d.get("embedding_multiplier") or 1.0), **scales(d)}


def mamba2_gguf_tensor(name: str, a: Any) -> Any:
    """A Mamba2 tensor of a GGUF as the checkpoint keeps it: llama.cpp stores A = -exp(A_log) and D
    as [heads, 1], the conv weight squeezed to [channels, K], the gated norm as [groups, channels / groups]."""
    import numpy as np

    if name.endswith(".A_log"):
        return np.log(-a.reshape(-1))
    if name.endswith(".D"):
        return a.reshape(-1)
    if name.endswith("conv1d.weight") and a.ndim == 2:
        return a[:, None, :]
    if name.endswith("norm.weight") and a.ndim == 2:
        return a.reshape(-1)
    return a


def per_layer(value: Any, n: int) -> list[Any]:
    """A GGUF metadata value that may be one per layer (a list) or one for all."""
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


def mamba2_gguf_fields(meta: Callable[..., Any], tensors: dict[str, Any], module: str) -> dict[str, Any]:
    """The Mamba2 shape in llama.cpp's ssm metadata, under Granite 4's config.json names."""
    heads, inner = meta("ssm.time_step_rank"), meta("ssm.inner_size")
    return {"mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_d_state": meta("ssm.state_size"),
            "mamba_n_groups": meta("ssm.group_count"), "mamba_d_conv": meta("ssm.conv_kernel"),
            "mamba_conv_bias": any(k.endswith(f"{module}.conv1d.bias") for k in tensors),
            "mamba_proj_bias": any(k.endswith(f"{module}.in_proj.bias") for k in tensors)}


def gguf_configure(meta: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json from llama.cpp's granitehybrid metadata: a layer holding attention tensors is
    attention, none rotates; the muP scales; the experts one tensor each (as the GGUF's are split)."""
    if meta("rope.scaling.finetuned"):  # llama.cpp's flag for a hybrid that rotates: Bamba's files, not Granite 4's
        raise ValueError("a granitehybrid GGUF with rope (Bamba) is not one ferry reads")
    n = meta("block_count")
    # By the tensors, not head_count_kv: llama.cpp's converter run with transformers 5 (which renames
    # layer_types to "full_attention") writes 0 KV heads for every layer.
    k_proj = [tensors.get(f"model.layers.{i}.self_attn.k_proj.weight") for i in range(n)]
    kv = [0 if k is None else k.shape[0] * meta("attention.head_count") // meta("embedding_length") for k in k_proj]
    shared = next(a.shape[0] for k, a in tensors.items() if k.endswith("shared_mlp.gate_proj.weight"))
    experts = meta("expert_count") or 0
    out = {"layer_types": ["attention" if k else "mamba" for k in kv], "num_key_value_heads": max(kv),
           **mamba2_gguf_fields(meta, tensors, "mamba"),
           "position_embedding_type": "nope",
           "embedding_multiplier": meta("embedding_scale", 1.0), "attention_multiplier": meta("attention.scale", 1.0),
           "residual_multiplier": meta("residual_scale", 1.0), "logits_scaling": meta("logit_scale", 1.0),
           "shared_intermediate_size": shared, "num_local_experts": experts, "stacked_experts": False,
           # llama.cpp's converter writes the experts' width as feed_forward_length
           "intermediate_size": (meta("expert_feed_forward_length") or meta("feed_forward_length")) if experts
           else shared}
    if experts:
        out["num_experts_per_tok"] = meta("expert_used_count")
    return out


NAMES = {
    **mamba2_names("mamba"),
    # The shared MLP's gate and up are one checkpoint tensor (input_linear), split at load. llama.cpp
    # names it ffn_* alone and ffn_*_shexp beside experts: the shared-expert roles (which Granite's
    # parts do not declare) give the GGUF its second names.
    "gate": ("shared_mlp.gate_proj", "ffn_gate"), "up": ("shared_mlp.up_proj", "ffn_up"),
    "down": ("shared_mlp.output_linear", "ffn_down"),
    "shared_gate": ("shared_mlp.gate_proj", "ffn_gate_shexp"), "shared_up": ("shared_mlp.up_proj", "ffn_up_shexp"),
    "shared_down": ("shared_mlp.output_linear", "ffn_down_shexp"),
    "router": ("block_sparse_moe.router.layer", "ffn_gate_inp"),
    # The stacked experts have no GGUF name (llama.cpp splits input_linear into gate and up); a
    # GGUF's come one tensor per expert.
    "experts_gate_up": ("block_sparse_moe.input_linear", ""), "experts_down": ("block_sparse_moe.output_linear", ""),
    "expert_gate": ("block_sparse_moe.experts.{e}.gate_proj", "ffn_gate_exps"),
    "expert_up": ("block_sparse_moe.experts.{e}.up_proj", "ffn_up_exps"),
    "expert_down": ("block_sparse_moe.experts.{e}.down_proj", "ffn_down_exps"),
}

# llama.cpp permutes q/k rows for its rope even in the hybrids, which do not rotate: the same
# permutation of q's and k's rows within each head leaves every q.k, so nothing is undone.
ARCH = Architecture("GraniteMoeHybridForCausalLM", "granitemoehybrid", gguf_name="granitehybrid",
                    configure=configure, names=NAMES, gguf_configure=gguf_configure, gguf_tensor=mamba2_gguf_tensor,
                    checkpoint_fused={"shared_mlp.input_linear": ("ffn_gate_up_shexp", ("gate", "up"))})
