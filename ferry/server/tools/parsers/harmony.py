"""gpt-oss's harmony format as a tool-call format: calls are messages to ``functions.NAME`` on the
commentary channel, read with the output's other channels by ``ferry.server.harmony`` (which the
chat routes use in place of the marker-scanning ``ToolStream`` for this format)."""
from __future__ import annotations

from ferry.server.tools.calls import ToolCall
from ferry.server.tools.parsers.base import ToolParser, register


def read_none(body: str, names: set[str] | None) -> list[ToolCall] | None:
    """Never called: ``HarmonyStream`` reads harmony output whole or streamed."""
    return None


HARMONY = register(ToolParser("harmony", None, None, read_none, template_marks=("<|channel|>",),
                              special_markers=True))
