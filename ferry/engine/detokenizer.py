"""Incremental detokenization: text deltas that never split a multi-byte character."""
from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Decodes a growing token list window by window (the prefix/read-offset method)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def append(self, token_id: int) -> str:
        self.tokens.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = decode(self.tokens[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return full[len(prefix):]
        return ""
