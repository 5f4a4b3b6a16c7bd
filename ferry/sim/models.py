"""Model shapes for simulation: presets of popular models, or any config.json ferry can read."""
from __future__ import annotations

import json
from pathlib import Path

from ferry.model.config import ModelConfig

# The fields of each model's published config.json that shape its cost.
_PRESETS = {
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=False),
    "llama-3.1-70b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192,
                          intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=False),
    "qwen2.5-7b": dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, max_position_embeddings=32768, tie_word_embeddings=False),
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True),
}
PRESETS = tuple(_PRESETS)


def load_model_config(name_or_path: str) -> ModelConfig:
    """A preset name, a config.json, or a model directory holding one."""
    if name_or_path in _PRESETS:
        return ModelConfig.from_dict(_PRESETS[name_or_path], where=f"preset {name_or_path}")
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model {name_or_path!r}: give a preset ({', '.join(_PRESETS)}), "
                         f"a config.json or a model directory")
    return ModelConfig.from_dict(json.loads(path.read_text()), where=str(path))
