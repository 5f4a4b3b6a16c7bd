"""Qwen3: the Llama shape with an RMS norm on each head's q and k (before rope), no bias."""
from typing import Any

from ferry.model.arch import Architecture
from ferry.model.arch.parts import llama_layers


def configure(d: dict[str, Any]) -> dict[str, Any]:
    return {"layers": llama_layers(d, qk_norm=True, bias=bool(d.get("attention_bias", False)))}


ARCH = Architecture("Qwen3ForCausalLM", "qwen3", gguf_name="qwen3", configure=configure)
