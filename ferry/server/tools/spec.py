"""A request's tools and tool_choice, checked: each bad field is a 400 naming it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ferry.core.sampling_params import StructuredOutputs
from ferry.server.errors import APIError


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The ``{"type": "function", "function": {...}}`` shape chat templates take."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolSpec:
    """The tools offered and how the model may use them: ``choice`` is "none", "auto", "required",
    or "named" with ``named`` the function it must call."""

    functions: tuple[Function, ...]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {f.name for f in self.functions}

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def function(self, name: str) -> Function:
        return next(f for f in self.functions if f.name == name)

    def grammar(self) -> StructuredOutputs:
        """The output constraint of a required or named choice: the named function's arguments
        object, or a list of calls ``[{"name": ..., "arguments": {...}}]`` (one only, without parallel)."""
        if self.choice == "named":
            return StructuredOutputs(json=self.function(self.named or "").parameters)
        one = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                "required": ["name", "arguments"], "additionalProperties": False} for f in self.functions]
        schema: dict[str, Any] = {"type": "array", "items": one[0] if len(one) == 1 else {"anyOf": one},
                                  "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputs(json=schema)


def call_tags(spec: ToolSpec, frame: tuple[str, str, str]) -> StructuredOutputs:
    """Under tool_choice auto: text is free until the model opens a call (``frame``, a parser's
    ``call_frame``); from there to the call's end it must name an offered function and give
    arguments valid for its schema (xgrammar's triggered tags). One call per output without
    parallel tool calls."""
    trigger, begin, end = frame
    # One space at most in a row: a sampled run of whitespace could otherwise never end.
    tags = [{"type": "tag", "begin": begin.format(name=json.dumps(f.name)), "end": end,
             "content": {"type": "json_schema", "json_schema": f.parameters, "max_whitespace_cnt": 1}}
            for f in spec.functions]
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
                                                "stop_after_first": not spec.parallel}}
    return StructuredOutputs(structural_tag=json.dumps(tag))


def check_schema(schema: Any, param: str) -> None:
    """A 400 naming ``param`` unless ``schema`` is a valid JSON Schema (draft 2020-12)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON Schema object, got {json.dumps(schema)[:80]}", param=param)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        raise APIError(400, f"{param}{where} is not valid JSON Schema: {e.message}", param=param) from None


def tool_spec(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None,
              field: str = "tools", choice_field: str = "tool_choice") -> ToolSpec | None:
    """The request's tools checked (None when it offers none, or tool_choice is "none" and no
    template needs them); a 400 naming the field at fault otherwise."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(400, f"{choice_field} {json.dumps(tool_choice)} needs {field}, and none were given",
                           param=choice_field)
        return None
    functions = []
    for i, t in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise APIError(400, f"{where}.type must be 'function'", param=field)
        f = t.get("function", t)  # Responses' and Anthropic's tools are flat; chat's are nested
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str) or not name:
            raise APIError(400, f"{where}.function.name must be a non-empty string", param=field)
        params = f.get("parameters", f.get("input_schema"))
        params = {"type": "object", "properties": {}} if params is None else params
        check_schema(params, f"{where}.function.parameters")
        functions.append(Function(name, str(f.get("description") or ""), params))
    names = [f.name for f in functions]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise APIError(400, f"{field}: two tools are named {dup!r}", param=field)
    choice, named = _choice(tool_choice, set(names), choice_field)
    return ToolSpec(tuple(functions), choice, named, True if parallel is None else bool(parallel))


def _choice(tool_choice: Any, names: set[str], field: str) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict):
        f = tool_choice.get("function") if tool_choice.get("type") == "function" else None
        name = (f or {}).get("name") if isinstance(f, dict) else tool_choice.get("name")
        if isinstance(name, str):
            if name not in names:
                raise APIError(400, f"{field} names the function {name!r}, which is not among the tools "
                               f"({', '.join(sorted(names))})", param=field)
            return "named", name
    raise APIError(400, f"{field} must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                   f"\"function\": {{\"name\": ...}}}}, got {json.dumps(tool_choice)[:80]}", param=field)
