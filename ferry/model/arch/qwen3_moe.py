"""Qwen3-MoE: Qwen3's attention, and on its sparse layers a router choosing the top-k of many
experts per token (softmax, then the chosen weights renormalised where norm_topk_prob)."""
from typing import Any

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


# No GGUF form yet (llama.cpp stacks the experts into 3-D tensors).
ARCH = Architecture("Qwen3MoeForCausalLM", "qwen3_moe", configure=configure, fused_decode=False)
