"""What every tool-call parser shares: the registry, whole-text extraction and streaming."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ferry.server.tools.calls import ToolCall, call_from_json

PARSERS: dict[str, "ToolParser"] = {}


@dataclass(frozen=True)
class ToolParser:
    """One output format. ``start`` opens a call (None: a call only at the start of the output, after
    ``prefixes`` if any); ``end`` closes one (None: the call runs to the end of the output)."""

    name: str
    start: str | None
    end: str | None
    read: Callable[[str, set[str] | None], list[ToolCall] | None]  # the calls in a body, None if malformed
    template_marks: tuple[str, ...] = ()  # a chat template holding one of these speaks this format
    leads: tuple[str, ...] = ("{", "[")  # with start None: how the output must begin to be a call
    special_markers: bool = False  # the markers are special tokens: the text must keep them
    short_ids: bool = False  # call ids of 9 letters and digits (Mistral's templates refuse others)
    # How one call is written, for a structural tag under tool_choice auto: (the text that opens a
    # call, its opening up to the arguments with {name} for the function's JSON-quoted name, what
    # follows the arguments). None: the format has no plain-text marker to trigger on.
    call_frame: tuple[str, str, str] | None = None


def register(parser: ToolParser) -> ToolParser:
    PARSERS[parser.name] = parser
    return parser


def parser_for_template(template: str) -> ToolParser:
    """The format a chat template speaks, from the markers it writes; generic JSON otherwise."""
    for p in PARSERS.values():
        if any(m in template for m in p.template_marks):
            return p
    return PARSERS["generic_json"]


def read_json_calls(body: str, names: set[str] | None) -> list[ToolCall] | None:
    """Calls from JSON: one call object, a list of them, or {"tool_calls": [...]}."""
    try:
        obj: Any = json.loads(body)
    except json.JSONDecodeError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
        obj = obj["tool_calls"]
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_from_json(o.get("function", o) if isinstance(o, dict) else o, names) for o in items]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


def extract(parser: ToolParser, text: str, names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output; a malformed call stays in the content as text."""
    stream = ToolStream(parser, names)
    content, calls = stream.feed(text, finished=True)
    return content, calls


class ToolStream:
    """A choice's output fed as it comes: what is content is given back as soon as it cannot be the
    start of a call; a call is given back whole once it is closed (or the output ends)."""

    def __init__(self, parser: ToolParser, names: set[str] | None = None) -> None:
        self.parser, self.names = parser, names
        self.pending = ""  # text not yet given back: a possible marker's start, or a call's body
        self.in_call = False
        self.at_start = True  # nothing but whitespace seen yet

    def feed(self, text: str, finished: bool = False) -> tuple[str, list[ToolCall]]:
        """Content and calls completed by ``text``; with ``finished``, everything left."""
        self.pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        p = self.parser
        while True:
            if self.in_call:
                end = self.pending.find(p.end) if p.end else -1
                if end < 0 and not finished:
                    break
                body = self.pending[:end] if end >= 0 else self.pending
                rest = self.pending[end + len(p.end):] if end >= 0 and p.end else ""
                found = p.read(body.strip(), self.names)
                if found is None:  # malformed: the model's text, as it wrote it
                    content.append((p.start or "") + body + (p.end if end >= 0 and p.end else ""))
                else:
                    if p.short_ids:
                        for c in found:
                            c.id = uuid.uuid4().hex[:9]
                    calls += found
                self.pending, self.in_call = rest, False
                continue
            if p.start is None:
                if not self.at_start:
                    content.append(self.pending)
                    self.pending = ""
                    break
                s = self.pending.lstrip()
                if not s and not finished:
                    break
                if any(s.startswith(lead) for lead in p.leads):
                    self.pending, self.in_call, self.at_start = s, True, False
                    continue
                if not finished and any(lead.startswith(s) for lead in p.leads):
                    break  # e.g. "<|python" of "<|python_tag|>": not decided yet
                self.at_start = False
                continue
            i = self.pending.find(p.start)
            if i >= 0:
                content.append(self.pending[:i])
                self.pending, self.in_call = self.pending[i + len(p.start):], True
                continue
            keep = 0 if finished else partial_suffix(self.pending, p.start)
            content.append(self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            break
        return "".join(content), calls


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
