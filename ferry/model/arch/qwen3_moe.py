"""Qwen3-MoE: Qwen3's attention, and on its sparse layers a router choosing the top-k of many
experts per token (softmax, then the chosen weights renormalised where norm_topk_prob)."""
from typing import Any, Callable

from ferry.model.arch import Architecture
from ferry.model.arch.parts import ExpertsSpec, hidden_act, llama_layers


def configure(d: dict[str, Any]) -> dict[str, Any]:
    n, step = d["num_hidden_layers"], d.get("decoder_sparse_step", 1)
    dense = set(d.get("mlp_only_layers") or [])
    experts = d.get("num_experts") or d.get("num_local_experts")
    spec = ExpertsSpec(experts, d["num_experts_per_tok"], d["moe_intermediate_size"],
                       bool(d.get("norm_topk_prob", False)), hidden_act(d))
    sparse = [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)]
    return {"layers": llama_layers(d, qk_norm=True, bias=bool(d.get("attention_bias", False)), experts=sparse,
                                   expert_spec=lambda: spec)}


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
                    gguf_configure=gguf_configure)
