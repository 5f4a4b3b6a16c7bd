"""LFM2 (Liquid AI): gated short-convolution layers interleaved with attention layers (q/k norms,
GQA), every layer with a SwiGLU MLP whose width is adjusted from the configured one as
transformers does; tied embeddings, and its final norm named ``embedding_norm``."""
from typing import Any, Callable

from ferry.model.arch import Architecture
from ferry.model.arch.parts import AttentionSpec, LayerSpec, MLPSpec, ShortConvSpec


def mlp_width(d: dict[str, Any]) -> int:
    """The MLP's width as transformers' Lfm2MLP computes it: two thirds of block_ff_dim (else
    intermediate_size), times block_ffn_dim_multiplier, up to a multiple of block_multiple_of."""
    width = d.get("block_ff_dim", d.get("intermediate_size", 12288))
    if d.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = d.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            of = d.get("block_multiple_of", 256)
            width = of * ((int(multiplier * width) + of - 1) // of)
    return width


def layer_kinds(d: dict[str, Any]) -> list[str]:
    """Each layer's kind, "conv" or "full_attention": layer_types, else from full_attn_idxs (every
    layer attention when neither is given, as transformers reads it)."""
    n = d["num_hidden_layers"]
    if d.get("layer_types"):
        return list(d["layer_types"])
    idxs = d.get("full_attn_idxs")
    idxs = range(n) if idxs is None else idxs
    return ["full_attention" if i in idxs else "conv" for i in range(n)]


def configure(d: dict[str, Any]) -> dict[str, Any]:
    from ferry.model.config import rope_scaling

    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(d.get("rope_theta") or rp.get("rope_theta") or 1e6)  # transformers' default base for LFM2
    rope = (theta, rope_scaling(rp, "config.json"))
    conv = ShortConvSpec(int(d.get("conv_L_cache", 3)), bool(d.get("conv_bias", False)))
    layers = tuple(LayerSpec(conv if kind == "conv" else AttentionSpec(rope=rope, qk_norm=True), MLPSpec("silu"))
                   for kind in layer_kinds(d))
    return {"layers": layers, "intermediate_size": mlp_width(d), "rms_norm_eps": float(d.get("norm_eps", 1e-5)),
            "rope_theta": theta, "rope_scaling": rope[1],
            "tie_word_embeddings": bool(d.get("tie_embedding", d.get("tie_word_embeddings", True)))}


def gguf_configure(meta: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json from llama.cpp's lfm2 metadata: a layer with no KV heads is a short-conv layer,
    and its feed_forward_length is the MLP's width already adjusted."""
    n, kv = meta("block_count"), meta("attention.head_count_kv")
    kv = list(kv) if isinstance(kv, (list, tuple)) else [kv] * n
    return {"layer_types": ["conv" if k == 0 else "full_attention" for k in kv],
            "num_key_value_heads": max(kv), "conv_L_cache": meta("shortconv.l_cache"),
            "conv_bias": any(name.endswith("conv.conv.bias") for name in tensors),
            "norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)), "block_auto_adjust_ff_dim": False,
            "rope_theta": float(meta("rope.freq_base", 1e6)), "tie_word_embeddings": "lm_head.weight" not in tensors}


def gguf_tensor(name: str, a: Any) -> Any:
    """A GGUF tensor as the checkpoint keeps it: llama.cpp squeezes the conv weight to [hidden, K]."""
    return a[:, None, :] if name.endswith("conv.conv.weight") and a.ndim == 2 else a


NAMES = {
    "final_norm": ("model.embedding_norm", "token_embd_norm"),
    "input_norm": ("operator_norm", "attn_norm"), "mlp_norm": ("ffn_norm", "ffn_norm"),
    "o": ("self_attn.out_proj", "attn_output"),
    "q_norm": ("self_attn.q_layernorm", "attn_q_norm"), "k_norm": ("self_attn.k_layernorm", "attn_k_norm"),
    "gate": ("feed_forward.w1", "ffn_gate"), "up": ("feed_forward.w3", "ffn_up"),
    "down": ("feed_forward.w2", "ffn_down"),
    "short_conv_in": ("conv.in_proj", "shortconv.in_proj"), "short_conv": ("conv.conv", "shortconv.conv"),
    "short_conv_out": ("conv.out_proj", "shortconv.out_proj"),
}

ARCH = Architecture("Lfm2ForCausalLM", "lfm2", gguf_name="lfm2", configure=configure, names=NAMES,
                    gguf_configure=gguf_configure, gguf_tensor=gguf_tensor)
