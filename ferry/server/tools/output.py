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
    """Feed a choice's text deltas; get back content deltas and OpenAI's streamed tool_call deltas.
    Under auto, calls the model wrote in its reasoning are taken too (``feed_reasoning``): some
    models (Qwen3.5) call tools before closing their think block."""

    def __init__(self, spec: ToolSpec, parser: ToolParser) -> None:
        self.spec = spec
        auto = spec.choice == "auto"
        schemas = {f.name: f.parameters for f in spec.functions}  # a format writing untyped values reads them by these
        self.stream = ToolStream(parser, spec.names, schemas) if auto else None
        # Only a marked call is told apart from reasoning (a bare JSON object there is thinking).
        self.thinking = ToolStream(parser, spec.names, schemas) if auto and parser.start is not None else None
        self.thinking_done = False
        self.calls: list[ToolCall] = []
        self.text = ""  # a constrained choice's whole output so far
        self._named: ToolCall | None = None
        self._index: dict[int, int] = {}  # id() of a call -> its index among the choice's calls

    def feed_reasoning(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(reasoning delta, tool_call deltas) for the choice's next reasoning text; ``finished`` once
        the think block is closed (or the output ended)."""
        return joined(self.reasoning_parts(text, finished))

    def reasoning_parts(self, text: str, finished: bool) -> list[OutPart]:
        """``feed_reasoning``'s reasoning and deltas in the order written: ("text", reasoning) and ("call", delta)."""
        if self.thinking is None or self.thinking_done:
            return [("text", text)] if text else []
        self.thinking_done = finished
        self.thinking.feed(text, finished)
        return self._parts(self.thinking)

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool_call deltas) for ``text``, the choice's next text."""
        return joined(self.parts(text, finished))

    def parts(self, text: str, finished: bool) -> list[OutPart]:
        """``feed``'s content and deltas in the order written: ("text", content) and ("call", delta)."""
        if self.stream is not None:
            self.stream.feed(text, finished)
            return self._parts(self.stream)
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
            return [("call", d) for d in deltas]
        if not finished:  # required: the list is read once whole
            return []
        calls = read_json_calls(self.text, self.spec.names)
        if calls is None:
            return [("text", self.text)] if self.text else []
        return [("call", self._add(c)) for c in calls]

    def _parts(self, stream: ToolStream) -> list[OutPart]:
        """A stream's content and call events as OpenAI's deltas, in order: a new call's id, type, name
        and the arguments it comes with, then each further piece of its arguments (pieces of one
        call in a row are one delta, pieces of content in a row one text)."""
        out: list[OutPart] = []
        for part in stream.take_parts():
            if isinstance(part, str):
                if out and out[-1][0] == "text":
                    out[-1] = ("text", out[-1][1] + part)
                else:
                    out.append(("text", part))
                continue
            call, new, args = part
            if new:
                self.calls.append(call)
                self._index[id(call)] = len(self.calls) - 1
                out.append(("call", {"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": args}}))
            elif out and out[-1][0] == "call" and out[-1][1]["index"] == self._index[id(call)]:
                out[-1][1]["function"]["arguments"] += args
            else:
                out.append(("call", {"index": self._index[id(call)], "function": {"arguments": args}}))
        return out

    def _add(self, call: ToolCall) -> dict[str, Any]:
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call.openai()}

    def whole(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output."""
        content, _ = self.feed(text, finished=True)
        self.settle()
        return content, self.calls

    def settle(self) -> None:
        """The output is whole: a named call's arguments normalised, as a parsed call's are."""
        if self.spec.choice == "named" and self._named is not None:
            try:
                self._named.arguments = json.dumps(json.loads(self._named.arguments), ensure_ascii=False)
            except json.JSONDecodeError:  # cut short (length): the text as it is
                pass


# What a choice's text gives, in the order written: ("text", content or reasoning) or ("call", a tool_call delta).
OutPart = tuple[str, Any]


def joined(parts: list[OutPart]) -> tuple[str, list[dict[str, Any]]]:
    """(the text, the tool_call deltas) of ``parts``."""
    return "".join(v for k, v in parts if k == "text"), [v for k, v in parts if k == "call"]


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if calls and reason == "stop" else reason
