"""gpt-oss: attention with sinks, q/k/v and o biases, sliding-window and full layers alternating (as
``layer_types`` says), rope as its config says (YaRN); on every layer a router with a bias picks the
top k experts (softmax of their logits), each expert a gated MLP with biases and gpt-oss's clamped
SwiGLU, (clamp(up) + 1) * g * sigmoid(alpha * g).

The checkpoint stacks each layer's experts: ``mlp.experts.gate_up_proj`` [E, hidden, 2I] (gate and up
columns interleaved) and ``down_proj`` [E, I, hidden], with ``*_bias`` beside them; ``split_experts``
gives them the per-expert names the declarations read. llama.cpp's GGUF (``gpt-oss``) stores them
split already, its experts in MXFP4 where the source was."""
from __future__ import annotations

from typing import Any, Callable

from ferry.model.arch import Architecture
from ferry.model.arch.parts import ExpertsSpec, llama_layers


def configure(d: dict[str, Any]) -> dict[str, Any]:
    n = d["num_hidden_layers"]
    kinds = d.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    spec = ExpertsSpec(d["num_local_experts"], d["num_experts_per_tok"], d["intermediate_size"], renorm=True,
                       act="swiglu_clamp", bias=True,
                       swiglu=(float(d.get("swiglu_alpha", 1.702)), float(d.get("swiglu_limit", 7.0))))
    window = d.get("sliding_window")
    return {"layers": llama_layers(d, bias=bool(d.get("attention_bias", True)), o_bias=bool(d.get("attention_bias", True)),
                                   sinks=True, windows=[window if k == "sliding_attention" else None for k in kinds],
                                   experts=[True] * n, expert_spec=lambda: spec)}


def split_experts(weights: dict[str, Any]) -> dict[str, Any]:
    """Each layer's stacked expert tensors as one tensor per expert and projection: gate and up the
    even and odd columns of gate_up_proj, each matrix transposed to [out, in]."""
    for name in [n for n in weights if n.endswith(".mlp.experts.gate_up_proj")]:
        base = name[: -len("gate_up_proj")]
        gate_up, down = weights.pop(name), weights.pop(base + "down_proj")
        gu_bias, down_bias = weights.pop(base + "gate_up_proj_bias"), weights.pop(base + "down_proj_bias")
        for e in range(gate_up.shape[0]):
            w = gate_up[e].t()  # [2I, hidden], gate and up rows interleaved
            weights[f"{base}{e}.gate_proj.weight"] = w[0::2].contiguous()
            weights[f"{base}{e}.up_proj.weight"] = w[1::2].contiguous()
            weights[f"{base}{e}.gate_proj.bias"] = gu_bias[e, 0::2].contiguous()
            weights[f"{base}{e}.up_proj.bias"] = gu_bias[e, 1::2].contiguous()
            weights[f"{base}{e}.down_proj.weight"] = down[e].t().contiguous()
            weights[f"{base}{e}.down_proj.bias"] = down_bias[e].contiguous()
    return weights


def gguf_configure(meta: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json from llama.cpp's gpt-oss metadata: every other layer windowed (the first one
    so, as llama.cpp's pattern of 2), the experts' sizes, and YaRN untruncated as gpt-oss's config says."""
    from ferry.model.gguf_convert import _rope_scaling

    n, window = meta("block_count"), meta("attention.sliding_window")
    out = {"num_local_experts": meta("expert_count"), "num_experts_per_tok": meta("expert_used_count"),
           "intermediate_size": meta("expert_feed_forward_length") or meta("feed_forward_length"),
           "sliding_window": window, "attention_bias": True,
           "layer_types": ["sliding_attention" if window and i % 2 == 0 else "full_attention" for i in range(n)]}
    rope = _rope_scaling(meta, tensors)
    if rope and rope["rope_type"] == "yarn":
        out["rope_scaling"] = dict(rope, truncate=False)
    return out


ARCH = Architecture("GptOssForCausalLM", "gpt_oss", gguf_name="gpt-oss", configure=configure,
                    gguf_configure=gguf_configure, checkpoint_tensors=split_experts,
                    names={"router": ("mlp.router", "ffn_gate_inp"),
                           "mlp_norm": ("post_attention_layernorm", "post_attention_norm")})
