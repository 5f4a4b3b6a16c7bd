"""Llama (and SmolLM, Llama 3.x with its rope scalings): the reference shape."""
from ferry.model.arch import Architecture

ARCH = Architecture("LlamaForCausalLM", "llama", gguf_name="llama", gguf_permuted_qk=True)
