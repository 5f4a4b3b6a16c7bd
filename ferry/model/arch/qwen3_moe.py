"""Qwen3-MoE: Qwen3's attention, and on its sparse layers a router choosing the top-k of many
experts per token (softmax, then the chosen weights renormalised where norm_topk_prob)."""
from typing import Any, Callable

from ferry.model.arch import Architecture


def configure(d: dict[str, Any]) -> dict[str, Any]:
    n, step = d["num_hidden_layers"], d.get("decoder_sparse_step", 1)
    dense = set(d.get("mlp_only_layers") or [])
    experts = d.get("num_experts") or d.get("num_local_experts")
    return {
        "qk_norm": True, "qkv_bias": bool(d.get("attention_bias", False)), "num_experts": experts,
        "experts_per_token": d["num_experts_per_tok"], "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "moe_intermediate_size": d["moe_intermediate_size"],
        "moe_layers": tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)),
    }


def gguf_configure(meta: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json from llama.cpp's qwen3moe metadata; a layer without a router is a dense one, and
    llama.cpp always renormalises the chosen experts' weights."""
    n = meta("block_count")
    return {"num_experts": meta("expert_count"), "num_experts_per_tok": meta("expert_used_count"),
            "moe_intermediate_size": meta("expert_feed_forward_length"), "norm_topk_prob": True,
            "intermediate_size": meta("feed_forward_length") or meta("expert_feed_forward_length"),
            "mlp_only_layers": [i for i in range(n) if f"model.layers.{i}.mlp.gate.weight" not in tensors]}


# llama.cpp stacks each layer's experts into one 3-D tensor per projection.
ARCH = Architecture("Qwen3MoeForCausalLM", "qwen3_moe", gguf_name="qwen3moe", configure=configure,
                    fused_decode=False, gguf_configure=gguf_configure,
                    gguf_tensors={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                                  "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
                                  "ffn_up_exps": "mlp.experts.{e}.up_proj",
                                  "ffn_down_exps": "mlp.experts.{e}.down_proj"})
