"""Qwen2: the Llama shape with a bias on q, k and v."""
from typing import Any

from ferry.model.arch import Architecture
from ferry.model.arch.parts import llama_layers


def configure(d: dict[str, Any]) -> dict[str, Any]:
    # Qwen2 configs carry a window they use only with use_sliding_window (then on layers from max_window_layers).
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    layers = d["num_hidden_layers"]
    first = d.get("max_window_layers", layers) if window else layers
    return {"layers": llama_layers(d, bias=True, windows=[window if i >= first else None for i in range(layers)])}


ARCH = Architecture("Qwen2ForCausalLM", "qwen2", gguf_name="qwen2", configure=configure)
