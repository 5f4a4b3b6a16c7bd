"""A request's tools and tool_choice, checked: each bad field is a 400 naming it."""
from __future__ import annotations

import functools
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
        object, or a list of calls ``[{"name": ..., "arguments": {...}}]`` (one only, without parallel).
        Each function's references (``$ref``) resolve against its own parameters wherever they sit,
        and a grammar that does not compile is an error about ``tools``, the field the client sent."""
        from ferry.executor.structured import DerivedOutputs, rebase_refs

        if self.choice == "named":
            i = next(i for i, f in enumerate(self.functions) if f.name == self.named)
            return DerivedOutputs(json=self.functions[i].parameters,
                                  source=f"tools[{i}] ({self.named!r}, forced by tool_choice)")
        at = ["/items" if len(self.functions) == 1 else f"/items/anyOf/{i}" for i in range(len(self.functions))]
        one = [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                "properties": {"name": {"const": f.name},
                               "arguments": rebase_refs(f.parameters, f"{where}/properties/arguments")}}
               for f, where in zip(self.functions, at)]
        schema: dict[str, Any] = {"type": "array", "items": one[0] if len(one) == 1 else {"anyOf": one},
                                  "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return DerivedOutputs(json=schema, source="tools (a call forced by tool_choice)")


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


# JSON nesting a function's parameters may have (about half as many schema levels): deeper, a
# schema's checks recurse past Python's limit (150 levels once gave a RecursionError per request).
MAX_SCHEMA_DEPTH = 64


def check_tool_count(tools: list[Any] | None, max_tools: int, field: str = "tools") -> None:
    """A 400 naming ``field`` when there are more than ``max_tools`` tools (at once, whatever they hold)."""
    if tools and len(tools) > max_tools:
        raise APIError(400, f"{field}: {len(tools)} tools, more than this server takes ({max_tools}, --max-tools)",
                       param=field)


def check_tool_limits(tools: list[Any] | None, max_tools: int, max_bytes: int, field: str = "tools") -> int:
    """The tools' JSON size (0 for none); a 400 naming ``field`` when there are more than
    ``max_tools`` (checked first: no work is done on a long list) or their JSON is larger than
    ``max_bytes``, all together."""
    if not tools:
        return 0
    check_tool_count(tools, max_tools, field)
    try:
        size = len(json.dumps(tools, ensure_ascii=False, separators=(",", ":")).encode())
    except RecursionError:
        raise APIError(400, f"{field}: nested too deep (a function's parameters may nest "
                            f"{MAX_SCHEMA_DEPTH} levels)", param=field) from None
    if size > max_bytes:
        raise APIError(400, f"{field}: {size:,} bytes of JSON, more than this server takes "
                            f"({max_bytes:,}, --max-tools-bytes)", param=field)
    return size


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and objects deeper than ``limit`` (iterative: any depth is safe)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _check_shape(schema: Any, param: str) -> None:
    """The checks a schema needs before any validator walks it: an object, not nested too deep."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON Schema object, got {json.dumps(schema)[:80]}", param=param)
    if _depth_over(schema, MAX_SCHEMA_DEPTH):
        raise APIError(400, f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param)


SCHEMA_CACHE_CHARS = 16_384


@functools.lru_cache(maxsize=1024)
def _schema_error(canonical: str) -> tuple[str, str] | None:
    """(where, message) of the first error in a schema (its canonical JSON), or None when valid:
    remembered, since an agent sends the same tools with every turn and a check takes milliseconds."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(json.loads(canonical))
    except SchemaError as e:
        return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path), e.message
    return None


def check_schema(schema: Any, param: str) -> None:
    """A 400 naming ``param`` unless ``schema`` is a valid JSON Schema (draft 2020-12)."""
    _check_shape(schema, param)
    canonical = json.dumps(schema, sort_keys=True)
    # Only small schemas are remembered: a thousand large ones would hold their size a thousand times.
    error = (_schema_error if len(canonical) <= SCHEMA_CACHE_CHARS else _schema_error.__wrapped__)(canonical)
    if error is not None:
        where, message = error
        raise APIError(400, f"{param}{where} is not valid JSON Schema: {message}", param=param)


def check_schemas(spec: ToolSpec | None, field: str = "tools") -> None:
    """Every function's parameters validated (a 400 naming the first that is not a JSON Schema):
    the costly check, done last and off the event loop (``tool_spec(..., schemas=False)`` first)."""
    for i, f in enumerate(spec.functions if spec is not None else ()):
        check_schema(f.parameters, f"{field}[{i}].function.parameters")


def tool_spec(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None,
              field: str = "tools", choice_field: str = "tool_choice", schemas: bool = True) -> ToolSpec | None:
    """The request's tools checked (None when it offers none, or tool_choice is "none" and no
    template needs them); a 400 naming the field at fault otherwise. In linear time; without
    ``schemas`` the parameters are checked for shape only, and ``check_schemas`` validates them."""
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
        (check_schema if schemas else _check_shape)(params, f"{where}.function.parameters")
        functions.append(Function(name, str(f.get("description") or ""), params))
    seen: set[str] = set()
    for f in functions:
        if f.name in seen:
            raise APIError(400, f"{field}: two tools are named {f.name!r}", param=field)
        seen.add(f.name)
    choice, named = _choice(tool_choice, seen, choice_field)
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
