"""How tools reach the prompt: through the model's chat template when it takes them; otherwise a
generic system prompt (as llama.cpp's server does) and past calls and results written as text."""
from __future__ import annotations

import json
from typing import Any

from ferry.server.tools.spec import ToolSpec

GENERIC_PROMPT = (
    "You can call these tools (JSON Schema of each one's arguments):\n{tools}\n\n"
    "To call tools, answer with only this JSON and nothing else: "
    '{{"tool_calls": [{{"name": "<tool name>", "arguments": {{...}}}}]}}\n'
    "Otherwise answer the user directly.")


def template_takes_tools(template: str) -> bool:
    return "tools" in template


def harmony_message(m: dict[str, Any]) -> dict[str, Any]:
    """An assistant message as gpt-oss's template reads it: its reasoning under "thinking", and text
    content (the template tests what the content holds: null would fail the render)."""
    if m.get("reasoning_content") is not None and m.get("thinking") is None:
        m["thinking"] = m.pop("reasoning_content")
    if m.get("content") is None:
        m["content"] = ""
    return m


def _arguments(args: Any) -> Any:
    """Templates iterate or tojson the arguments: a JSON string becomes the object it holds."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def with_tools(conv: list[dict[str, Any]], spec: ToolSpec | None, template: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(conversation, tools for the template): the conversation rewritten where the template needs it."""
    takes = template_takes_tools(template)
    harmony = "<|channel|>" in template
    out = []
    for m in conv:
        m = dict(m)
        if harmony and m.get("role") == "assistant":
            m = harmony_message(m)
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c.get("function", {}),
                                        "arguments": _arguments(c.get("function", {}).get("arguments"))}}
                     for c in m["tool_calls"]]
            if takes:
                m["tool_calls"] = calls
            else:  # written as the generic format, so the model sees what it is asked to write
                m.pop("tool_calls")
                text = json.dumps({"tool_calls": [{"name": c["function"].get("name"),
                                                   "arguments": c["function"].get("arguments")} for c in calls]})
                m["content"] = ((m.get("content") or "") + "\n" + text).strip()
        if m.get("role") == "tool" and not takes:
            m = {"role": "user", "content": f"Tool result ({m.get('tool_call_id', '')}): {m.get('content') or ''}"}
        out.append(m)
    if spec is None or spec.choice == "none":
        return out, None
    tools = [f.openai() for f in spec.functions]
    if takes:
        return out, tools
    prompt = GENERIC_PROMPT.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None
