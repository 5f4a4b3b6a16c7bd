"""Gemma 3 text: interleaved sliding-window and global layers, each kind with its rope base, q/k
norms, GeGLU, embeddings scaled by sqrt(hidden), (1 + w) RMS norms before and after attention and MLP."""
from typing import Any

from ferry.model.arch import Architecture


def configure(d: dict[str, Any]) -> dict[str, Any]:
    from ferry.model.config import rope_scaling

    n = d["num_hidden_layers"]
    pattern = d.get("sliding_window_pattern", 6)
    kinds = d.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                     for i in range(n)]
    rp = d.get("rope_parameters") or {}
    if "full_attention" in rp:  # transformers 5: one rope dict per layer kind
        ropes = {k: (float(v["rope_theta"]), rope_scaling(v, "config.json")) for k, v in rp.items()}
    else:
        ropes = {"full_attention": (float(d.get("rope_theta", 1e6)), rope_scaling(d.get("rope_scaling") or {}, "config.json")),
                 "sliding_attention": (float(d.get("rope_local_base_freq", 1e4)), None)}
    window = d.get("sliding_window")
    return {
        "qk_norm": True, "norm_offset": 1.0, "embed_scale": d["hidden_size"] ** 0.5, "sandwich_norms": True,
        "attn_scale": d.get("query_pre_attn_scalar", d.get("head_dim", 256)) ** -0.5,
        "layer_windows": tuple(window if k == "sliding_attention" else None for k in kinds),
        "layer_ropes": tuple(ropes[k] for k in kinds),
        "final_logit_softcap": d.get("final_logit_softcapping"),
        "tie_word_embeddings": d.get("tie_word_embeddings", True),
        "head_dim": d.get("head_dim", 256),
    }


# No GGUF form yet: llama.cpp names these norms (and stores their weights) differently.
ARCH = Architecture("Gemma3ForCausalLM", "gemma3_text", configure=configure, fused_decode=False)
