"""Qwen3: the Llama shape with an RMS norm on each head's q and k (before rope), no bias."""
from typing import Any

from ferry.model.arch import Architecture


def configure(d: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True, "qkv_bias": bool(d.get("attention_bias", False))}


ARCH = Architecture("Qwen3ForCausalLM", "qwen3", gguf_name="qwen3", configure=configure,
                    gguf_tensors={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"})
