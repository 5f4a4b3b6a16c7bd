"""Qwen3.5 (text): a hybrid of Gated DeltaNet layers (linear attention with a recurrent state) and,
every ``full_attention_interval``-th layer, gated softmax attention (q_proj also emits a per-head
output gate; q/k norms; rope on the first quarter of each head). (1 + w) RMS norms, except the
DeltaNet's gated norm, which is plain w. Qwen3.5-MoE: the same layers with routed experts (top k,
renormalised) plus a shared expert scaled by sigmoid of its own gate."""
from typing import Any, Callable

from ferry.model.arch import Architecture
from ferry.model.arch.parts import (AttentionSpec, ExpertsSpec, GatedDeltaNetSpec, LayerSpec, MLPSpec,
                                    hidden_act)

# The DeltaNet's tensors (Hugging Face name, llama.cpp's GGUF name); A_log and dt_bias are the
# "linear_attn" module's own parameters (their suffixes), llama.cpp's ssm_a and ssm_dt.bias.
# llama.cpp's qwen35 calls the norm before the MLP post_attention_norm.
NAMES = {
    "gdn_qkv": ("linear_attn.in_proj_qkv", "attn_qkv"), "gdn_z": ("linear_attn.in_proj_z", "attn_gate"),
    "gdn_b": ("linear_attn.in_proj_b", "ssm_beta"), "gdn_a": ("linear_attn.in_proj_a", "ssm_alpha"),
    "gdn_conv": ("linear_attn.conv1d", "ssm_conv1d"), "gdn_A_log": ("linear_attn", "ssm_a"),
    "gdn_dt_bias": ("linear_attn", "ssm_dt"), "gdn_norm": ("linear_attn.norm", "ssm_norm"),
    "gdn_out": ("linear_attn.out_proj", "ssm_out"),
    "mlp_norm": ("post_attention_layernorm", "post_attention_norm"),
}


def layer_types(d: dict[str, Any]) -> list[str]:
    """Each layer's kind, "linear_attention" or "full_attention": config.json's ``layer_types``, else
    every ``full_attention_interval``-th layer (4 by default) full."""
    n = d["num_hidden_layers"]
    kinds = d.get("layer_types")
    if kinds is None:
        every = d.get("full_attention_interval", 4)
        kinds = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if len(kinds) != n or set(kinds) - {"linear_attention", "full_attention"}:
        raise ValueError(f"config.json's layer_types must name {n} layers, each 'linear_attention' or "
                         f"'full_attention'; it has {kinds!r}")
    return list(kinds)


def mixers(d: dict[str, Any]) -> list[Any]:
    """Each layer's mixer spec: a GatedDeltaNetSpec or gated attention with partial rotary."""
    from ferry.model.config import rope_scaling

    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    # Text positions are the same on every multimodal rope axis (mrope_section): one plain rotation.
    scaling = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
    attention = AttentionSpec(rope=(theta, rope_scaling(scaling, "config.json")), qk_norm=True,
                              bias=bool(d.get("attention_bias", False)), rotary_dim=int(head_dim * factor),
                              output_gate=True)
    deltanet = GatedDeltaNetSpec(d.get("linear_num_key_heads", 16), d.get("linear_num_value_heads", 32),
                                 d.get("linear_key_head_dim", 128), d.get("linear_value_head_dim", 128),
                                 d.get("linear_conv_kernel_dim", 4), d.get("linear_value_head_order") == "tiled")
    if deltanet.v_heads % deltanet.k_heads:
        raise ValueError("config.json's linear_num_value_heads must be a multiple of linear_num_key_heads")
    return [deltanet if kind == "linear_attention" else attention for kind in layer_types(d)]


def configure(d: dict[str, Any]) -> dict[str, Any]:
    mlp = MLPSpec(hidden_act(d))
    return {"layers": tuple(LayerSpec(m, mlp) for m in mixers(d)), "head_dim": d.get("head_dim", 256)}


def configure_moe(d: dict[str, Any]) -> dict[str, Any]:
    experts = ExpertsSpec(d.get("num_experts", 256), d.get("num_experts_per_tok", 8), d.get("moe_intermediate_size", 512),
                          renorm=True, act=hidden_act(d),
                          shared_intermediate=d.get("shared_expert_intermediate_size", 512))
    return {"layers": tuple(LayerSpec(m, experts) for m in mixers(d)), "head_dim": d.get("head_dim", 256)}


def gguf_configure(meta: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json from llama.cpp's qwen35 / qwen35moe metadata: the layer kinds, the DeltaNet's
    shapes (ssm.*), the rotated quarter of each head, the experts; its value heads are in llama.cpp's
    tiled order (its converter reorders them so that ggml repeats q/k instead of interleaving)."""
    n = meta("block_count")
    recurrent = meta("attention.recurrent_layers")
    every = meta("full_attention_interval", 4)
    kinds = [bool(r) for r in recurrent[:n]] if recurrent else [(i + 1) % every != 0 for i in range(n)]
    head_dim, v_heads = meta("attention.key_length", 256), meta("ssm.time_step_rank")
    out = {"layer_types": ["linear_attention" if r else "full_attention" for r in kinds], "head_dim": head_dim,
           "linear_conv_kernel_dim": meta("ssm.conv_kernel"), "linear_key_head_dim": meta("ssm.state_size"),
           "linear_num_key_heads": meta("ssm.group_count"), "linear_num_value_heads": v_heads,
           "linear_value_head_dim": meta("ssm.inner_size") // v_heads,
           "partial_rotary_factor": meta("rope.dimension_count", head_dim // 4) / head_dim,
           "linear_value_head_order": "tiled"}
    if meta("expert_count"):
        out.update(num_experts=meta("expert_count"), num_experts_per_tok=meta("expert_used_count"),
                   moe_intermediate_size=meta("expert_feed_forward_length"),
                   shared_expert_intermediate_size=meta("expert_shared_feed_forward_length"),
                   intermediate_size=meta("feed_forward_length") or meta("expert_feed_forward_length"))
    return out


def gguf_tensor(name: str, a: Any) -> Any:
    """A llama.cpp qwen35 tensor as the checkpoint keeps it: A_log from its stored -exp(A_log), the
    conv weight [channels, 1, K] from its squeezed [channels, K], and the gated norm's plain w (the
    reader took the (1 + w) norms' offset off every "*norm.weight")."""
    import numpy as np

    if name.endswith("linear_attn.A_log"):
        return np.log(-a)
    if name.endswith("linear_attn.conv1d.weight") and a.ndim == 2:
        return a[:, None, :]
    if name.endswith("linear_attn.norm.weight"):
        return a + np.float32(1.0)
    return a


ARCH = Architecture("Qwen3_5ForCausalLM", "qwen3_5_text", gguf_name="qwen35", configure=configure, names=NAMES,
                    norm_offset=1.0, gguf_configure=gguf_configure, gguf_tensor=gguf_tensor)
MOE_ARCH = Architecture("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", gguf_name="qwen35moe", configure=configure_moe,
                        names=NAMES, norm_offset=1.0, gguf_configure=gguf_configure, gguf_tensor=gguf_tensor)


# The checkpoints as published: the multimodal model, whose language model is the one above (its
# fields in text_config, its tensors under model.language_model.); the vision tower and the MTP head
# are not read.
_TEXT = {"embed": ("model.language_model.embed_tokens", "token_embd"),
         "final_norm": ("model.language_model.norm", "output_norm")}
VL_ARCH = Architecture("Qwen3_5ForConditionalGeneration", "qwen3_5", configure=configure, names={**NAMES, **_TEXT},
                       norm_offset=1.0, layer_prefix="model.language_model.layers", text_config=True,
                       skip_prefixes=("model.visual.", "mtp."))
VL_MOE_ARCH = Architecture("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", configure=configure_moe,
                           names={**NAMES, **_TEXT}, norm_offset=1.0, layer_prefix="model.language_model.layers",
                           text_config=True, skip_prefixes=("model.visual.", "mtp."))
