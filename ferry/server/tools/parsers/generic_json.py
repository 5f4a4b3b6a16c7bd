"""The generic format (a template without tools gets ``render.py``'s prompt asking for it): the whole
output is ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``, or one call, or a list of calls."""
from ferry.server.tools.parsers.base import ToolParser, read_json_calls, register

GENERIC_JSON = register(ToolParser("generic_json", None, None, read_json_calls,
                                   call_frame=('{"tool_calls"', '{{"tool_calls": [{{"name": {name}, "arguments": ', "}]}")))
