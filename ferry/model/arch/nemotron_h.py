"""Nemotron-H (NemotronHForCausalLM): every layer is ONE residual block, x += mixer(norm(x)), its
mixer by hybrid_override_pattern (or layers_block_type): "M" Mamba2, "*" attention (no rotation,
no biases), "-" a non-gated relu^2 MLP, "E" routed experts (Nemotron 3: sigmoid, group-limited
top-k) with a shared non-gated MLP. Its tensors sit under "backbone." and every mixer's under
"mixer."."""
from typing import Any, Callable

from ferry.model.arch import Architecture
from ferry.model.arch.granite4 import mamba2_gguf_fields, mamba2_gguf_tensor, per_layer, time_step_limit
from ferry.model.arch.parts import (LayerSpec, Mamba2Spec, NoRopeAttentionSpec, PlainMLPSpec, SigmoidExpertsSpec,
                                    mamba2_names)

# layers_block_type (transformers 5's names, and the older ones) -> the pattern's letters.
LETTERS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}


def pattern(d: dict[str, Any]) -> str:
    """Each layer's letter: hybrid_override_pattern, else layers_block_type (layer_types)."""
    kinds = d.get("layers_block_type") or d.get("layer_types")
    if kinds:
        unknown = sorted(set(kinds) - set(LETTERS))
        if unknown:
            raise ValueError(f"unsupported layers_block_type {unknown} in config.json; ferry runs {sorted(LETTERS)}")
        return "".join(LETTERS[k] for k in kinds)
    p = d.get("hybrid_override_pattern") or ""
    if not p or set(p) - set("M*-E"):
        raise ValueError(f"config.json's hybrid_override_pattern {p!r} must be letters of M, *, - and E")
    return p


def _refuse(d: dict[str, Any], key: str, ok: Any) -> None:
    if d.get(key, ok) != ok:
        raise ValueError(f"unsupported {key} {d[key]!r} in config.json; ferry runs Nemotron-H with {key} {ok!r}")


def configure(d: dict[str, Any]) -> dict[str, Any]:
    letters = pattern(d)
    _refuse(d, "mamba_hidden_act", "silu")
    _refuse(d, "mlp_bias", False)
    act = d.get("mlp_hidden_act", "relu2")
    mamba = Mamba2Spec(d.get("mamba_num_heads", 128), d.get("mamba_head_dim", 64), d.get("ssm_state_size", 128),
                       d.get("n_groups", d.get("mamba_n_groups", 8)), d.get("conv_kernel", 4), d.get("chunk_size", 128),
                       time_step_limit(d), bool(d.get("use_conv_bias", True)), bool(d.get("use_bias", False)))
    blocks = {"M": (mamba, None), "*": (NoRopeAttentionSpec(), None), "-": (None, PlainMLPSpec(act))}
    if "E" in letters:
        experts = d.get("n_routed_experts") or d.get("num_local_experts")
        blocks["E"] = (None, SigmoidExpertsSpec(
            experts, d["num_experts_per_tok"], d["moe_intermediate_size"], bool(d.get("norm_topk_prob", True)), act,
            shared=d["moe_shared_expert_intermediate_size"], groups=d.get("n_group", 1),
            topk_groups=d.get("topk_group", 1), scale=float(d.get("routed_scaling_factor", 1.0)),
            latent=d.get("moe_latent_size")))
    heads = d["num_attention_heads"]
    return {"layers": tuple(LayerSpec(*blocks[c]) for c in letters), "num_layers": len(letters),
            "head_dim": d.get("head_dim") or d.get("attention_head_dim") or d["hidden_size"] // heads,
            "rms_norm_eps": float(d.get("layer_norm_epsilon", d.get("rms_norm_eps", 1e-5)))}


def gguf_configure(meta: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json from llama.cpp's nemotron_h metadata: a layer with a Mamba2 in_proj is "M", one
    with KV heads "*", one with a feed-forward length "-"."""
    n = meta("block_count")
    kv, ff = per_layer(meta("attention.head_count_kv"), n), per_layer(meta("feed_forward_length"), n)
    m = mamba2_gguf_fields(meta, tensors, "mixer")
    def has(i: int, part: str) -> bool:
        return f"backbone.layers.{i}.mixer.{part}.weight" in tensors

    # By the tensors a layer holds (llama.cpp's nemotron_h_moe files leave feed_forward_length 0).
    letters = ["M" if has(i, "in_proj") else "*" if kv[i] else "E" if has(i, "gate") else "-" if has(i, "up_proj")
               else "?" for i in range(n)]
    ups = [tensors[f"backbone.layers.{i}.mixer.up_proj.weight"].shape[0] for i in range(n) if letters[i] == "-"]
    return {"hybrid_override_pattern": "".join(letters), "num_key_value_heads": max(kv),
            "intermediate_size": max(ups or ff),
            "mamba_num_heads": m["mamba_n_heads"], "mamba_head_dim": m["mamba_d_head"],
            "ssm_state_size": m["mamba_d_state"], "n_groups": m["mamba_n_groups"], "conv_kernel": m["mamba_d_conv"],
            "use_conv_bias": m["mamba_conv_bias"], "use_bias": m["mamba_proj_bias"], "mlp_hidden_act": "relu2",
            "layer_norm_epsilon": float(meta("attention.layer_norm_rms_epsilon", 1e-5)), **gguf_experts(meta)}


def gguf_experts(meta: Callable[..., Any]) -> dict[str, Any]:
    """The routed experts' config.json fields from llama.cpp's nemotron_h_moe metadata (none without)."""
    if not meta("expert_count"):
        return {}
    return {"n_routed_experts": meta("expert_count"), "num_experts_per_tok": meta("expert_used_count"),
            "moe_intermediate_size": meta("expert_feed_forward_length"),
            "moe_shared_expert_intermediate_size": meta("expert_shared_feed_forward_length"),
            "n_group": meta("expert_group_count", 1), "topk_group": meta("expert_group_used_count", 1),
            "norm_topk_prob": bool(meta("expert_weights_norm", True)),
            "routed_scaling_factor": float(meta("expert_weights_scale", 1.0))}


NAMES = {
    **mamba2_names("mixer"),
    "embed": ("backbone.embeddings", "token_embd"), "final_norm": ("backbone.norm_f", "output_norm"),
    "input_norm": ("norm", "attn_norm"), "mlp_norm": ("norm", "attn_norm"),
    "q": ("mixer.q_proj", "attn_q"), "k": ("mixer.k_proj", "attn_k"), "v": ("mixer.v_proj", "attn_v"),
    "o": ("mixer.o_proj", "attn_output"),
    "up": ("mixer.up_proj", "ffn_up"), "down": ("mixer.down_proj", "ffn_down"),
    "router": ("mixer.gate", "ffn_gate_inp"), "router_bias": ("mixer.gate", "exp_probs_b"),
    "expert_up": ("mixer.experts.{e}.up_proj", "ffn_up_exps"),
    "expert_down": ("mixer.experts.{e}.down_proj", "ffn_down_exps"),
    "shared_up": ("mixer.shared_experts.up_proj", "ffn_up_shexp"),
    "shared_down": ("mixer.shared_experts.down_proj", "ffn_down_shexp"),
    "latent_in": ("mixer.fc1_latent_proj", "ffn_latent_in"), "latent_out": ("mixer.fc2_latent_proj", "ffn_latent_out"),
}

# llama.cpp permutes q/k rows for its rope though Nemotron-H does not rotate: the same permutation of
# q's and k's rows within each head leaves every q.k, so nothing is undone. Its MoE models are
# another GGUF architecture (nemotron_h_moe), not read here.
ARCH = Architecture("NemotronHForCausalLM", "nemotron_h", gguf_name="nemotron_h", configure=configure, names=NAMES,
                    checks_hidden_act=False, gguf_aliases=("nemotron_h_moe",),
                    layer_prefix="backbone.layers", gguf_configure=gguf_configure, gguf_tensor=mamba2_gguf_tensor)
