"""Hermes / Qwen: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
from ferry.server.tools.parsers.base import ToolParser, read_json_calls, register

HERMES = register(ToolParser("hermes", "<tool_call>", "</tool_call>", read_json_calls,
                             template_marks=("<tool_call>",),
                             call_frame=("<tool_call>", '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>")))
