"""A parsed tool call, and the OpenAI shapes it is sent in."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_from_json(obj: Any, names: set[str] | None = None) -> ToolCall | None:
    """A call from a parsed ``{"name": ..., "arguments"|"parameters": {...}}``; None when it is not one
    (or names a tool not offered, when ``names`` is given)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict) or (names is not None and obj["name"] not in names):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
