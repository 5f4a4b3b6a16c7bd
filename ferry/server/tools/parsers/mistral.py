"""Mistral: ``[TOOL_CALLS]`` then a JSON list of calls (v3), or ``name[ARGS]{...}`` per call (v11+)."""
from __future__ import annotations

import json

from ferry.server.tools.calls import ToolCall, call_from_json
from ferry.server.tools.parsers.base import ToolParser, read_json_calls, register


def read_mistral(body: str, names: set[str] | None) -> list[ToolCall] | None:
    if body.startswith(("[", "{")):
        return read_json_calls(body, names)
    calls = []
    for part in body.split("[TOOL_CALLS]"):  # v11 repeats the marker before each call
        name, sep, args = part.partition("[ARGS]")
        if not sep:
            return None
        try:
            call = call_from_json({"name": name.strip(), "arguments": json.loads(args)}, names)
        except json.JSONDecodeError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls or None


MISTRAL = register(ToolParser("mistral", "[TOOL_CALLS]", None, read_mistral, template_marks=("[TOOL_CALLS]",),
                              special_markers=True, short_ids=True, args_marker="[ARGS]"))
