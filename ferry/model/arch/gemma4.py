"""Gemma 4 text: Gemma 3's shape (sliding-window and global layers, q/k norms, GeGLU, embeddings
scaled by sqrt(hidden), norms before and after attention and MLP, a final logit soft-cap) with plain-w
RMS norms, an attention scale of 1, a scale-less norm of v, global layers of their own head size
(and KV heads, with k_eq_v) rotated in part ("proportional" rope), per-layer input embeddings added
by a third block in each layer, a learned scalar on each layer's output, and the last
``num_kv_shared_layers`` layers reading the K/V of the last earlier layer of their kind. With
enable_moe_block (26B-A4B) each feed-forward block adds routed experts to its MLP (Gemma4MoESpec)."""
from typing import Any, Callable

from ferry.model.arch import Architecture
from ferry.model.arch.parts import Gemma4AttentionSpec, Gemma4MoESpec, LayerSpec, MLPSpec, hidden_act


def layer_kinds(d: dict[str, Any]) -> list[str]:
    """Each layer's "sliding_attention" or "full_attention" (every 6th global, and the last, as transformers says)."""
    n = d["num_hidden_layers"]
    kinds = list(d.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    kinds[-1] = "full_attention"
    return kinds


def kv_sources(kinds: list[str], shared: int) -> list[int | None]:
    """Each layer's K/V source: None for the first ``len(kinds) - shared`` layers, for the others the
    last of those of its kind (transformers' ``kv_sharing_modes``), or a ValueError."""
    first = len(kinds) - shared
    out: list[int | None] = [None] * len(kinds)
    for i in range(first, len(kinds)):
        own = [j for j in range(first) if kinds[j] == kinds[i]]
        if not own:
            raise ValueError(f"config.json: num_kv_shared_layers {shared} leaves no earlier {kinds[i]} layer "
                             f"to share K/V with")
        out[i] = own[-1]
    return out


def configure(d: dict[str, Any]) -> dict[str, Any]:
    from ferry.model.config import rope_scaling

    if d.get("attention_bias"):
        raise ValueError("config.json: Gemma 4 with attention_bias is not supported")
    if d.get("use_bidirectional_attention") == "all":
        raise ValueError("config.json: use_bidirectional_attention 'all' is not supported (ferry's attention is causal)")
    n, kinds = d["num_hidden_layers"], layer_kinds(d)
    rp = d.get("rope_parameters")
    if rp:
        ropes = {k: (float(v.get("rope_theta", 10000.0)), rope_scaling(v, "config.json")) for k, v in rp.items()}
    elif "rope_local_base_freq" in d:  # from a GGUF: the global layers' partial rotation as frequency factors
        ropes = {"full_attention": (float(d.get("rope_theta", 1e6)), rope_scaling(d.get("rope_scaling") or {}, "config.json")),
                 "sliding_attention": (float(d["rope_local_base_freq"]), None)}
    else:  # transformers' defaults
        ropes = {"sliding_attention": (10000.0, None),
                 "full_attention": (1e6, {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6})}
    head_dim, kv = d.get("head_dim", 256), d.get("num_key_value_heads") or d["num_attention_heads"]
    k_eq_v = bool(d.get("attention_k_eq_v", False))
    # transformers' per-layer overrides (its saved configs), else the global layers' own sizes.
    per_layer = {int(k): v for k, v in (d.get("per_layer_config") or {}).items() if str(k).isdigit()}
    full = {"head_dim": d.get("global_head_dim", 512)}
    if k_eq_v and d.get("num_global_key_value_heads"):
        full["num_key_value_heads"] = d["num_global_key_value_heads"]
    sources = kv_sources(kinds, d.get("num_kv_shared_layers") or 0)
    act, width = hidden_act(d), d.get("hidden_size_per_layer_input") or 0
    inter = d["intermediate_size"]
    layers = []
    for i, kind in enumerate(kinds):
        sliding = kind == "sliding_attention"
        own = per_layer.get(i, {}) if per_layer else ({} if sliding else full)
        hd = own.get("head_dim", head_dim)
        mixer = Gemma4AttentionSpec(window=d.get("sliding_window") if sliding else None, rope=ropes[kind],
                                    qk_norm=True, scale=1.0, out_norm=True, rotary_dim=hd, head_dim=hd,
                                    kv_heads=own.get("num_key_value_heads", kv), kv_source=sources[i],
                                    k_eq_v=k_eq_v and not sliding)
        wide = d.get("use_double_wide_mlp") and sources[i] is not None
        layers.append(LayerSpec(mixer, _mlp(d, act, 2 * inter if wide else inter), width, scalar=True))
    return {
        "layers": tuple(layers), "num_layers": n,
        "embed_scale": d["hidden_size"] ** 0.5, "final_logit_softcap": d.get("final_logit_softcapping"),
        "tie_word_embeddings": d.get("tie_word_embeddings", True), "head_dim": head_dim,
        "per_layer_input": width, "per_layer_vocab": d.get("vocab_size_per_layer_input") or d["vocab_size"],
    }


def _mlp(d: dict[str, Any], act: str, inter: int) -> MLPSpec:
    """A layer's feed-forward block: the GeGLU, or with enable_moe_block the GeGLU plus routed experts."""
    if not d.get("enable_moe_block"):
        return MLPSpec(act, True, inter)
    missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if not d.get(k)]
    if missing:
        raise ValueError(f"config.json: enable_moe_block without {', '.join(missing)}")
    return Gemma4MoESpec(act, True, inter, num_experts=d["num_experts"], top_k=d["top_k_experts"],
                         expert_intermediate=d["moe_intermediate_size"])


def split_experts(weights: dict[str, Any]) -> dict[str, Any]:
    """Each layer's experts as the declarations name them: a checkpoint's stacked gate_up_proj
    [experts, 2 * intermediate, hidden] (each expert's gate rows first) and down_proj as one tensor
    per expert and projection; from a GGUF (already one per expert) gate_up split in rows, the
    router's scale (ffn_gate_inp.scale) and the per-expert scales (ffn_down_exps.scale, one per
    expert) under transformers' names."""
    import torch

    from ferry.model.tensor_parallel import shard_rows

    for name in [n for n in weights if n.endswith(".experts.gate_up_proj")]:  # transformers' stacked tensors
        base = name[: -len("gate_up_proj")]
        gate_up, down = weights.pop(name), weights.pop(base + "down_proj")
        for e in range(gate_up.shape[0]):
            weights[f"{base}{e}.gate_up_proj.weight"] = gate_up[e]
            weights[f"{base}{e}.down_proj.weight"] = down[e]
    for name in [n for n in weights if n.endswith(".gate_up_proj.weight") and ".experts." in n]:
        w = weights.pop(name)
        half, base = w.shape[0] // 2, name[: -len("gate_up_proj.weight")]
        weights[base + "gate_proj.weight"] = shard_rows(w, 0, half)
        weights[base + "up_proj.weight"] = shard_rows(w, half, 2 * half)
    for name in [n for n in weights if n.endswith(".router.proj.scale")]:
        weights[name[: -len("proj.scale")] + "scale"] = weights.pop(name)
    for name in [n for n in weights if n.endswith(".experts.0.down_proj.scale")]:
        base = name[: -len("0.down_proj.scale")]
        count = sum(1 for n in weights if n.startswith(base) and n.endswith(".down_proj.scale"))
        scales = [weights.pop(f"{base}{e}.down_proj.scale") for e in range(count)]
        weights[base[: -len("experts.")] + "router.per_expert_scale"] = torch.stack([torch.as_tensor(x) for x in scales]).reshape(count)
    return weights


def gguf_configure(meta: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json from llama.cpp's gemma4 metadata: windowed layers by its pattern (a flag per layer),
    their head size and rope base apart from the global layers', KV heads one count or per layer, the
    feed-forward width per layer (the shared layers' double-wide), the per-layer input width and the
    shared layers. (Its rope_freqs tensor, the global layers' partial rotation, becomes rope_scaling.)"""
    n = meta("block_count")
    pattern = meta("attention.sliding_window_pattern")
    windowed = [bool(x) for x in pattern] if isinstance(pattern, list) else [(i + 1) % 6 != 0 for i in range(n)]
    kinds = ["sliding_attention" if w else "full_attention" for w in windowed]
    ff, kv = meta("feed_forward_length"), meta("attention.head_count_kv")
    ff = ff if isinstance(ff, list) else [ff] * n
    out = {
        "layer_types": kinds, "sliding_window": meta("attention.sliding_window"),
        "head_dim": meta("attention.key_length_swa", meta("attention.key_length")),
        "global_head_dim": meta("attention.key_length"), "hidden_activation": "gelu_pytorch_tanh",
        "rope_local_base_freq": float(meta("rope.freq_base_swa", 10000.0)),
        "final_logit_softcapping": meta("final_logit_softcapping"),
        "num_kv_shared_layers": meta("attention.shared_kv_layers", 0),
        "hidden_size_per_layer_input": meta("embedding_length_per_layer_input", 0),
        "intermediate_size": min(ff), "use_double_wide_mlp": max(ff) > min(ff),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
    }
    if meta("expert_count", 0):
        out.update(enable_moe_block=True, num_experts=meta("expert_count"), top_k_experts=meta("expert_used_count"),
                   moe_intermediate_size=meta("expert_feed_forward_length"))
    if "model.embed_tokens_per_layer.weight" in tensors:
        out["vocab_size_per_layer_input"] = tensors["model.embed_tokens_per_layer.weight"].shape[0]
    if isinstance(kv, list):  # the global layers' own KV heads: k_eq_v
        out.update(num_key_value_heads=kv[windowed.index(True)] if True in windowed else kv[0],
                   num_global_key_value_heads=kv[windowed.index(False)], attention_k_eq_v=True)
    return out


# Its MLP's input norm is "pre_feedforward_layernorm"; "post_attention_layernorm" norms the attention's output.
# The experts block's tensors (Gemma4MoESpec). The router's scales' GGUF names are no tensor part
# of llama.cpp's (which writes them as ffn_gate_inp.scale and ffn_down_exps.scale: split_experts
# renames those); "expert_gate_up" names the experts' gate and up rows as both files keep them.
_MOE = {"mlp_out_norm_1": ("post_feedforward_layernorm_1", "post_ffw_norm_1"),
        "moe_norm": ("pre_feedforward_layernorm_2", "pre_ffw_norm_2"),
        "moe_out_norm": ("post_feedforward_layernorm_2", "post_ffw_norm_2"),
        "router": ("router.proj", "ffn_gate_inp"), "router_scale": ("router", "ffn_gate_inp.scale"),
        "expert_scale": ("router", "ffn_down_exps.scale"),
        "expert_gate_up": ("experts.{e}.gate_up_proj", "ffn_gate_up_exps"),
        "expert_gate": ("experts.{e}.gate_proj", "ffn_gate_exps"), "expert_up": ("experts.{e}.up_proj", "ffn_up_exps"),
        "expert_down": ("experts.{e}.down_proj", "ffn_down_exps")}
ARCH = Architecture("Gemma4ForCausalLM", "gemma4_text", gguf_name="gemma4", configure=configure,
                    gguf_configure=gguf_configure, checkpoint_tensors=split_experts,
                    names={"mlp_norm": ("pre_feedforward_layernorm", "ffn_norm"), **_MOE})


# The checkpoints as published: the multimodal model, whose language model is the one above (its
# fields in text_config, its tensors under model.language_model.); the vision and audio towers and
# their embedders are not read.
_TEXT = {"mlp_norm": ("pre_feedforward_layernorm", "ffn_norm"), **_MOE,
         "embed": ("model.language_model.embed_tokens", "token_embd"),
         "final_norm": ("model.language_model.norm", "output_norm"),
         "ple_embed": ("model.language_model.embed_tokens_per_layer", "per_layer_token_embd"),
         "ple_model_proj": ("model.language_model.per_layer_model_projection", "per_layer_model_proj"),
         "ple_model_norm": ("model.language_model.per_layer_projection_norm", "per_layer_proj_norm")}
MM_ARCH = Architecture("Gemma4ForConditionalGeneration", "gemma4", configure=configure, names=_TEXT,
                       checkpoint_tensors=split_experts,
                       layer_prefix="model.language_model.layers", text_config=True,
                       skip_prefixes=("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                                      "model.embed_audio."))
