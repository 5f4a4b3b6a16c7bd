"""Tokenizer and chat template, through transformers' fast tokenizer (no model code)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: Path) -> Any | None:
    """The directory's tokenizer, or None when it ships none (e.g. a dummy-weights config)."""
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def apply_chat_template(tokenizer: Any, conversation: list[dict[str, str]]) -> list[int]:
    """Token ids of ``conversation`` rendered by the model's chat template, ready for the reply."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use generate() with a plain prompt")
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
