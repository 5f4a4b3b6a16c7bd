"""Mistral: the Llama shape with a sliding window on every layer (``sliding_window``, None: none)."""
from typing import Any

from ferry.model.arch import Architecture
from ferry.model.arch.parts import llama_layers


def configure(d: dict[str, Any]) -> dict[str, Any]:
    windows = [d.get("sliding_window")] * d["num_hidden_layers"]
    return {"layers": llama_layers(d, windows=windows, bias=bool(d.get("attention_bias", False)))}


# llama.cpp writes Mistral as "llama" (no window): a GGUF of it loads as Llama.
ARCH = Architecture("MistralForCausalLM", "mistral", configure=configure)
