"""Gemma 3 text: interleaved sliding-window and global layers, each kind with its rope base, q/k
norms, GeGLU, embeddings scaled by sqrt(hidden), (1 + w) RMS norms before and after attention and MLP."""
from typing import Any, Callable

from ferry.model.arch import Architecture
from ferry.model.arch.parts import llama_layers


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
    scale = d.get("query_pre_attn_scalar", d.get("head_dim", 256)) ** -0.5
    return {
        "layers": llama_layers(d, qk_norm=True, out_norm=True, scale=scale, bias=bool(d.get("attention_bias", False)),
                               windows=[window if k == "sliding_attention" else None for k in kinds],
                               ropes=[ropes[k] for k in kinds]),
        "embed_scale": d["hidden_size"] ** 0.5, "final_logit_softcap": d.get("final_logit_softcapping"),
        "tie_word_embeddings": d.get("tie_word_embeddings", True),
        "head_dim": d.get("head_dim", 256),
    }


def gguf_configure(meta: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json from llama.cpp's gemma3 metadata: its layer pattern (every 6th layer global unless
    the file says otherwise), the windowed layers' rope base, and its attention scale rule."""
    n, hd = meta("block_count"), meta("attention.key_length", 256)
    window = meta("attention.sliding_window") or None
    pattern = meta("attention.sliding_window_pattern", 6)
    windowed = [bool(x) for x in pattern] if isinstance(pattern, list) else \
        [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    return {
        "layer_types": ["sliding_attention" if window and w else "full_attention" for w in windowed],
        "sliding_window": window, "head_dim": hd, "hidden_activation": "gelu_pytorch_tanh",
        "rope_local_base_freq": float(meta("rope.freq_base_swa", 10000.0)),
        # llama.cpp: 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 62-layer 27B.
        "query_pre_attn_scalar": hidden // heads if n == 62 else hd,
        "final_logit_softcapping": meta("final_logit_softcapping"),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
    }


# Its MLP's input norm is "pre_feedforward_layernorm"; "post_attention_layernorm" norms the attention's output.
ARCH = Architecture("Gemma3ForCausalLM", "gemma3_text", gguf_name="gemma3", configure=configure, norm_offset=1.0,
                    gguf_configure=gguf_configure, names={"mlp_norm": ("pre_feedforward_layernorm", "ffn_norm")})


def _transformers5_names(weights: dict[str, Any]) -> dict[str, Any]:
    """Checkpoints saved before transformers 4.52 keep the language model as language_model.model.*
    and its head as language_model.lm_head.*: renamed as transformers 5 saves them."""
    renames = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."))
    out = {}
    for name, w in weights.items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = w
    return out


# The multimodal checkpoint: the language model above (its fields in text_config, its tensors under
# model.language_model.) and a SigLIP tower with Gemma 3's projector (``ferry.model.gemma3_images``),
# whose image tokens attend to each other both ways in prefill.
_TEXT = {"mlp_norm": ("pre_feedforward_layernorm", "ffn_norm"),
         "embed": ("model.language_model.embed_tokens", "token_embd"),
         "final_norm": ("model.language_model.norm", "output_norm")}
TOWER_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")
def mm_configure(d: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields; transformers' Gemma3ForConditionalGeneration applies no final
    logit soft-cap (its published configs have none)."""
    return {**configure(d), "final_logit_softcap": None}


MM_ARCH = Architecture("Gemma3ForConditionalGeneration", "gemma3", configure=mm_configure, norm_offset=1.0,
                       names=_TEXT, layer_prefix="model.language_model.layers", text_config=True,
                       skip_prefixes=TOWER_PREFIXES, checkpoint_tensors=_transformers5_names,
                       bidirectional_images=True)
