"""Tokenizer and chat template.

Encoding and decoding use the ``tokenizers`` library directly (fast to import).
The chat template is rendered by transformers' tokenizer, loaded on first use,
so a start that never chats does not pay for importing transformers.
"""
from __future__ import annotations

import functools
import json
import threading
from pathlib import Path
from typing import Any


# transformers loads its names lazily, and two threads importing them at once can fail
# ("cannot import name 'AutoTokenizer'"): every first use of it (chat templates here, xgrammar
# for structured outputs) happens under this lock.
TRANSFORMERS_LOCK = threading.Lock()


class Tokenizer:
    """encode/decode over tokenizer.json; apply_chat_template through transformers."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer as FastTokenizer

        self.model_dir = model_dir
        self._fast = FastTokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        eos = cfg.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id: int | None = self._fast.token_to_id(eos) if eos else None
        self.has_chat_template = bool(cfg.get("chat_template")) or (model_dir / "chat_template.jinja").is_file()
        self._hf: Any = None

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters in the longest token (special tokens included): a bound on what one token covers."""
        return max(map(len, self._fast.get_vocab(with_added_tokens=True)))

    def __len__(self) -> int:
        return self._fast.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a long prompt tokenized
        # in a server's worker thread must not stall its event loop.
        return self._fast.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """Token ids of ``conversation`` rendered by the model's chat template, ready for the reply;
        ``tools`` (OpenAI's function specs) and ``template_kwargs`` (e.g. enable_thinking) go to it."""
        return self.encode(self.render_chat(conversation, tools, add_generation_prompt, **template_kwargs))

    def render_chat(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """The text of ``conversation`` through the chat template (see apply_chat_template)."""
        return self._transformers().apply_chat_template(conversation, tools=tools, tokenize=False,
                                                        add_generation_prompt=add_generation_prompt,
                                                        **template_kwargs)

    def _transformers(self) -> Any:
        """transformers' tokenizer of the model, loaded on first use (it holds the chat template)."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        with TRANSFORMERS_LOCK:  # a server renders chats in several threads at once
            if self._hf is None:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(str(self.model_dir))
        return self._hf

    @property
    def chat_template_loaded(self) -> bool:
        """Whether chat_template_context answers at once (transformers' tokenizer is loaded)."""
        return self._hf is not None

    def chat_template_context(self, tools: list[dict[str, Any]] | None = None,
                              chat_template: str | None = None) -> tuple[str, dict[str, Any]]:
        """What a render outside transformers' tokenizer needs, as its apply_chat_template would
        use them: the template's source (``chat_template`` itself or one of the model's named
        templates; by default the model's, its tool-use one when there are ``tools``) and the
        special tokens templates read (bos_token, ...)."""
        hf = self._transformers()
        return hf.get_chat_template(chat_template, tools), dict(hf.special_tokens_map)

    @functools.cached_property
    def chat_template(self) -> str:
        """The chat template's source ("" when there is none): tool-call parsers are chosen from it."""
        if not self.has_chat_template:
            return ""
        path = self.model_dir / "chat_template.jinja"
        if path.is_file():
            return path.read_text()
        cfg = json.loads((self.model_dir / "tokenizer_config.json").read_text())
        t = cfg.get("chat_template")
        return t if isinstance(t, str) else json.dumps(t)


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    """The directory's tokenizer, or None when it ships no tokenizer.json (e.g. dummy weights)."""
    if not (model_dir / "tokenizer.json").is_file():
        return None
    return Tokenizer(model_dir)


def apply_chat_template(tokenizer: Tokenizer | None, conversation: list[dict[str, str]]) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so no chat template; pass token ids to generate()")
    return tokenizer.apply_chat_template(conversation)
