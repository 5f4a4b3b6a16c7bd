"""OpenAI's harmony format (gpt-oss): the output is messages, each a header then ``<|message|>`` and
a body ended by ``<|end|>`` (another message follows, after ``<|start|>``), ``<|call|>`` (a tool
call) or ``<|return|>`` (the answer is over). A header names the message's channel
(``<|channel|>analysis``, ``commentary`` or ``final``) and may address a tool (``to=functions.NAME``,
before or after the channel; ``<|constrain|>json`` or ``json`` says the body is JSON). The prompt
ends with ``<|start|>assistant``, so the output starts inside a header.

Read whole or as it streams (the same pieces however the text is split): the analysis channel is
reasoning, a message to ``functions.NAME`` a tool call (its body the arguments), any other message
(final, or commentary to the user) content. The special tokens must be in the text
(``skip_special_tokens`` false)."""
from __future__ import annotations

import json
import re
from typing import Any

from ferry.server.tools.calls import ToolCall
from ferry.server.tools.parsers.base import partial_suffix

MESSAGE, START, CHANNEL = "<|message|>", "<|start|>", "<|channel|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")  # what closes a message's body
SPECIAL = re.compile(r"<\|[a-z_]+\|>")
RECIPIENT = re.compile(r"\bto=(\S+)")

# One piece of the output, in the order written: ("reasoning", text), ("content", text) or ("call",
# OpenAI's streamed tool_call delta), as ``ferry.server.openai.chat.ChoiceText`` gives them.
Piece = tuple[str, Any]


def read_header(header: str) -> tuple[str, str | None]:
    """(channel, recipient or None) of a message header such as
    ``assistant<|channel|>commentary to=functions.f <|constrain|>json``."""
    channel = ""
    if CHANNEL in header:
        channel = SPECIAL.sub(" ", header.split(CHANNEL, 1)[1]).split()[0:1]
        channel = channel[0] if channel else ""
    found = RECIPIENT.search(SPECIAL.sub(" ", header))
    return channel, found.group(1) if found else None


class HarmonyStream:
    """Feed a choice's text; get back its pieces. ``calls``: where new tool calls are appended (the
    route's list: ``ToolOutput.calls``); None when the request offered no tools (a message to a
    function is then content, as written). ``names``: the offered functions (a call to another is content)."""

    def __init__(self, calls: list[ToolCall] | None = None, names: set[str] | None = None) -> None:
        self.calls = calls
        self.names = names
        self.state = "header"  # header -> body -> (after an end) between -> header ...
        self.pending = ""
        self.kind = "content"  # the body's piece kind: "reasoning", "content" or "call"
        self.call: ToolCall | None = None
        self.saw = False  # an analysis message was read: the reply has reasoning
        self.opened = False  # some message was opened (else the output is plain text: content)

    def feed(self, text: str, finished: bool = False) -> list[Piece]:
        """The pieces ``text`` (the choice's next text) completes; ``finished``: the output is over."""
        self.pending += text
        out: list[Piece] = []
        while True:
            if self.state == "between":  # after <|end|>: the next message's <|start|>, or stray text
                s = self.pending.lstrip()
                if s.startswith(START):
                    self.pending, self.state = s[len(START):], "header"
                    continue
                if not finished and START.startswith(s):
                    break
                self.pending, self.state = s, "header"  # a header without <|start|>
                continue
            if self.state == "header":
                i = self.pending.find(MESSAGE)
                if i < 0:
                    if finished:  # plain text (no message ever opened) is content; a header cut short is dropped
                        if not self.opened and self.pending.strip():
                            out.append(("content", SPECIAL.sub("", self.pending)))
                        self.pending = ""
                    break
                self._open(self.pending[:i], out)
                self.pending, self.state = self.pending[i + len(MESSAGE):], "body"
                continue
            ends = [(j, e) for e in ENDS if (j := self.pending.find(e)) >= 0]
            if ends:
                j, end = min(ends)
                self._body(self.pending[:j], out)
                self._close(out)
                self.pending, self.state = self.pending[j + len(end):], "between"
                continue
            keep = 0 if finished else max(partial_suffix(self.pending, e) for e in ENDS)
            self._body(self.pending[:len(self.pending) - keep], out)
            self.pending = self.pending[len(self.pending) - keep:]
            if finished:
                self._close(out)
            break
        return _merged(out)

    def _open(self, header: str, out: list[Piece]) -> None:
        channel, to = read_header(header)
        self.opened = True
        name = to.removeprefix("functions.") if to and to.startswith("functions.") else None
        if name is not None and self.calls is not None and (self.names is None or name in self.names):
            self.kind, self.call = "call", ToolCall(name, "")
            self.calls.append(self.call)
            out.append(("call", {"index": len(self.calls) - 1, "id": self.call.id, "type": "function",
                                 "function": {"name": name, "arguments": ""}}))
        else:
            self.kind = "reasoning" if channel == "analysis" else "content"
            self.saw = self.saw or channel == "analysis"

    def _body(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self.kind == "call":
            self.call.arguments += text
            out.append(("call", {"index": len(self.calls) - 1, "function": {"arguments": text}}))
        else:
            out.append((self.kind, text))

    def _close(self, out: list[Piece]) -> None:
        """A call's arguments, whole now, normalised as a parsed call's are (the streamed text stands)."""
        if self.call is not None:
            try:
                self.call.arguments = json.dumps(json.loads(self.call.arguments), ensure_ascii=False)
            except json.JSONDecodeError:  # cut short (length): the text as it is
                pass
        self.call, self.kind = None, "content"


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Runs of one text kind as one piece, and a call's argument deltas in a row as one delta."""
    out: list[Piece] = []
    for kind, value in pieces:
        if out and kind == out[-1][0] and kind != "call":
            out[-1] = (kind, out[-1][1] + value)
        elif (out and kind == "call" == out[-1][0] and "id" not in value
              and out[-1][1]["index"] == value["index"]):
            prev = out[-1][1]
            out[-1] = ("call", {**prev, "function": {**prev["function"],
                                                     "arguments": prev["function"]["arguments"] + value["function"]["arguments"]}})
        else:
            out.append((kind, value))
    return out
