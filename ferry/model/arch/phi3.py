"""Phi-3 (and Phi-4-mini shapes without partial rotary): the Llama layer with q, k, v fused into one
checkpoint tensor and gate, up into another; longrope scaling for its long-context versions."""
from typing import Any, Callable

from ferry.model.arch import Architecture
from ferry.model.arch.parts import llama_layers


def configure(d: dict[str, Any]) -> dict[str, Any]:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if float(rope.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError("Phi models with partial_rotary_factor != 1 are not supported by ferry yet")
    out: dict[str, Any] = {}
    window = d.get("sliding_window")
    if window is not None and window >= d.get("max_position_embeddings", 0):
        window = None  # a window as long as the model is no window
    ropes = None
    if rope.get("rope_type", rope.get("type")) == "longrope":
        from ferry.model.config import rope_scaling

        sc = dict(rope, original_max_position_embeddings=rope.get("original_max_position_embeddings")
                  or d.get("original_max_position_embeddings"))
        out["rope_scaling"] = rope_scaling(sc, "config.json")
        ropes = [(float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0), out["rope_scaling"])] * d["num_hidden_layers"]
    out["layers"] = llama_layers(d, windows=[window] * d["num_hidden_layers"], ropes=ropes,
                                 bias=bool(d.get("attention_bias", False)))
    return out


def gguf_configure(meta: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json from llama.cpp's phi3 metadata: its window (0: none), rotary width, and longrope
    factors, which it keeps as two tensors."""
    hd = meta("embedding_length") // meta("attention.head_count")
    out: dict[str, Any] = {"sliding_window": meta("attention.sliding_window") or None,
                           "partial_rotary_factor": meta("rope.dimension_count", hd) / hd,
                           "original_max_position_embeddings": meta("rope.scaling.original_context_length")}
    if "rope_factors_long.weight" in tensors:
        out["rope_scaling"] = {"rope_type": "longrope",
                               "long_factor": tensors.pop("rope_factors_long.weight").tolist(),
                               "short_factor": tensors.pop("rope_factors_short.weight").tolist(),
                               "original_max_position_embeddings": out["original_max_position_embeddings"]}
    return out


ARCH = Architecture("Phi3ForCausalLM", "phi3", gguf_name="phi3", configure=configure, gguf_configure=gguf_configure,
                    # llama.cpp keeps Phi-3's fused checkpoint tensors as they are: ffn_up holds gate and up.
                    checkpoint_fused={"self_attn.qkv_proj": ("attn_qkv", ("q", "k", "v")),
                                      "mlp.gate_up_proj": ("ffn_up", ("gate", "up"))})
