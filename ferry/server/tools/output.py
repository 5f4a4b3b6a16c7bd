"""One choice's output read as content and tool calls, whole or as it streams, for each tool_choice:
a named call's output is the arguments themselves (the grammar made it so), a required choice's is
a JSON list of calls, and under auto the format's parser finds the calls in the text."""
from __future__ import annotations

import json
from typing import Any

from ferry.server.tools.calls import ToolCall
from ferry.server.tools.parsers import ToolParser, ToolStream
from ferry.server.tools.parsers.base import read_json_calls
from ferry.server.tools.spec import ToolSpec


class ToolOutput:
    """Feed a choice's text deltas; get back content deltas and OpenAI's streamed tool_call deltas."""

    def __init__(self, spec: ToolSpec, parser: ToolParser) -> None:
        self.spec = spec
        self.stream = ToolStream(parser, spec.names) if spec.choice == "auto" else None
        self.calls: list[ToolCall] = []
        self.text = ""  # a constrained choice's whole output so far
        self._named: ToolCall | None = None

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool_call deltas) for ``text``, the choice's next text."""
        if self.stream is not None:
            content, calls = self.stream.feed(text, finished)
            return content, [self._add(c) for c in calls]
        self.text += text
        if self.spec.choice == "named":
            deltas = []
            if self._named is None:  # OpenAI's first delta of a call: id, type, name, empty arguments
                self._named = ToolCall(self.spec.named or "", "")
                self.calls.append(self._named)
                deltas.append({"index": 0, "id": self._named.id, "type": "function",
                               "function": {"name": self._named.name, "arguments": ""}})
            if text:
                self._named.arguments += text
                deltas.append({"index": 0, "function": {"arguments": text}})
            return "", deltas
        if not finished:  # required: the list is read once whole
            return "", []
        calls = read_json_calls(self.text, self.spec.names)
        if calls is None:
            return self.text, []
        return "", [self._add(c) for c in calls]

    def _add(self, call: ToolCall) -> dict[str, Any]:
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call.openai()}

    def whole(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output."""
        content, _ = self.feed(text, finished=True)
        if self.spec.choice == "named" and self._named is not None:
            try:  # normalised, as a parsed call's arguments are
                self._named.arguments = json.dumps(json.loads(self._named.arguments), ensure_ascii=False)
            except json.JSONDecodeError:  # cut short (length): the text as it is
                pass
        return content, self.calls


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if calls and reason == "stop" else reason
