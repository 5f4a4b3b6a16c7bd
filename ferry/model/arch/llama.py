"""Llama (and SmolLM, Llama 3.x with its rope scalings): the reference shape."""
from typing import Any, Callable

from ferry.model.arch import Architecture


def gguf_configure(meta: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp writes Mistral as a llama with a window: Hugging Face's name for that is Mistral."""
    window = meta("attention.sliding_window")
    return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": window} if window else {}


ARCH = Architecture("LlamaForCausalLM", "llama", gguf_name="llama", gguf_permuted_qk=True, gguf_configure=gguf_configure)
