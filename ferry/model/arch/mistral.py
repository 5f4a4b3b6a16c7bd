"""Mistral: the Llama shape with a sliding window on every layer (``sliding_window``, None: none)."""
from typing import Any

from ferry.model.arch import Architecture


def configure(d: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_window": d.get("sliding_window")}


# llama.cpp writes Mistral as "llama" (no window): a GGUF of it loads as Llama.
ARCH = Architecture("MistralForCausalLM", "mistral", configure=configure)
