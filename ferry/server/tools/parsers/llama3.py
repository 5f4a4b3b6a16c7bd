"""Llama 3.1+ JSON: the output is ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>`` if
the model writes it), several separated by ``;``."""
from __future__ import annotations

from ferry.server.tools.calls import ToolCall
from ferry.server.tools.parsers.base import ToolParser, read_json_calls, register

TAG = "<|python_tag|>"


def read_llama3(body: str, names: set[str] | None) -> list[ToolCall] | None:
    body = body.removeprefix(TAG).strip()
    calls: list[ToolCall] = []
    for part in _split_objects(body):
        found = read_json_calls(part, names)
        if found is None:
            return None
        calls += found
    return calls or None


def _split_objects(body: str) -> list[str]:
    """Top-level JSON objects separated by ';' (a ';' inside a string does not split)."""
    parts, depth, quote, esc, start = [], 0, False, False, 0
    for i, ch in enumerate(body):
        if quote:
            esc, quote = (False, quote) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            quote = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.strip() for p in parts if p.strip()]


LLAMA3 = register(ToolParser("llama3_json", None, None, read_llama3, template_marks=("<|python_tag|>",),
                             leads=("{", TAG), special_markers=True,
                             call_frame=('{"name"', '{{"name": {name}, "parameters": ', "}")))
